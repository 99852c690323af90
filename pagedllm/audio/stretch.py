"""`speed` of OpenAI's speech API: the waveform played faster or slower at the same pitch, by WSOLA (waveform-
similarity overlap-add): 30 ms windows overlap-added at a fixed output hop, each taken from the input at `speed`
times the output's pace, shifted (by up to a quarter window) to where it best continues the last one, so the
pitch periods line up and no phase jumps are heard. Not a resampling (that would change the pitch)."""
from __future__ import annotations

import numpy as np

MIN_SPEED, MAX_SPEED = 0.25, 4.0  # OpenAI's range
WINDOW_S = 0.03


def time_stretch(samples: np.ndarray, rate: int, speed: float) -> np.ndarray:
    """Mono float32 samples lasting len / speed, pitch unchanged."""
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise ValueError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}], got {speed}")
    if speed == 1.0 or len(samples) == 0:
        return samples
    win = max(16, int(WINDOW_S * rate)) // 2 * 2
    hop, tol = win // 2, win // 4
    n_out = int(round(len(samples) / speed))
    x = np.concatenate([np.zeros(tol, np.float32), samples.astype(np.float32), np.zeros(win + 2 * tol, np.float32)])
    window = np.hanning(win).astype(np.float32)
    out = np.zeros(n_out + win, np.float32)
    norm = np.zeros(n_out + win, np.float32)
    natural = None  # what would follow the last window in the input: the next one should resemble it
    for out_pos in range(0, n_out, hop):
        center = tol + min(int(out_pos * speed), len(samples))
        start = center
        if natural is not None:
            region = x[center - tol:center + tol + win]
            start = center - tol + int(np.argmax(np.correlate(region, natural, mode="valid")))
        out[out_pos:out_pos + win] += x[start:start + win] * window
        norm[out_pos:out_pos + win] += window
        natural = x[start + hop:start + hop + win]
    return (out[:n_out] / np.maximum(norm[:n_out], 1e-3)).astype(np.float32)
