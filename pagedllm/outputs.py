"""What generation returns: vLLM's RequestOutput / CompletionOutput / Logprob shapes."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log probability, its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the chosen token plus the top-N alternatives).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence (one of a request's `n` samples)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything a request has produced so far; `finished` once every sample has ended."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
