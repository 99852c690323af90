"""The server's audio flags: vLLM's syntax, and flags that need the codec."""
from __future__ import annotations

import argparse

import pytest

from pagedllm.entrypoints.openai.api_server import UNIMPLEMENTED_FLAGS, build_parser
from pagedllm.entrypoints.openai.audio_args import (
    audio_server_config,
    parse_limit_mm_per_prompt,
)
from pagedllm.utils import gib_to_bytes

SEED_FLAGS = ["--model", "m", "--served-model-name", "higgs-audio-base-test", "--audio-tokenizer-type", "tok",
              "--limit-mm-per-prompt", "audio=50", "--max-model-len", "2048", "--port", "8300",
              "--gpu-memory-utilization", "0.8", "--swap-space", "4", "--disable-mm-preprocessor-cache",
              "--enforce-eager"]


@pytest.mark.parametrize(("value", "want"), [("audio=50", {"audio": 50}), ('{"audio": 2}', {"audio": 2}),
                                             ("audio=0", {"audio": 0}), (" audio = 3 ", {"audio": 3})])
def test_limit_mm_per_prompt_syntaxes(value, want):
    assert parse_limit_mm_per_prompt(value) == want


@pytest.mark.parametrize(("value", "why"), [("image=2", "unknown modality image"), ("audio", "expected audio=N"),
                                            ("audio=-1", ">= 0"), ("[1]", "expected"), ("audio=x", "expected")])
def test_bad_limits_are_refused(value, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        parse_limit_mm_per_prompt(value)


def test_the_seed_command_parses_into_an_audio_config():
    ns = build_parser().parse_args(SEED_FLAGS)
    config = audio_server_config(ns)
    assert config.enabled and config.tokenizer == "tok" and config.limit_audio_per_prompt == 50
    assert config.mm_cache_bytes == 0  # --disable-mm-preprocessor-cache
    assert not {f for f in UNIMPLEMENTED_FLAGS if "audio" in f or "mm" in f or "voice" in f}


def test_cache_size_and_flags_that_need_a_codec():
    parser = build_parser()
    config = audio_server_config(parser.parse_args(["--audio-tokenizer-path", "p", "--mm-processor-cache-gb", "0.5"]))
    assert config.mm_cache_bytes == gib_to_bytes(0.5) and config.enabled
    with pytest.raises(ValueError, match="--limit-mm-per-prompt, --voice-presets-dir need an audio model's codec"):
        audio_server_config(parser.parse_args(["--limit-mm-per-prompt", "audio=1", "--voice-presets-dir", "v"]))


def test_the_silence_stop_flag():
    parser = build_parser()
    assert audio_server_config(parser.parse_args(["--audio-tokenizer-path", "p"])).stop_after_silence_frames is None
    config = audio_server_config(parser.parse_args(["--audio-tokenizer-path", "p", "--stop-after-silence-frames", "50"]))
    assert config.stop_after_silence_frames == 50
    with pytest.raises(ValueError, match="--stop-after-silence-frames must be >= 1, got 0"):
        audio_server_config(parser.parse_args(["--audio-tokenizer-path", "p", "--stop-after-silence-frames", "0"]))
    with pytest.raises(ValueError, match="--stop-after-silence-frames need an audio model's codec"):
        audio_server_config(parser.parse_args(["--stop-after-silence-frames", "5"]))
