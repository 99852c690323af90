"""The silence stop: audio that runs on in near-silence ends after N silent frames, while streaming or not;
the engine's stream is closed (which aborts the request)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.audio.streaming import SILENCE_DBFS, SilenceStop, StreamingDecoder
from pagedllm.entrypoints.openai.serving_audio import _audio_chunks

HOP = 8
LOUD = 0.3  # far above -50 dBFS
QUIET = 10 ** (SILENCE_DBFS / 20) / 4  # below it


def frames_of(*levels: float) -> np.ndarray:
    return np.concatenate([np.full(HOP, v, dtype=np.float32) * np.sign(np.sin(np.arange(HOP) + 0.5))
                           for v in levels])


def test_the_stop_counts_silent_frames_in_a_row_and_keeps_up_to_the_last():
    stop = SilenceStop(frames=3, hop_length=HOP)
    assert stop.feed(frames_of(LOUD, QUIET, QUIET)) is None
    assert stop.feed(frames_of(LOUD, QUIET)) is None  # a loud frame starts the count again
    assert stop.feed(frames_of(QUIET, QUIET, LOUD, LOUD)) == 2 * HOP  # ends with the third silent frame


@dataclass
class _Sample:
    audio_codes: torch.Tensor
    done: bool = False

    def finished(self) -> bool:
        return self.done


@dataclass
class _Out:
    outputs: list


@dataclass
class _Codec:
    hop_length: int = HOP
    sampling_rate: int = 24000


@dataclass
class _Audio:
    """What _audio_chunks uses of AudioServing: the codec's hop and decode. Frame f's level is levels[f]."""

    levels: list[float]
    tokenizer: _Codec = field(default_factory=_Codec)

    async def decode(self, codes: torch.Tensor) -> np.ndarray:
        return frames_of(*[self.levels[int(f)] for f in codes[:, 0]])


def test_audio_that_runs_on_in_silence_ends_and_its_request_is_closed():
    levels = [LOUD] * 12 + [QUIET] * 100  # a model that runs on in silence after 12 frames
    closed = []

    async def engine():  # one more frame per step; never finishes by itself
        try:
            for n in range(1, len(levels) + 1):
                yield _Out([_Sample(torch.arange(n)[:, None].repeat(1, 2))])
        finally:
            closed.append(True)

    async def run():
        parts, stopped = [], False
        decoder = StreamingDecoder(HOP, chunk_frames=4, context_frames=2)
        async for _, samples, stopped in _audio_chunks(_Audio(levels), engine(), decoder, SilenceStop(5, HOP)):
            parts += samples
        return np.concatenate(parts), stopped

    samples, stopped = asyncio.run(run())
    assert stopped and closed == [True]
    assert len(samples) == (12 + 5) * HOP  # the loud frames, then the five silent ones
    np.testing.assert_array_equal(samples, frames_of(*levels[:17]))
