"""Streamed decoding equals one decode of all the codes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.audio.streaming import StreamingDecoder


def stream(codec, codes: torch.Tensor, decoder: StreamingDecoder, arrivals: list[int]) -> list[np.ndarray]:
    parts = []
    for available in arrivals:
        final = available == len(codes)
        while (w := decoder.next_window(available, final)) is not None:
            parts.append(codec.decode(codes[w.start:w.stop])[w.keep_from:w.keep_to])
            decoder.commit(w)
    return parts


@pytest.mark.parametrize(("frames", "chunk", "step"), [(93, 10, 1), (40, 4, 3), (7, 10, 1), (1, 10, 1)])
def test_streamed_samples_equal_a_whole_decode(tiny_codec, hf_codec, frames, chunk, step):
    codes = torch.randint(0, 30, (frames, 4), generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        whole = hf_codec.decode(codes.T[None], return_dict=False)[0, 0].numpy()
    arrivals = list(range(step, frames, step)) + [frames]
    parts = stream(tiny_codec, codes, StreamingDecoder(tiny_codec.hop_length, chunk_frames=chunk), arrivals)
    got = np.concatenate(parts)
    assert got.shape == whole.shape
    # Float rounding of convolutions over different lengths only: under one 16-bit PCM step (3e-5).
    np.testing.assert_allclose(got, whole, atol=1e-5, rtol=0)
    if frames > 40:
        assert len(parts) > 2  # audio left before the end


def test_nothing_is_sent_before_the_context_is_known():
    d = StreamingDecoder(hop_length=960, chunk_frames=10, context_frames=16)
    assert d.next_window(25, final=False) is None  # 9 frames ready: fewer than a chunk
    w = d.next_window(26, final=False)
    assert (w.start, w.stop, w.keep_from, w.keep_to, w.emits_to) == (0, 26, 0, 10 * 960, 10)
    d.commit(w)
    w = d.next_window(40, final=True)
    assert (w.start, w.stop, w.keep_from, w.keep_to) == (0, 40, 10 * 960, 40 * 960)
