"""The torchaudio stand-in: torchaudio 2.11.1's resample, where the real package cannot load."""
from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from pagedllm.audio.torchaudio_compat import ensure_torchaudio, resample

# torchaudio 2.11.1: torchaudio.functional.resample(torch.sin(0.3 * n)[None] for n < 48, 24000, 16000).
TORCHAUDIO_24K_TO_16K = [
    0.02921564131975174, 0.4291294813156128, 0.7858297228813171, 0.974025547504425, 0.9743485450744629,
    0.7775439620018005, 0.4271818697452545, -0.008402780629694462, -0.4423156678676605, -0.7880988121032715,
    -0.9770774245262146, -0.9713773727416992, -0.7724065184593201, -0.419536828994751, 0.016806313768029213,
    0.44980084896087646, 0.7933003902435303, 0.9787381291389465, 0.9694405794143677, 0.7669855952262878,
    0.4119275212287903, -0.02520591765642166, -0.4573245644569397, -0.7983224391937256, -0.9804818630218506,
    -0.9672844409942627, -0.7616287469863892, -0.40438780188560486, 0.03150453045964241, 0.4717956483364105,
    0.78614741563797, 1.0239654779434204,
]


def test_resample_matches_torchaudio():
    x = torch.sin(torch.arange(48, dtype=torch.float32) * 0.3)[None]
    got = resample(x, 24000, 16000)
    assert got.shape == (1, 32)
    torch.testing.assert_close(got[0], torch.tensor(TORCHAUDIO_24K_TO_16K), atol=1e-6, rtol=0)


@pytest.mark.parametrize(("rate", "target", "n"), [(24000, 16000, 4801), (16000, 24000, 999), (44100, 24000, 3000)])
def test_resample_keeps_a_band_limited_tone_and_torchaudio_lengths(rate, target, n):
    t = torch.arange(n, dtype=torch.float64)
    x = torch.sin(2 * math.pi * 440 * t / rate)[None, None]
    y = resample(x, rate, target)
    assert y.shape[-1] == math.ceil(n * target / rate)  # torchaudio's output length
    ref = torch.sin(2 * math.pi * 440 * torch.arange(y.shape[-1], dtype=torch.float64) / target)
    inner = slice(50, -50)  # away from the zero-padded edges
    assert float((y[0, 0, inner] - ref[inner]).abs().max()) < 1e-2


def test_ensure_torchaudio_lets_transformers_import_the_codec():
    """Also when transformers was asked about torchaudio first (and cached its answer)."""
    from transformers.utils.import_utils import is_torchaudio_available

    if "torchaudio" not in sys.modules and importlib.util.find_spec("torchaudio") is None:
        assert not is_torchaudio_available()  # no real torchaudio here, no stand-in yet: cached as missing
    kind = ensure_torchaudio()
    assert kind in ("real", "stand-in")
    assert ensure_torchaudio() == kind  # idempotent
    import torchaudio

    if kind == "stand-in":
        assert torchaudio.functional.resample is resample
    from transformers.models.higgs_audio_v2_tokenizer import (
        modeling_higgs_audio_v2_tokenizer,
    )

    assert "torchaudio" in sys.modules and modeling_higgs_audio_v2_tokenizer.HiggsAudioV2TokenizerModel
