"""Decoding codes to audio while they are generated, in chunks of frames.

The codec's decoder is convolutional: sample t depends on a bounded neighbourhood of frames (its
receptive field, about +-11 frames for the real tokenizer's DAC decoder). Each chunk is decoded from
a window reaching CONTEXT_FRAMES past both of its ends, and frames are sent only once CONTEXT_FRAMES
more have arrived (or the audio has ended), so the streamed samples equal one decode of all the codes
(tests/audio/test_streaming.py checks it against transformers' decode).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

CONTEXT_FRAMES = 16  # frames of context each side: more than the decoder's receptive field
CHUNK_FRAMES = 10  # 0.4 s at 25 frames/s: how much audio one streamed chunk carries at least
SILENCE_DBFS = -50.0  # a frame whose RMS is below this (dB of full scale) is near-silence


@dataclass(frozen=True)
class DecodeWindow:
    """Decode frames [start, stop), keep samples [keep_from, keep_to) of the result."""

    start: int
    stop: int
    keep_from: int
    keep_to: int
    emits_to: int  # frames sent once this window is sent


@dataclass
class StreamingDecoder:
    """Which frames to decode next, given how many have arrived. Pure bookkeeping: the caller decodes."""

    hop_length: int
    chunk_frames: int = CHUNK_FRAMES
    context_frames: int = CONTEXT_FRAMES
    emitted: int = 0  # frames whose samples have been sent

    def next_window(self, available: int, final: bool) -> DecodeWindow | None:
        """The next chunk to decode with `available` frames known; None when it is too early.
        `final`: no more frames will come, so everything left is decoded."""
        end = available if final else available - self.context_frames
        if end - self.emitted < (1 if final else self.chunk_frames):
            return None
        start = max(0, self.emitted - self.context_frames)
        return DecodeWindow(start, available, (self.emitted - start) * self.hop_length,
                            (end - start) * self.hop_length, end)

    def commit(self, window: DecodeWindow) -> None:
        self.emitted = window.emits_to


@dataclass
class SilenceStop:
    """Ends audio that runs on in near-silence: once `frames` frames in a row have an RMS below SILENCE_DBFS,
    the audio ends with the last of them. Fed the decoded samples in order, whole frames of `hop_length`."""

    frames: int
    hop_length: int
    run: int = 0  # silent frames in a row at the end of what was fed

    def feed(self, samples: np.ndarray) -> int | None:
        """None: go on; else how many of these samples to keep (the audio ends there)."""
        threshold = 10 ** (SILENCE_DBFS / 20)
        for k in range(len(samples) // self.hop_length):
            frame = samples[k * self.hop_length:(k + 1) * self.hop_length].astype(np.float64)
            self.run = self.run + 1 if math.sqrt(float(np.mean(frame * frame))) < threshold else 0
            if self.run >= self.frames:
                return (k + 1) * self.hop_length
        return None
