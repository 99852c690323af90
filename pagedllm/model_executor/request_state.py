"""The model runner's own state of a request, built from its NewRequestData and kept until the
request finishes: the token ids (the prompt, then what the runner sampled) and an audio model's
delay-pattern state. The sampler reads these."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.step_input import Frame, NewRequestData, TokenSequence, frames_between
from pagedllm.model_executor.pooler import PoolingState
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.model_executor.audio_sampling import AudioGenerationState


@dataclass
class RunnerRequest(TokenSequence):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    all_token_ids: list[int] = field(default_factory=list)  # prompt + sampled
    prompt_frames: list[Frame | None] | None = None
    audio_state: AudioGenerationState | None = None
    pooling_params: PoolingParams | None = None
    pooling: PoolingState = field(default_factory=PoolingState)  # a pooling request's pool so far
    # Speculative decoding with a draft model: the draft's distributions of its pending drafts (sampled requests)
    draft_probs: Any = None

    def __post_init__(self) -> None:
        if self.sampling_params.ignore_eos:  # eos is then an ordinary token (as the engine's Request has it)
            self.eos_token_ids = frozenset()

    @classmethod
    def from_new(cls, new: NewRequestData) -> RunnerRequest:
        return cls(new.request_id, list(new.prompt_token_ids), new.sampling_params, frozenset(new.eos_token_ids),
                   list(new.prompt_token_ids), new.prompt_frames, new.audio_state, new.pooling_params)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def has_audio(self) -> bool:
        """Positions of this request carry audio frames (its prompt's, or generated ones)."""
        return self.prompt_frames is not None or self.audio_state is not None

    def frames(self, start: int, end: int) -> list[Frame | None]:
        """The frames of positions [start, end) (None at text positions). Only for `has_audio` requests."""
        generated = self.audio_state.frames if self.audio_state is not None else []
        return frames_between(self.prompt_frames, self.num_prompt_tokens, generated, start, end)
