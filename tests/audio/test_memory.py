"""The audio tokenizer in the memory plan: its own line, exact weights, a traced and a measured peak."""
from __future__ import annotations

import json

import pytest
import torch

from pagedllm.audio.memory import (
    measured_audio_tokenizer_memory,
    planned_audio_tokenizer_memory,
    traced_peak_bytes,
    with_planned_audio_tokenizer,
)
from pagedllm.audio.tokenizer import (
    AudioTokenizerSource,
    audio_tokenizer_class,
    resolve_audio_tokenizer,
)
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.plan import dry_run_plan
from pagedllm.memory.plan import fmt_bytes

# The seed's machine (a DGX Spark): 128 GB of unified memory, --gpu-memory-utilization 0.8, 2048 tokens.
SEED_MACHINE = ["--device", "cuda", "--device-memory", "128GiB", "--unified-memory", "--gpu-memory-utilization",
                "0.8", "--max-model-len", "2048"]


def real_tokenizer_bytes() -> int:
    """Parameters and buffers of the real tokenizer's shape (bosonai/higgs-audio-v2-tokenizer: transformers'
    config defaults with its 5 DAC strides and 4 bandwidths), built on the meta device, in float32."""
    from transformers.models.higgs_audio_v2_tokenizer import HiggsAudioV2TokenizerConfig

    config = HiggsAudioV2TokenizerConfig(
        target_bandwidths=[0.5, 1, 1.5, 2],
        acoustic_model_config={"downsampling_ratios": [8, 5, 4, 2, 3], "upsampling_ratios": [8, 5, 4, 2, 3]})
    with torch.device("meta"):
        model = audio_tokenizer_class()(config)
    assert sum(p.numel() for p in model.parameters()) == 200_343_777
    return sum(t.numel() * 4 for t in list(model.parameters()) + list(model.buffers()))


def test_planned_weights_are_the_loaded_weights(tiny_codec_dir, tiny_codec):
    planned = planned_audio_tokenizer_memory(AudioTokenizerSource("tiny", tiny_codec_dir), 256)
    assert planned.weight_bytes == tiny_codec.weight_bytes == sum(
        t.numel() * t.element_size() for t in list(tiny_codec.model.parameters()) + list(tiny_codec.model.buffers()))
    assert planned.activation_bytes > 0 and planned.source.startswith("config shapes")


def test_the_traced_peak_grows_with_the_frames_and_counts_convolution_buffers(tiny_codec_dir):
    source = AudioTokenizerSource("tiny", tiny_codec_dir)
    small, large = (planned_audio_tokenizer_memory(source, n).activation_bytes for n in (256, 1024))
    assert 3.0 < large / small < 5.0  # about linear: the decoder's activations scale with the length
    conv = torch.nn.Conv1d(8, 16, 5).to("meta")
    x = torch.zeros(1, 8, 1000, device="meta")
    with torch.no_grad():
        peak = traced_peak_bytes(lambda: conv(x))
    out_bytes, columns = 16 * 996 * 4, 8 * 5 * 996 * 4
    assert peak == out_bytes + columns  # the output, plus the unfolded input the kernel works on


def test_measured_on_the_device(tiny_codec):
    measured = measured_audio_tokenizer_memory(tiny_codec, 256)
    assert measured.weight_bytes == tiny_codec.weight_bytes
    assert measured.activation_bytes > 0 and measured.source.startswith("measured")


def test_plan_of_the_real_3b_shape_on_the_seeds_machine_has_the_tokenizer_line(capsys):
    code = main(["plan", "higgs-audio-v2-3b", *SEED_MACHINE, "--audio-tokenizer-type",
                 "bosonai/higgs-audio-v2-tokenizer"])
    out = capsys.readouterr().out
    assert code == 0, out
    line = next(row for row in out.splitlines() if row.strip().startswith("audio tokenizer"))
    assert "float32" in line and "weights 768.3 MiB" in line and "config shapes" in line
    code = main(["plan", "higgs-audio-v2-3b", *SEED_MACHINE, "--audio-tokenizer-type",
                 "bosonai/higgs-audio-v2-tokenizer", "--json"])
    data = json.loads(capsys.readouterr().out)
    (component,) = data["components"]
    assert component["name"] == "audio tokenizer"
    assert component["weight_bytes"] == real_tokenizer_bytes()
    assert component["activation_peak_bytes"] > 1 << 30  # 82 s of audio through HuBERT and the DAC encoder


def test_the_tokenizer_comes_out_of_the_kv_cache_budget():
    args = EngineArgs(model="higgs-audio-v2-3b", gpu_memory_utilization=0.8, max_model_len=2048)
    plan = dry_run_plan(args, device="cuda", device_memory="128GiB", unified=True)
    with_codec = with_planned_audio_tokenizer(plan, "higgs-audio-v2-tokenizer", None)
    (codec,) = with_codec.components
    assert with_codec.kv_budget_bytes == plan.kv_budget_bytes - codec.total_bytes
    assert with_codec.non_kv_bytes == plan.non_kv_bytes + codec.total_bytes
    tight = dry_run_plan(args, device="cuda", device_memory="15GiB", unified=True)
    tight = with_planned_audio_tokenizer(tight, "higgs-audio-v2-tokenizer", None)
    assert not tight.fits and f"the audio tokenizer ({fmt_bytes(codec.total_bytes)})" in tight.cause


def test_an_unknown_tokenizer_is_an_error_in_plan(capsys):
    assert main(["plan", "higgs-audio-v2-3b", *SEED_MACHINE, "--audio-tokenizer-type", "nobody/none"]) == 2
    assert "neither a folder" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["higgs-audio-v2-tokenizer", "bosonai/higgs-audio-v2-tokenizer"])
def test_the_preset_is_found_by_name(name):
    assert resolve_audio_tokenizer(name).path.name == "higgs-audio-v2-tokenizer.json"
