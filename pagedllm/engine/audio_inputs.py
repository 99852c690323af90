"""Requests of multi-codebook audio models (Higgs Audio v2): prompts holding audio code spans (a
reference voice), each request's generation state, and the audio codes its outputs report.

A prompt dict may carry audio in one of two forms, both as the reference's processor builds them:

- `"audio": [clip, ...]`: each clip the codes of an audio tokenizer, shape (frames, num_codebooks),
  ids below the stream bos/eos ids; the prompt (text or ids) holds one audio token
  (`<|AUDIO_OUT|>`, config `audio_token_id`) per clip, which is expanded, as the processor expands
  it, to the placeholders of the clip's delayed frames (stream bos, codes, stream eos, delay pattern).
  The `audio_codes` of an output can be passed back here as a clip.
- `"audio_codes": frames`: the processor's output, shape (placeholders, num_codebooks): one frame
  (delay pattern applied, stream ids included) per placeholder token of `prompt_token_ids`, in order.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.step_input import Frame
from pagedllm.errors import InvalidPromptError
from pagedllm.model_executor.audio_sampling import (
    AudioGenerationState,
    DelayPatternSpec,
    RepetitionAwareSampling,
    audio_placeholder_ids,
    build_delay_pattern,
    extract_audio_codes,
)
from pagedllm.model_executor.model_files import generation_config

logger = logging.getLogger(__name__)

AUDIO_PROMPT_KEYS = ("audio", "audio_codes")


@dataclass(frozen=True)
class AudioPrompt:
    """A prompt's token ids with its audio placeholders expanded, and the frame of every position."""

    token_ids: list[int]
    frames: list[Frame | None] | None  # aligned with token_ids; None: no audio position at all
    codes: torch.Tensor | None  # (audio positions, num_codebooks): the frames in order


def refuse_audio(prompt: object) -> None:
    """A text model's prompt must not carry audio."""
    if isinstance(prompt, dict) and any(k in prompt for k in AUDIO_PROMPT_KEYS):
        raise InvalidPromptError("this model takes no audio: 'audio' / 'audio_codes' are for audio models "
                                 "(HiggsAudioV2ForConditionalGeneration)")


@dataclass(frozen=True)
class AudioGeneration:
    """How an engine of a delay-pattern audio model reads prompts and sets up its requests."""

    spec: DelayPatternSpec
    ras: RepetitionAwareSampling | None  # repetition-aware sampling (from generation_config.json), or off

    @classmethod
    def for_model(cls, spec: DelayPatternSpec | None, model_path: Path, repetition_aware_sampling: bool
                  ) -> AudioGeneration | None:
        """None for a text model (its runner reports no `audio_spec`)."""
        if spec is None:
            return None
        ras = RepetitionAwareSampling.from_generation_config(generation_config(model_path))
        if ras is None:
            logger.info("audio model: no repetition-aware sampling (generation_config.json sets no ras_win_len)")
        elif not repetition_aware_sampling:
            logger.info("audio model: repetition-aware sampling of generation_config.json turned off")
            ras = None
        else:
            logger.info("audio model: repetition-aware sampling, window %d frames, at most %d repeats "
                        "(generation_config.json; repetition_aware_sampling=False turns it off)", ras.window,
                        ras.max_repeat)
        return cls(spec, ras)

    # -- prompts --------------------------------------------------------------------------------
    def prompt(self, prompt: object, token_ids: list[int]) -> AudioPrompt:
        """Expand and check the prompt's audio against its placeholder tokens."""
        clips = prompt.get("audio") if isinstance(prompt, dict) else None
        frames = prompt.get("audio_codes") if isinstance(prompt, dict) else None
        if clips is not None and frames is not None:
            raise InvalidPromptError("pass a prompt's audio as 'audio' (clips) or 'audio_codes' (frames), not both")
        if clips is not None:
            token_ids, frames = self._expand_clips(token_ids, clips)
        elif frames is not None:
            frames = self._codes(frames, "audio_codes", self.spec.codebook_size)
        return self._align(token_ids, frames)

    def _expand_clips(self, token_ids: list[int], clips: object) -> tuple[list[int], torch.Tensor]:
        """Each audio token of the prompt -> the placeholders of its clip's delayed frames."""
        spec = self.spec
        if not isinstance(clips, (list, tuple)):
            raise InvalidPromptError("'audio' must be a list of clips, each of shape (frames, num_codebooks)")
        markers = token_ids.count(spec.audio_token_id)
        if markers != len(clips) or spec.audio_delay_token_id in token_ids:
            raise InvalidPromptError(
                f"with 'audio', the prompt must hold one audio token (id {spec.audio_token_id}) per clip and no "
                f"delay token (id {spec.audio_delay_token_id}); it holds {markers} audio tokens for {len(clips)} clips")
        limit = min(spec.stream_bos_id, spec.stream_eos_id)
        delayed = [build_delay_pattern(self._codes(c, f"audio[{i}]", limit), spec) for i, c in enumerate(clips)]
        expanded, next_clip = [], iter(delayed)
        for t in token_ids:
            expanded.extend(audio_placeholder_ids(len(next(next_clip)), spec) if t == spec.audio_token_id else [t])
        return expanded, torch.cat(delayed) if delayed else torch.empty((0, spec.num_codebooks), dtype=torch.long)

    def _codes(self, value: object, name: str, limit: int) -> torch.Tensor:
        """An integer (frames >= 1, num_codebooks) array with every id in [0, limit)."""
        k = self.spec.num_codebooks
        try:
            codes = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InvalidPromptError(f"{name} must be an integer array of shape (frames, {k}): {e}") from None
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            raise InvalidPromptError(f"{name} must hold integer codes, got dtype {codes.dtype}")
        if codes.dim() != 2 or codes.shape[0] < 1 or codes.shape[1] != k:
            raise InvalidPromptError(f"{name} must have shape (frames >= 1, {k}) (num_codebooks {k}), "
                                     f"got {tuple(codes.shape)}")
        if bool(((codes < 0) | (codes >= limit)).any()):
            bad = codes[(codes < 0) | (codes >= limit)][:5].tolist()
            raise InvalidPromptError(f"{name} holds codes {bad} outside [0, {limit})")
        return codes.to(device="cpu", dtype=torch.long)

    def _align(self, token_ids: list[int], codes: torch.Tensor | None) -> AudioPrompt:
        """One frame per placeholder token, in order; text positions get None."""
        placeholders = self.spec.placeholder_token_ids
        positions = [i for i, t in enumerate(token_ids) if t in placeholders]
        given = 0 if codes is None else len(codes)
        if len(positions) != given:
            raise InvalidPromptError(
                f"the prompt holds {len(positions)} audio placeholder tokens (ids {placeholders}) but {given} audio "
                f"frames: pass one frame per placeholder ('audio_codes'), or clips ('audio') with one audio token each")
        if codes is None:
            return AudioPrompt(token_ids, None, None)
        frames: list[Frame | None] = [None] * len(token_ids)
        for pos, frame in zip(positions, codes.tolist()):
            frames[pos] = tuple(frame)
        return AudioPrompt(token_ids, frames, codes)

    # -- requests and outputs -------------------------------------------------------------------
    def new_state(self, prompt: AudioPrompt, seed: int | None) -> AudioGenerationState:
        """A request's audio state at admission (counters from the prompt's tail, RAS history)."""
        return AudioGenerationState.from_prompt(self.spec, prompt.token_ids, prompt.codes, ras=self.ras, seed=seed)

    def output_codes(self, frames: list[list[int]]) -> torch.Tensor:
        """A request's generated frames so far as codes, (frames, num_codebooks), delay pattern removed: the
        rows whose every codebook is known (streaming grows them), as the processor's batch_decode reads them."""
        if not frames:
            return torch.empty((0, self.spec.num_codebooks), dtype=torch.long)
        return extract_audio_codes(torch.tensor(frames, dtype=torch.long), self.spec)
