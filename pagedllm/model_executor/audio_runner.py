"""The model runner's part for multi-codebook audio models: the audio inputs of a step's token slices,
and sampling frames instead of tokens. Text models never reach this module."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm.model_executor.audio_sampling import (
    AudioGenerationState,
    DelayPatternSpec,
    sample_audio_steps,
)
from pagedllm.model_executor.request_state import RunnerRequest as Request
from pagedllm.model_executor.sampler import SampledRow
from pagedllm.sampling_params import SamplingParams


def audio_forward_inputs(requests: Sequence[Request], starts: Sequence[int], lengths: Sequence[int],
                         num_codebooks: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The model's `audio_mask` (tokens,) and `audio_codes` (audio positions, num_codebooks) for the
    positions [start, start + length) of each request, in the step's flat order. The modality comes
    from the request's frames, not from the token ids (a chunk may start or end inside an audio span)."""
    mask: list[bool] = []
    codes: list[tuple[int, ...]] = []
    for req, start, n in zip(requests, starts, lengths):
        if not req.has_audio:
            mask.extend([False] * n)
            continue
        for frame in req.frames(start, start + n):
            mask.append(frame is not None)
            if frame is not None:
                codes.append(frame)
    return {
        "audio_mask": torch.tensor(mask, dtype=torch.bool, device=device),
        "audio_codes": torch.tensor(codes, dtype=torch.long, device=device).view(len(codes), num_codebooks),
    }


def decode_frames(requests: Sequence[Request], starts: Sequence[int]) -> list[tuple[int, ...]] | None:
    """The frame at position starts[i] of each request, for a decode step (one token each); None when
    some position is text (the step then runs eagerly: a graphed decode routes every row to audio)."""
    frames = []
    for req, start in zip(requests, starts):
        frame = req.frames(start, start + 1)[0] if req.has_audio else None
        if frame is None:
            return None
        frames.append(frame)
    return frames


def sample_audio(logits: torch.Tensor, requests: Sequence[Request], generator: torch.Generator) -> list[SampledRow]:
    """One frame per request from (rows, num_codebooks, codebook_size) logits. Each request's audio
    state keeps the frame, and the row reports it; the row's token is the placeholder to feed it back
    with (or the final eos)."""
    steps = sample_audio_steps([r.audio_state for r in requests], logits, [r.sampling_params for r in requests],
                               generator)
    return [SampledRow(step.token_id, frame=list(step.codes), audio_finished=step.finished) for step in steps]


def profile_audio_inputs(num_tokens: int, spec: DelayPatternSpec, device: torch.device) -> dict[str, torch.Tensor]:
    """Profile-run inputs: every other position audio, so both paths of each layer and the split
    between them are in the measured peak."""
    mask = torch.arange(num_tokens, device=device) % 2 == 1
    codes = torch.randint(0, spec.codebook_size, (int(mask.sum()), spec.num_codebooks), device=device)
    return {"audio_mask": mask, "audio_codes": codes}


def profile_audio_sampling(logits: torch.Tensor, spec: DelayPatternSpec, generator: torch.Generator) -> None:
    """Sample a frame for every row (top-p, the costliest path), on throwaway states."""
    rows = logits.shape[0]
    states = [AudioGenerationState.from_prompt(spec, [spec.audio_bos_token_id]) for _ in range(rows)]
    sample_audio_steps(states, logits, [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=1)] * rows, generator)
