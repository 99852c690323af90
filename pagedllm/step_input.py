"""What the model runner receives each step: plain data, no engine objects (as vLLM v1's scheduler
output). A request's static data comes once, the first time it is scheduled; from then on the runner
keeps that request's state (its tokens, audio delay-pattern state) until the
request is listed as finished. This is also what another rank's worker process would receive."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import GrammarBitmask

Frame = tuple[int, ...]  # one audio position's codes, one per codebook
BlockCopy = tuple[int, int]  # (source block, destination block)


class TokenSequence:
    """What the engine's Request and the runner's RunnerRequest both derive from their token ids
    (`all_token_ids`: the prompt, then the generated tokens; `num_prompt_tokens`; `sampling_params`)."""

    all_token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)


def frames_between(prompt_frames: list[Frame | None] | None, num_prompt_tokens: int,
                   generated: list[list[int]], start: int, end: int) -> list[Frame | None]:
    """The frames of positions [start, end) of a sequence (None at text positions): the prompt's, then the
    generated ones (every generated position of an audio model is a frame)."""
    p = num_prompt_tokens
    out: list[Frame | None] = []
    if start < p:
        out.extend(prompt_frames[start:min(end, p)] if prompt_frames is not None else [None] * (min(end, p) - start))
    if end > p:
        out.extend(tuple(f) for f in generated[max(start, p) - p:end - p])
    return out


@dataclass(frozen=True)
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]  # what min_tokens keeps the sampler from picking
    # Multi-codebook audio models: the prompt's frames (None at text positions), and the audio
    # generation state at admission (the runner owns it from here on).
    prompt_frames: list[Frame | None] | None = None
    audio_state: Any = None
    pooling_params: PoolingParams | None = None  # a pooling request's (its prompt is pooled, nothing sampled)


@dataclass(frozen=True)
class ScheduledTokens:
    """One request's slice of the step: tokens [num_computed_tokens, num_computed_tokens + num_new_tokens),
    their K/V going to the blocks of block_tables (one table per KV group, kv_layout.py)."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    block_tables: list[list[int]]
    samples: bool  # the slice reaches the end of the request's tokens: a token is sampled (a pooling request pooled)
    # Speculative decoding: the slice's last len(spec_token_ids) tokens are drafts after the request's tokens;
    # the step checks them (a sampling row for each, and one after the last).
    spec_token_ids: tuple[int, ...] = ()


@dataclass
class StepInput:
    scheduled: list[ScheduledTokens] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)  # seen by the runner for the first time
    finished_request_ids: list[str] = field(default_factory=list)  # since the last step: drop their state
    # K/V block copies before this step's forward: swap-outs first, then swap-ins.
    blocks_to_swap_out: list[BlockCopy] = field(default_factory=list)  # (device block, host block)
    blocks_to_swap_in: list[BlockCopy] = field(default_factory=list)  # (host block, device block)
    # Structured outputs: the allowed tokens of this step's constrained sampling rows (None: none is).
    grammar_bitmask: GrammarBitmask | None = None
    # Speculative decoding: drafts to propose after this step, per request (None: the configured number)
    num_drafts_wanted: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
