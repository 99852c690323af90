"""What generation returns: vLLM's RequestOutput / CompletionOutput / Logprob shapes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported at run time: `import pagedllm` stays light for the isolated workers
    import torch


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
    # Audio models: the generated codes, (frames, num_codebooks), delay pattern and stream bos/eos removed
    # (what an audio tokenizer decodes). While streaming: the frames whose every codebook is known so far.
    # `text` is then "" and `token_ids` holds the audio placeholder tokens (and the final eos).
    audio_codes: torch.Tensor | None = None

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


@dataclass
class PoolingOutput:
    """A pooling request's output (vLLM's shape): `data`, a float32 vector on the host: the embedding, or the
    classifier's probabilities (logits with use_activation off)."""

    data: torch.Tensor

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def probs(self) -> list[float]:
        return self.data.tolist()

    @property
    def score(self) -> float:
        """A single-label classifier's score (a cross-encoder's relevance)."""
        if self.data.numel() != 1:
            raise ValueError(f"score is a single-label classifier's output; this one has {self.data.numel()} labels")
        return float(self.data[0])


@dataclass
class PoolingRequestOutput:
    """What a pooling request produced (LLM.embed / classify / encode, the server's pooling routes)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    metrics: dict = field(default_factory=dict)
