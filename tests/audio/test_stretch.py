"""`speed` as WSOLA time-stretching: the length divided by the speed, the pitch kept (a resampling would move it),
the level kept; the range OpenAI's API allows."""
from __future__ import annotations

import numpy as np
import pytest

from pagedllm.audio.stretch import time_stretch

RATE = 24000


def _peak_hz(samples: np.ndarray) -> float:
    body = samples[1000:-1000] * np.hanning(len(samples) - 2000)
    return float(np.argmax(np.abs(np.fft.rfft(body)))) * RATE / len(body)


@pytest.mark.parametrize("speed", [0.25, 0.5, 1.5, 2.0, 4.0])
def test_the_length_changes_and_the_pitch_does_not(speed):
    tone = (0.5 * np.sin(2 * np.pi * 440.0 * np.arange(2 * RATE) / RATE)).astype(np.float32)
    out = time_stretch(tone, RATE, speed)
    assert len(out) == round(len(tone) / speed)
    assert abs(_peak_hz(out) - 440.0) < 3.0  # (resampled, the peak would be at 440 * speed)
    assert abs(np.abs(out[2000:-2000]).max() - 0.5) < 0.05


def test_speed_one_is_the_input_and_the_range_is_openais():
    tone = np.ones(100, np.float32)
    assert time_stretch(tone, RATE, 1.0) is tone
    for bad in (0.2, 4.5):
        with pytest.raises(ValueError, match=r"speed must be in \[0.25, 4.0\]"):
            time_stretch(tone, RATE, bad)
