"""Request: all per-request state the engine keeps, with the two cursors that describe progress."""
from __future__ import annotations

import enum
import time
from typing import Any

from pagedllm.step_input import Frame, TokenSequence, frames_between
from pagedllm.outputs import Logprob
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Statuses greater than SWAPPED are finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # preempted by recompute: waiting, its K/V dropped
    SWAPPED = 3  # preempted by swap: its K/V in the host (swap) pool until it is swapped back in
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def finished(self) -> bool:
        return self > RequestStatus.SWAPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request(TokenSequence):
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
        cache_salt: str | None = None,
        priority: int = 0,
        prompt_frames: list[Frame | None] | None = None,
        audio_state: Any = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.pooling_params = pooling_params  # a pooling request: done once its prompt is computed
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
        # vLLM's convention: a lower value is a higher priority. When blocks run out, the running
        # request with the largest (priority, arrival_time) is preempted first.
        self.priority = priority
        self.first_scheduled_time: float | None = None
        # Generation may not run past the context window.
        max_tokens = sampling_params.max_tokens
        room = max_model_len - self.num_prompt_tokens
        self.max_output_tokens = room if max_tokens is None else min(max_tokens, room)
        # Prefix caching: requests with different salts never share blocks. The chain hashes of the
        # full blocks of all_token_ids are filled in (and extended) by the KVCacheManager.
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        # Multi-codebook audio models: a position is an audio frame (a vector of codes) or a text token.
        # `prompt_frames` is aligned with the prompt (None at text positions); every generated position is
        # a frame. `audio_state` (the delay pattern's state at admission) goes to the model runner with the
        # request, which owns it from then on and reports each frame it samples (`audio_frames`).
        self.prompt_frames = prompt_frames
        self.audio_state = audio_state
        self.generates_audio = audio_state is not None
        self.audio_frames: list[list[int]] = []  # generated, delay pattern included
        self.audio_finished = False  # every codebook emitted stream eos
        # What the engine reports (the sampling state itself lives in the model runner).
        self.output_logprobs: list[dict[int, Logprob]] = []
        # Structured outputs: the matcher of the request's constraint (a structured_output.GrammarState), made
        # at its first sampling step; the step's bitmask is filled from it.
        self.grammar: Any = None
        # Speculative decoding: the runner's proposed next tokens, checked when the request is next scheduled.
        self.spec_token_ids: list[int] = []
        self.spec_acceptance: tuple[float, float] | None = None  # its first drafts: (kept, looked at), recent (policy.py)
        self.prompt_logprobs: list[dict[int, Logprob] | None] = []
        self.cumulative_logprob = 0.0

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def has_audio(self) -> bool:
        """Positions of this request carry audio frames (its prompt's, or generated ones)."""
        return self.prompt_frames is not None or self.generates_audio

    def frames(self, start: int, end: int) -> list[Frame | None]:
        """The frames of positions [start, end) (None at text positions), as the runner reported the
        generated ones. Only for `has_audio` requests (prefix-cache hashes tell audio blocks apart by them)."""
        return frames_between(self.prompt_frames, self.num_prompt_tokens, self.audio_frames, start, end)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
