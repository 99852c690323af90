"""Request: all per-request state the engine keeps, with the two cursors that describe progress."""
from __future__ import annotations

import enum
import time

import torch

from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Statuses greater than PREEMPTED are finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence being generated.

    `num_computed_tokens` counts the tokens whose K/V are in the cache; the scheduler moves it
    toward `num_tokens` (prompt + output) each step, so prefill, chunked prefill, decode and
    recompute after preemption are all the same motion.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int],
        max_model_len: int,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = set() if sampling_params.ignore_eos else set(eos_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        # Generation may not run past the context window.
        max_tokens = sampling_params.max_tokens
        room = max_model_len - self.num_prompt_tokens
        self.max_output_tokens = room if max_tokens is None else min(max_tokens, room)
        # Sampling state.
        # A seeded request samples from its own generator (made by the sampler on the model's
        # device), so its output does not depend on what else is in the batch.
        self.generator: torch.Generator | None = None
        self.output_logprobs: list[dict[int, Logprob]] = []
        self.prompt_logprobs: list[dict[int, Logprob] | None] = []
        self.cumulative_logprob = 0.0

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
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
