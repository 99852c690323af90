"""torchaudio for transformers' audio tokenizer, or a stand-in where it cannot be imported.

transformers' HiggsAudioV2TokenizerModel imports torchaudio for one call: resampling its input to the
semantic model's rate with `torchaudio.functional.resample` (windowed sinc, Hann window, defaults).
PyPI's torchaudio wheels for x86_64 are CUDA builds: beside a CPU build of torch they fail to import
(libc10_cuda.so is missing). Where the real package does not import, `ensure_torchaudio` registers
a stand-in module offering exactly that function, computed as torchaudio computes it (same kernel,
same padding and length), so codes do not depend on which one ran; tests/audio/test_torchaudio_compat.py
holds values from torchaudio 2.11.1 to check it. Only the codec's own call goes through it: pagedllm
resamples user audio with soxr (pagedllm/audio/io.py).
"""
from __future__ import annotations

import importlib.machinery
import logging
import math
import sys
import types

import torch

logger = logging.getLogger(__name__)

STAND_IN_VERSION = "pagedllm-stand-in"


def ensure_torchaudio() -> str:
    """Make `import torchaudio` work: "real" when the package imports, else "stand-in"."""
    mod = sys.modules.get("torchaudio")
    if mod is not None:
        return "stand-in" if getattr(mod, "__version__", "") == STAND_IN_VERSION else "real"
    try:
        import torchaudio  # noqa: F401
        return "real"
    except (ImportError, OSError) as e:
        for name in [n for n in sys.modules if n == "torchaudio" or n.startswith("torchaudio.")]:
            del sys.modules[name]  # half-imported parts of a package that failed to load
        logger.info("torchaudio does not import here (%s); the audio tokenizer resamples with pagedllm's "
                    "stand-in for torchaudio.functional.resample", str(e).splitlines()[0][:120])
    package = types.ModuleType("torchaudio", "pagedllm's stand-in: torchaudio.functional.resample only")
    package.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)  # find_spec() sees a package
    package.__version__ = STAND_IN_VERSION
    functional = types.ModuleType("torchaudio.functional")
    functional.__spec__ = importlib.machinery.ModuleSpec("torchaudio.functional", None)
    functional.resample = resample
    package.functional = functional
    sys.modules["torchaudio"] = package
    sys.modules["torchaudio.functional"] = functional
    # transformers caches whether torchaudio is there: an answer given before the stand-in existed would
    # still refuse the codec's import.
    checked = getattr(sys.modules.get("transformers.utils.import_utils"), "is_torchaudio_available", None)
    if hasattr(checked, "cache_clear"):
        checked.cache_clear()
    return "stand-in"


def resample(waveform: torch.Tensor, orig_freq: int, new_freq: int, lowpass_filter_width: int = 6,
             rolloff: float = 0.99, resampling_method: str = "sinc_interp_hann", beta: float | None = None
             ) -> torch.Tensor:
    """torchaudio.functional.resample's windowed-sinc interpolation (Hann window only). (..., time)."""
    if resampling_method != "sinc_interp_hann" or beta is not None:
        raise NotImplementedError("the torchaudio stand-in implements the sinc_interp_hann method only")
    if orig_freq <= 0 or new_freq <= 0:
        raise ValueError("Original frequency and desired frequency should be positive")
    if orig_freq == new_freq:
        return waveform
    gcd = math.gcd(int(orig_freq), int(new_freq))
    orig, new = int(orig_freq) // gcd, int(new_freq) // gcd
    kernel, width = _sinc_kernel(orig, new, lowpass_filter_width, rolloff, waveform.device, waveform.dtype)
    shape = waveform.shape
    flat = waveform.reshape(-1, shape[-1])
    length = flat.shape[-1]
    padded = torch.nn.functional.pad(flat, (width, width + orig))
    out = torch.nn.functional.conv1d(padded[:, None], kernel, stride=orig)  # (batch, new, steps)
    out = out.transpose(1, 2).reshape(flat.shape[0], -1)
    target = math.ceil(new * length / orig)
    return out[..., :target].reshape(shape[:-1] + (min(target, out.shape[-1]),))


def _sinc_kernel(orig: int, new: int, zeros: int, rolloff: float, device: torch.device, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, int]:
    """(new, 1, taps) filters, one per output phase, and the left padding `width` (input samples)."""
    base = min(orig, new) * rolloff  # the low-pass cut-off, below both Nyquist rates
    width = math.ceil(zeros * orig / base)
    idx = torch.arange(-width, width + orig, dtype=dtype, device=device)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=dtype, device=device)[:, None, None] / new + idx
    t = (t * base).clamp_(-zeros, zeros)
    window = torch.cos(t * math.pi / zeros / 2) ** 2
    t = t * math.pi
    kernels = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t)
    return kernels * (window * (base / orig)), width
