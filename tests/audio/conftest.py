"""Tiny audio checkpoints shared by the audio unit tests (built once per session, ~2 s)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.audio_helpers import make_tiny_audio_tokenizer


@pytest.fixture(scope="session")
def tiny_codec_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_audio_tokenizer(tmp_path_factory.mktemp("codec") / "tiny")


@pytest.fixture(scope="session")
def tiny_codec(tiny_codec_dir):
    from pagedllm.audio.tokenizer import AudioTokenizer, resolve_audio_tokenizer

    return AudioTokenizer.load(resolve_audio_tokenizer(str(tiny_codec_dir)), "cpu")


@pytest.fixture(scope="session")
def hf_codec(tiny_codec_dir):
    """transformers' own model on the same folder: the reference."""
    from pagedllm.audio.tokenizer import audio_tokenizer_class

    return audio_tokenizer_class().from_pretrained(str(tiny_codec_dir)).eval()
