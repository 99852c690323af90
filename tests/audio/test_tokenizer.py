"""The audio tokenizer is transformers' HiggsAudioV2TokenizerModel: same codes, same waveforms."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedllm.audio.io import resample
from pagedllm.audio.tokenizer import (
    AUDIO_TOKENIZER_DTYPE,
    AudioTokenizer,
    AudioTokenizerSource,
    load_audio_tokenizer_config,
    resolve_audio_tokenizer,
)
from tests.audio_helpers import sine_wave


def test_shape_of_the_tiny_codec(tiny_codec):
    assert (tiny_codec.num_codebooks, tiny_codec.codebook_size) == (4, 30)
    assert (tiny_codec.sampling_rate, tiny_codec.frame_rate, tiny_codec.hop_length) == (24000, 25, 960)
    assert next(tiny_codec.model.parameters()).dtype == AUDIO_TOKENIZER_DTYPE
    assert not tiny_codec.model.training


def test_encode_and_decode_are_transformers(tiny_codec, hf_codec):
    wave = sine_wave(1.2) + 0.05 * np.random.default_rng(0).normal(size=28800).astype(np.float32)
    codes = tiny_codec.encode(wave, 24000)
    with torch.no_grad():
        ref = hf_codec.encode(torch.from_numpy(wave)[None, None], return_dict=False)[0].T
    assert codes.shape == (30, 4) and codes.dtype == torch.long
    assert torch.equal(codes, ref)
    assert len(set(codes.flatten().tolist())) > 4  # random codebooks: the codes vary
    samples = tiny_codec.decode(codes)
    with torch.no_grad():
        ref_audio = hf_codec.decode(ref.T[None], return_dict=False)[0, 0].numpy()
    assert samples.dtype == np.float32 and samples.shape == (30 * 960,)
    np.testing.assert_array_equal(samples, ref_audio)
    assert tiny_codec.decode(torch.empty((0, 4), dtype=torch.long)).shape == (0,)


def test_other_rates_are_resampled_to_the_codec_rate_first(tiny_codec, hf_codec):
    wave16k = sine_wave(0.8, rate=16000)
    codes = tiny_codec.encode(wave16k, 16000)
    with torch.no_grad():
        ref = hf_codec.encode(torch.from_numpy(resample(wave16k, 16000, 24000))[None, None], return_dict=False)
    assert torch.equal(codes, ref[0].T)


def test_decode_checks_the_codes_shape(tiny_codec):
    with pytest.raises(ValueError, match=r"shape \(frames, 4\)"):
        tiny_codec.decode(torch.zeros(5, 3, dtype=torch.long))


def test_resolution_order_and_errors(tmp_path, tiny_codec_dir):
    assert resolve_audio_tokenizer(str(tiny_codec_dir)).has_weights
    assert resolve_audio_tokenizer("ignored", path=str(tiny_codec_dir)).path == tiny_codec_dir
    preset = resolve_audio_tokenizer("bosonai/higgs-audio-v2-tokenizer")  # not cached here: the preset
    assert preset.path.name == "higgs-audio-v2-tokenizer.json" and not preset.has_weights
    config = load_audio_tokenizer_config(preset)
    assert (config.num_quantizers, config.frame_rate, config.codebook_size) == (8, 25, 1024)
    with pytest.raises(FileNotFoundError, match="neither a folder"):
        resolve_audio_tokenizer("nobody/no-such-codec")
    with pytest.raises(FileNotFoundError, match="has no weights.*--load-format dummy"):
        AudioTokenizer.load(preset, "cpu")
    other = tmp_path / "llama.json"
    other.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama'.*higgs_audio_v2_tokenizer"):
        load_audio_tokenizer_config(AudioTokenizerSource("llama", other))


def test_dummy_weights_from_a_bare_config(tmp_path, tiny_codec):
    config = tmp_path / "codec.json"
    config.write_text(json.dumps(tiny_codec.config.to_dict()))
    codec = AudioTokenizer.load(resolve_audio_tokenizer(str(config)), "cpu", dummy=True)
    codes = codec.encode(sine_wave(0.4), 24000)
    assert codes.shape == (10, 4) and len(set(codes.flatten().tolist())) > 1
