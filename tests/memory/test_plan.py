"""The memory plan's arithmetic, diagnosis and fixes: no model loaded, no device needed.

Plans are built directly (MemoryPlan over hand-picked ModelFacts) or with `dry_run_plan` on the
shipped presets with a given device size, so every number here can be computed by hand.
"""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from pagedllm import KVCacheMemoryError
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.utils import parse_size
from pagedllm.entrypoints.plan import dry_run_plan
from pagedllm.memory.model_size import (
    kv_bytes_per_token,
    num_params_from_config,
    safetensors_header,
    weight_bytes_from_headers,
)
from pagedllm.memory.plan import GiB, KiB, MiB, DeviceFacts, MemoryPlan, ModelFacts, PlanSettings
from pagedllm.model_executor.model_files import load_hf_config, preset_config, weight_files

ALLOWED_FLAGS = {"--max-model-len", "--gpu-memory-utilization", "--dtype", "--max-num-batched-tokens",
                 "--kv-cache-memory", "--num-gpu-blocks-override", "--kv-cache-dtype",
                 "--quantization", "--cpu-offload-gb", "--enforce-eager"}
# How a fix's flag maps onto EngineArgs (what the CLI would parse it to).
FLAG_FIELDS = {"--max-model-len": ("max_model_len", int),
               "--gpu-memory-utilization": ("gpu_memory_utilization", float),
               "--dtype": ("dtype", str),
               "--max-num-batched-tokens": ("max_num_batched_tokens", int),
               "--kv-cache-memory": ("kv_cache_memory", str),
               "--num-gpu-blocks-override": ("num_gpu_blocks_override", int),
               "--kv-cache-dtype": ("kv_cache_dtype", str),
               "--quantization": ("quantization", str),
               "--cpu-offload-gb": ("cpu_offload_gb", float),
               "--enforce-eager": ("enforce_eager", lambda value: True)}  # a switch: no value

LLAMA_3B_PARAMS = 3_212_749_824  # 128256*3072 + 28 * 100_669_440 + 3072 (tied lm_head)
LLAMA_3B_KV_BF16 = 2 * 28 * 8 * 128 * 2  # 114688 B/token


# -- helpers ------------------------------------------------------------------------------------
def seed_kwargs(**changes) -> dict:
    """The seed's scenario: Llama-3.2-3B, bf16, 119.7 GiB unified memory, 90 GiB used by others."""
    engine = {"model": "llama-3.2-3b", "gpu_memory_utilization": 0.8, "max_model_len": 2048, **changes}
    return dict(args=EngineArgs(**engine), device="cuda", device_memory="119.7GiB", device_memory_used="90GiB",
                unified=True)


def plan_seed(**changes) -> MemoryPlan:
    kw = seed_kwargs(**changes)
    return dry_run_plan(kw.pop("args"), **kw)


def preset_plan(model: str, device_memory: str = "80GiB", tp: int = 1, **engine) -> MemoryPlan:
    return dry_run_plan(EngineArgs(model=model, **engine), device="cuda", device_memory=device_memory,
                        tensor_parallel_size=tp)


def replan_with_fix(make_args, fix) -> MemoryPlan:
    """Re-run a dry-run plan with the fix's flag applied (alone) to the original arguments."""
    field, conv = FLAG_FIELDS[fix.flag]
    return make_args(**{field: conv(fix.value)})


def direct_plan(total=16 * GiB, used=1 * GiB, util=0.5, weights_bf16=2 * GiB, act_per_token=64 * KiB,
                overhead=512 * MiB, kv_bf16=LLAMA_3B_KV_BF16, model_max_len=131072, unified=False,
                **settings) -> MemoryPlan:
    """A plan over hand-picked numbers: weights and KV scale with the dtype, activations with the tokens/step."""
    model = ModelFacts(
        model_max_len=model_max_len,
        weight_bytes=lambda s: weights_bf16 * s.dtype.itemsize // 2,
        activation_bytes=lambda s: act_per_token * s.max_num_batched_tokens,
        overhead_bytes=lambda s: overhead,
        kv_bytes_per_token=lambda s: kv_bf16 * s.dtype.itemsize // 2,
    )
    s = {"dtype": torch.bfloat16, "max_model_len": 2048, "gpu_memory_utilization": util, **settings}
    return MemoryPlan(PlanSettings(**s), DeviceFacts("cuda", total, used, unified, source="given"), model)


# -- the seed's scenario ------------------------------------------------------------------------
def test_seed_scenario_fails_because_of_memory_used_by_others():
    plan = plan_seed()
    assert plan.settings.dtype == torch.bfloat16  # the preset's torch_dtype, on cuda
    assert plan.device.unified and plan.device.source == "given"
    assert plan.device.total_bytes == int(119.7 * GiB) and plan.device.used_by_others_bytes == 90 * GiB
    assert plan.budget_bytes == int(int(119.7 * GiB) * 0.8)
    assert plan.weight_bytes == LLAMA_3B_PARAMS * 2 and plan.model.weights_source == "config shapes"
    assert plan.kv_bytes_per_token == LLAMA_3B_KV_BF16 == 112 * KiB
    assert plan.seq_bytes == 224 * MiB
    assert plan.graph_pool_bytes > 0  # decode CUDA graphs (the seed's vLLM captured them too)
    assert plan.kv_budget_bytes == (plan.budget_bytes - 90 * GiB - plan.weight_bytes - plan.activation_bytes
                                    - plan.overhead_bytes - plan.graph_pool_bytes - plan.bitmask_bytes) < 0
    assert not plan.fits and plan.num_blocks == 0 and plan.kv_cache_bytes == 0
    cause = plan.cause
    assert "other processes" in cause and "90.00 GiB" in cause and "119.70 GiB unified memory" in cause
    assert plan.to_json()["cause"] == cause and plan.to_json()["fits"] is False
    with pytest.raises(KVCacheMemoryError, match="^No available memory for the cache blocks"):
        plan.check()


def test_seed_scenario_every_fix_alone_fits():
    plan = plan_seed()
    fixes = plan.fixes()
    assert fixes, plan.table()
    assert {f.flag for f in fixes} <= ALLOWED_FLAGS
    assert "--gpu-memory-utilization" in {f.flag for f in fixes}
    for fix in fixes:
        fixed = replan_with_fix(plan_seed, fix)
        assert fixed.fits, (fix, fixed.table())
        assert fixed.cause is None and fixed.fixes() == []
        assert fix.effect.startswith(fixed.effect())  # the listed effect is what the re-plan gives
        if fix.flag == "--gpu-memory-utilization":
            # the smallest utilization (to 0.01) that fits: one step lower does not
            lower = round(float(fix.value) - 0.01, 2)
            assert not plan_seed(gpu_memory_utilization=lower).fits


# -- KV bytes per token and parameter counts ----------------------------------------------------
@pytest.mark.parametrize("model, tp, dtype, expected", [
    ("llama-3.2-3b", 1, "bfloat16", 2 * 28 * 8 * 128 * 2),   # GQA: 114688
    ("llama-3.2-3b", 1, "float32", 2 * 28 * 8 * 128 * 4),    # float32 doubles it
    ("llama-3.2-3b", 2, "bfloat16", 2 * 28 * 4 * 128 * 2),   # TP=2: 4 kv heads per rank
    ("qwen2.5-0.5b", 1, "bfloat16", 12288),                  # 24 layers, 2 kv heads, head_dim 64 (896/14)
    ("qwen2.5-0.5b", 2, "bfloat16", 6144),                   # 1 kv head per rank
    ("qwen3-0.6b", 1, "bfloat16", 114688),                   # head_dim 128 explicit (not 1024/16 = 64)
    ("llama-3.1-8b", 1, "bfloat16", 2 * 32 * 8 * 128 * 2),
    ("mistral-7b-v0.3", 1, "bfloat16", 2 * 32 * 8 * 128 * 2),
])
def test_kv_bytes_per_token_of_presets(model, tp, dtype, expected):
    plan = preset_plan(model, tp=tp, dtype=dtype, max_model_len=2048)
    assert plan.kv_bytes_per_token == expected
    assert plan.seq_bytes == 2048 * expected  # 2048 is a whole number of blocks
    assert plan.to_json()["kv_bytes_per_token"] == expected
    assert plan.to_json()["tensor_parallel_size"] == tp


def test_kv_bytes_per_token_mqa_config_file(tmp_path):
    cfg = json.loads(preset_config("llama-3.2-3b").read_text())
    cfg.update(num_key_value_heads=1, num_hidden_layers=16)
    path = tmp_path / "mqa.json"
    path.write_text(json.dumps(cfg))
    one = dry_run_plan(EngineArgs(model=str(path), max_model_len=2048), device="cuda", device_memory="80GiB")
    two = dry_run_plan(EngineArgs(model=str(path), max_model_len=2048), device="cuda", device_memory="80GiB",
                       tensor_parallel_size=2)
    assert one.kv_bytes_per_token == 2 * 16 * 1 * 128 * 2 == 8192
    assert two.kv_bytes_per_token == 8192  # one kv head cannot be split: each rank keeps a replica


def _cfg(kv_heads, **extra):
    return dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=kv_heads, hidden_size=512, **extra)


@pytest.mark.parametrize("cfg, tp, itemsize, expected", [
    (_cfg(8), 1, 2, 2 * 4 * 8 * 64 * 2),                        # MHA: head_dim = 512 / 8
    (_cfg(None), 1, 2, 2 * 4 * 8 * 64 * 2),                     # no num_key_value_heads: MHA
    (_cfg(1), 1, 4, 2 * 4 * 1 * 64 * 4),                        # MQA, float32
    (_cfg(1), 2, 4, 2 * 4 * 1 * 64 * 4),                        # MQA, TP=2: the one head is replicated
    (_cfg(2, head_dim=96), 2, 2, 2 * 4 * 1 * 96 * 2),           # explicit head_dim, TP=2
    (_cfg(8, head_dim=None), 4, 2, 2 * 4 * 2 * 64 * 2),         # head_dim null falls back; TP=4
])
def test_kv_bytes_per_token_by_hand(cfg, tp, itemsize, expected):
    dtype = {2: torch.bfloat16, 4: torch.float32}[itemsize]
    assert kv_bytes_per_token(SimpleNamespace(**cfg), dtype, tp) == expected


def test_num_params_from_config_of_presets():
    llama = num_params_from_config(load_hf_config(preset_config("llama-3.2-3b")))
    assert llama == LLAMA_3B_PARAMS and math.isclose(llama, 3.21e9, rel_tol=2e-3)
    # The published counts of these models.
    assert num_params_from_config(load_hf_config(preset_config("qwen2.5-0.5b"))) == 494_032_768
    assert num_params_from_config(load_hf_config(preset_config("qwen3-0.6b"))) == 596_049_920


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_num_params_of_tiny_models_match_safetensors_and_transformers(tiny_models, arch):
    from tests.helpers import load_hf_model

    path = tiny_models[arch]
    cfg = load_hf_config(path)
    tied = bool(cfg.tie_word_embeddings)
    assert tied == (arch == "qwen2")
    files = weight_files(path)
    numel = sum(math.prod(info["shape"]) for f in files for name, info in safetensors_header(f).items()
                if not (tied and name == "lm_head.weight"))
    hf_count = sum(p.numel() for p in load_hf_model(path).parameters())  # tied weights listed once
    assert num_params_from_config(cfg) == numel == hf_count
    assert weight_bytes_from_headers(files, torch.float32, tied) == 4 * numel
    assert weight_bytes_from_headers(files, torch.bfloat16, tied) == 2 * numel


def test_weight_bytes_from_headers_skips_tied_lm_head_and_rotary_buffers(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(10, 4, dtype=torch.bfloat16),
               "lm_head.weight": torch.zeros(10, 4, dtype=torch.bfloat16),
               "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(2),
               "model.norm.weight": torch.zeros(4, dtype=torch.float16)}, str(tmp_path / "a.safetensors"))
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 4),
               "step": torch.zeros(5, dtype=torch.int64)}, str(tmp_path / "b.safetensors"))
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    # Floating tensors take the engine dtype; integer ones keep theirs (8 bytes x 5).
    assert weight_bytes_from_headers(files, torch.float32, tied=False) == (40 + 40 + 4 + 12) * 4 + 40
    assert weight_bytes_from_headers(files, torch.float32, tied=True) == (40 + 4 + 12) * 4 + 40
    assert weight_bytes_from_headers(files, torch.bfloat16, tied=True) == (40 + 4 + 12) * 2 + 40


# -- the blocks arithmetic, by hand ----------------------------------------------------------------
def test_num_blocks_when_the_budget_decides():
    plan = direct_plan()
    budget = int(16 * GiB * 0.5)
    left = budget - 1 * GiB - 2 * GiB - 64 * KiB * 2048 - 512 * MiB
    assert plan.budget_bytes == budget and plan.kv_budget_bytes == left == 4480 * MiB
    assert plan.block_bytes == 16 * LLAMA_3B_KV_BF16
    assert plan.num_blocks == left // (16 * LLAMA_3B_KV_BF16) == 2560  # below 256 * 128 useful blocks
    assert plan.kv_cache_bytes == 2560 * 16 * LLAMA_3B_KV_BF16
    assert plan.max_tokens_in_cache == 40960 and plan.max_concurrency == 20.0
    assert plan.max_model_len_fit == 40960 and plan.fits and plan.cause is None and plan.fixes() == []


def test_num_blocks_capped_at_max_num_seqs_sequences():
    plan = direct_plan(max_num_seqs=4)
    assert plan.blocks_that_fit == 2560
    assert plan.num_blocks == plan.max_useful_blocks == 4 * 2048 // 16 == 512
    assert plan.max_concurrency == 4.0
    assert "capped at max_num_seqs x max_model_len" in plan.table()
    # A max_model_len that is not a multiple of the block size rounds up to whole blocks.
    odd = direct_plan(max_num_seqs=3, max_model_len=100)
    assert odd.num_blocks == 3 * 7 and odd.seq_bytes == 7 * odd.block_bytes


def test_explicit_kv_cache_memory_and_block_override():
    plan = direct_plan(kv_cache_memory_bytes=100 * MiB + 5, max_model_len=512)
    assert plan.kv_budget_bytes == 100 * MiB + 5
    assert plan.num_blocks == (100 * MiB + 5) // plan.block_bytes == 57
    assert plan.fits and plan.max_tokens_in_cache == 912
    over = direct_plan(num_gpu_blocks_override=200)
    assert over.num_blocks == 200 and over.fits


def test_float32_doubles_weights_and_kv():
    bf16, f32 = direct_plan(), direct_plan(dtype=torch.float32)
    assert f32.weight_bytes == 2 * bf16.weight_bytes and f32.kv_bytes_per_token == 2 * bf16.kv_bytes_per_token


# -- failures, causes and fixes -----------------------------------------------------------------------
def test_plan_failing_on_activations_suggests_the_largest_max_num_batched_tokens():
    # Size the device so that exactly 2000 tokens/step of activations fit next to one 2048 sequence.
    probe = preset_plan("llama-3.2-3b", max_model_len=2048, max_num_batched_tokens=2000)
    total = probe.weight_bytes + probe.overhead_bytes + probe.activation_bytes + probe.seq_bytes + probe.graph_pool_bytes
    total += probe.bitmask_bytes

    def make(**changes):
        engine = {"model": "llama-3.2-3b", "max_model_len": 2048, "gpu_memory_utilization": 1.0, **changes}
        return dry_run_plan(EngineArgs(**engine), device="cuda", device_memory=str(total))

    plan = make()
    assert plan.settings.max_num_batched_tokens == 2048 and not plan.fits
    assert plan.kv_budget_bytes >= 0  # weights and overhead fit: the activation peak is what overflows
    assert make(max_num_batched_tokens=2000).fits and not make(max_num_batched_tokens=2001).fits
    fixes = {f.flag: f for f in plan.fixes()}
    assert set(fixes) <= ALLOWED_FLAGS
    assert fixes["--max-num-batched-tokens"].value == "2000"
    assert "--gpu-memory-utilization" not in fixes  # already 1.0
    for fix in fixes.values():
        assert replan_with_fix(make, fix).fits, fix


def test_plan_failing_on_activations_direct():
    # 1 MiB per token/step; exactly 777 tokens of activations fit next to one sequence.
    base = direct_plan(act_per_token=1 * MiB)
    seq = base.seq_bytes
    total = 2 * (1 * GiB + 2 * GiB + 777 * MiB + 512 * MiB + seq)  # util 0.5
    plan = direct_plan(total=total, act_per_token=1 * MiB, max_num_seqs=1)
    assert not plan.fits
    batched = [f for f in plan.fixes() if f.flag == "--max-num-batched-tokens"]
    assert [f.value for f in batched] == ["777"]
    assert plan.with_settings(max_num_batched_tokens=777).fits
    assert not plan.with_settings(max_num_batched_tokens=778).fits


def test_float32_plan_suggests_bfloat16():
    def make(**changes):
        engine = {"model": "llama-3.2-3b", "dtype": "float32", "max_model_len": 4096, **changes}
        return dry_run_plan(EngineArgs(**engine), device="cuda", device_memory="16GiB")

    plan = make()
    assert plan.settings.dtype == torch.float32 and plan.weight_bytes == 4 * LLAMA_3B_PARAMS
    assert not plan.fits
    fixes = {f.flag: f for f in plan.fixes()}
    assert set(fixes) <= ALLOWED_FLAGS
    assert fixes["--dtype"].value == "bfloat16"
    for fix in fixes.values():
        fixed = replan_with_fix(make, fix)
        assert fixed.fits and fix.effect.startswith(fixed.effect()), fix
    assert make(dtype="bfloat16").kv_bytes_per_token == LLAMA_3B_KV_BF16


def test_too_long_max_model_len_suggests_the_longest_that_fits():
    plan = direct_plan(max_model_len=65536)  # 2560 blocks = 40960 tokens fit
    assert not plan.fits
    assert "one sequence of max_model_len 65536 needs" in plan.cause
    fixes = {f.flag: f.value for f in plan.fixes()}
    assert fixes["--max-model-len"] == "40960"
    assert plan.with_settings(max_model_len=40960).fits and not plan.with_settings(max_model_len=40961).fits
    with pytest.raises(KVCacheMemoryError) as e:
        plan.check()
    assert str(e.value).startswith("The model's max seq len (65536) is larger than the maximum number of tokens "
                                   "that can be stored in KV cache (40960)")


def test_too_small_kv_cache_memory_and_block_override_fixes():
    small = direct_plan(kv_cache_memory_bytes=10 * MiB)  # 5 blocks = 80 tokens, far below 2048
    assert not small.fits and "--kv-cache-memory" in small.cause
    fixes = {f.flag: f.value for f in small.fixes()}
    assert set(fixes) <= ALLOWED_FLAGS
    assert fixes["--kv-cache-memory"] == str(small.seq_bytes) and fixes["--max-model-len"] == "80"
    assert small.with_settings(kv_cache_memory_bytes=parse_size(fixes["--kv-cache-memory"])).fits
    assert not small.with_settings(kv_cache_memory_bytes=small.seq_bytes - 1).fits

    # An explicit size that, with everything else, exceeds the device.
    huge = direct_plan(kv_cache_memory_bytes=14 * GiB)
    assert not huge.fits and "exceed" in huge.cause
    assert all(f.flag in ALLOWED_FLAGS and huge.with_settings(
        kv_cache_memory_bytes=int(f.value)).fits for f in huge.fixes() if f.flag == "--kv-cache-memory")

    few = direct_plan(num_gpu_blocks_override=10)
    assert not few.fits and "num_gpu_blocks_override=10" in few.cause
    fixes = {f.flag: f.value for f in few.fixes()}
    assert set(fixes) <= ALLOWED_FLAGS and fixes["--num-gpu-blocks-override"] == "128"
    assert few.with_settings(num_gpu_blocks_override=128).fits
    assert not few.with_settings(num_gpu_blocks_override=127).fits


def test_negative_budget_raises_no_available_memory_with_breakdown_cause_and_fixes():
    plan = direct_plan(total=20 * GiB, used=15 * GiB, util=0.8)  # budget 16 GiB - 15 GiB < 2 GiB of weights
    assert plan.kv_budget_bytes < 0 and not plan.fits and plan.num_blocks == 0
    fixes = plan.fixes()
    assert fixes and {f.flag for f in fixes} <= ALLOWED_FLAGS
    util = [f for f in fixes if f.flag == "--gpu-memory-utilization"]
    assert len(util) == 1 and plan.with_settings(gpu_memory_utilization=float(util[0].value)).fits
    with pytest.raises(KVCacheMemoryError) as e:
        plan.check()
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert msg.startswith("No available memory for the cache blocks: ")
    assert plan.cause in msg and "15.00 GiB" in plan.cause
    for row in ("budget (gpu_memory_utilization 0.8)", "used by other processes and the OS", "model weights",
                "activation peak", "runtime overhead", "left for the KV cache", "KV cache per token"):
        assert row in msg, row
    left_row = next(line for line in msg.splitlines() if line.strip().startswith("left for the KV cache"))
    assert left_row.split()[-2].startswith("-")  # the negative KV budget is shown as such
    assert "fixes (each alone makes the plan fit):" in msg
    assert f"--gpu-memory-utilization {util[0].value}: " in msg


def test_utilization_fix_survives_float_rounding_of_the_budget():
    # Exactly 29 GiB of 100 GiB needed, but int(100 GiB * 0.29) is a byte short of 29 GiB.
    base = direct_plan()
    needed_ours = base.non_kv_bytes + base.seq_bytes
    plan = direct_plan(total=100 * GiB, used=29 * GiB - needed_ours, util=0.2)
    assert plan.device.used_by_others_bytes + needed_ours == 29 * GiB
    assert not plan.fits and not plan.with_settings(gpu_memory_utilization=0.29).fits
    util = [f.value for f in plan.fixes() if f.flag == "--gpu-memory-utilization"]
    assert util == ["0.3"] and plan.with_settings(gpu_memory_utilization=0.3).fits


def test_nothing_fits_when_others_use_more_than_the_budget():
    plan = direct_plan(total=20 * GiB, used=19 * GiB, util=0.9)
    assert not plan.fits and "cannot be met" in plan.cause
    assert plan.fixes() == []  # no lever helps: even all 20 GiB cannot hold 19 GiB + the model
    assert "no gpu_memory_utilization can fit it" in plan.table()


def test_fix_flags_are_always_implemented_ones():
    plans = [plan_seed(), plan_seed(max_model_len=131072), plan_seed(dtype="float32"),
             direct_plan(max_model_len=65536), direct_plan(kv_cache_memory_bytes=1 * MiB),
             direct_plan(num_gpu_blocks_override=1), direct_plan(total=20 * GiB, used=15 * GiB),
             direct_plan(dtype=torch.float32, total=5 * GiB, util=0.9, used=0),
             direct_plan(max_model_len=None, total=20 * GiB, used=15 * GiB)]
    seen = set()
    for plan in plans:
        assert not plan.fits
        for fix in plan.fixes():
            assert fix.flag in ALLOWED_FLAGS, fix
            assert fix.value and fix.effect.startswith("KV cache ")
            seen.add(fix.flag)
    assert {"--max-model-len", "--gpu-memory-utilization", "--dtype", "--kv-cache-memory",
            "--num-gpu-blocks-override"} <= seen


# -- max_model_len auto ------------------------------------------------------------------------------
def test_auto_max_model_len_is_the_longest_that_fits():
    plan = preset_plan("llama-3.2-3b", device_memory="12GiB", max_model_len="auto")
    assert plan.settings.max_model_len is None
    assert plan.fits and plan.max_model_len == plan.max_model_len_fit
    assert 0 < plan.max_model_len < 131072 and plan.max_model_len % 16 == 0
    assert plan.max_model_len == plan.blocks_that_fit * 16
    longer = preset_plan("llama-3.2-3b", device_memory="12GiB", max_model_len=plan.max_model_len + 16)
    assert not longer.fits
    assert preset_plan("llama-3.2-3b", device_memory="12GiB", max_model_len=plan.max_model_len).fits
    data = plan.to_json()
    assert data["max_model_len"] == data["max_model_len_fit"] == plan.max_model_len


def test_auto_max_model_len_is_capped_by_the_model():
    plan = preset_plan("llama-3.2-3b", device_memory="1000GiB", max_model_len="auto")
    assert plan.fits and plan.max_model_len == plan.max_model_len_fit == 131072
    assert plan.blocks_that_fit * 16 > 131072


def test_auto_when_nothing_fits():
    plan = direct_plan(max_model_len=None, total=20 * GiB, used=15 * GiB)
    assert not plan.fits and plan.max_model_len == 0
    with pytest.raises(KVCacheMemoryError, match="^No available memory for the cache blocks"):
        plan.check()


# -- the JSON form --------------------------------------------------------------------------------------
def test_to_json_keys_and_values():
    data = json.loads(json.dumps(plan_seed().to_json()))
    for key in ("fits", "device_total_bytes", "device_used_bytes", "budget_bytes", "weights_bytes",
                "activation_peak_bytes", "overhead_bytes", "kv_cache_bytes", "kv_bytes_per_token", "block_size",
                "num_blocks", "max_model_len", "max_model_len_fit", "max_concurrency", "cause", "fixes"):
        assert key in data, key
    assert data["fits"] is False and data["kv_bytes_per_token"] == LLAMA_3B_KV_BF16 and data["block_size"] == 16
    assert all(set(f) == {"flag", "value", "effect"} for f in data["fixes"]) and data["fixes"]
    ok = json.loads(json.dumps(plan_seed(gpu_memory_utilization=0.9).to_json()))
    assert ok["fits"] is True and ok["cause"] is None and ok["fixes"] == []
    assert ok["kv_cache_bytes"] == ok["num_blocks"] * 16 * LLAMA_3B_KV_BF16 > 0
    assert ok["max_concurrency"] == pytest.approx(ok["num_blocks"] * 16 / 2048, abs=1e-3)


# -- inputs --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("128GiB", 128 * 2**30), ("119.7GB", int(119.7 * 10**9)), ("512MiB", 512 * 2**20), ("4G", 4 * 2**30),
    ("1234", 1234), ("0.5GiB", 2**29), ("16 KiB", 16 * 1024), ("2TiB", 2 * 2**40), ("100b", 100),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "", "GiB", "12 apples", "1.2.3GB", "nan"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_size(text)


@pytest.mark.parametrize("util", [0.0, -0.5, 1.01, 2.0])
def test_plan_settings_reject_bad_utilization(util):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        PlanSettings(dtype=torch.bfloat16, max_model_len=2048, gpu_memory_utilization=util)


def test_dry_run_rejects_bad_device_sizes():
    with pytest.raises(ValueError, match="memory size"):
        dry_run_plan(EngineArgs(model="llama-3.2-3b"), device="cuda", device_memory="lots")
    with pytest.raises(ValueError, match="--device-memory-used"):
        dry_run_plan(EngineArgs(model="llama-3.2-3b"), device="cuda", device_memory="10GiB",
                     device_memory_used="11GiB")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        dry_run_plan(EngineArgs(model="llama-3.2-3b"), device="cuda", device_memory="10GiB", tensor_parallel_size=0)


# -- CUDA graphs ----------------------------------------------------------------------------------
def test_cuda_graph_pool_is_a_line_of_the_plan_and_enforce_eager_removes_it():
    """On a CUDA device the decode graphs (1, 2, 4, 8, .., max_num_seqs) are planned from config shapes:
    the activations of one decode step of the largest size, split-K partials and the null block."""
    plan = preset_plan("llama-3.1-8b", max_model_len=8192)
    s = plan.settings
    assert s.cuda_graph_sizes[:5] == (1, 2, 4, 8, 16) and s.cuda_graph_sizes[-1] == 256
    assert 50 * MiB < plan.graph_pool_bytes < 200 * MiB
    line = next(l for l in plan.table().splitlines() if "CUDA graphs" in l)
    assert "35 decode sizes, up to 256 rows" in line and "--enforce-eager: none" in line
    assert plan.to_json()["cuda_graph_pool_bytes"] == plan.graph_pool_bytes
    eager = preset_plan("llama-3.1-8b", max_model_len=8192, enforce_eager=True)
    assert eager.graph_pool_bytes == 0 and "CUDA graphs" not in eager.table()
    assert eager.kv_budget_bytes - plan.kv_budget_bytes == plan.graph_pool_bytes
    fewer = preset_plan("llama-3.1-8b", max_model_len=8192, max_num_seqs=32)
    assert fewer.graph_pool_bytes < plan.graph_pool_bytes  # the largest size sets the pool
    assert preset_plan("llama-3.1-8b", max_model_len=8192, cuda_graph_sizes=[1, 2]).settings.cuda_graph_sizes == (1, 2)
    cpu = dry_run_plan(EngineArgs(model="llama-3.1-8b", max_model_len=8192), device="cpu", device_memory="80GiB")
    assert cpu.graph_pool_bytes == 0  # no graphs on a CPU


def test_structured_outputs_bitmask_is_a_line_of_the_plan():
    """A bit per vocabulary token per sequence, in 32-bit words: on the device; on a CPU the host copy it is
    filled in lives in the same memory, so twice."""
    plan = preset_plan("qwen2.5-0.5b", max_model_len=4096)
    row = -(-151936 // 32) * 4
    assert plan.bitmask_bytes == 256 * row
    line = next(l for l in plan.table().splitlines() if "structured outputs bitmask (256 rows)" in l)
    assert "VLLM_XGRAMMAR_CACHE_MB" in line and "512.0 MiB" in line
    assert plan.to_json()["structured_output_bitmask_bytes"] == plan.bitmask_bytes
    assert preset_plan("qwen2.5-0.5b", max_model_len=4096, max_num_seqs=32).bitmask_bytes == 32 * row
    cpu = dry_run_plan(EngineArgs(model="qwen2.5-0.5b", max_model_len=4096), device="cpu", device_memory="20GiB")
    assert cpu.bitmask_bytes == 2 * 256 * row


def test_enforce_eager_is_a_fix_when_the_graph_pool_tips_the_plan():
    make = lambda **kw: preset_plan("llama-3.1-8b", max_model_len=8192, device_memory=memory, **kw)  # noqa: E731
    base = preset_plan("llama-3.1-8b", max_model_len=8192)
    # A device where one sequence of max_model_len fits only without the graph pool.
    needed = base.weight_bytes + base.activation_bytes + base.overhead_bytes + base.seq_bytes + base.bitmask_bytes
    memory = str(math.ceil((needed + base.graph_pool_bytes // 2) / 0.9))
    plan = make()
    assert not plan.fits and "the CUDA graphs of decode steps take" in plan.cause
    fixes = {f.flag: f for f in plan.fixes()}
    assert "--enforce-eager" in fixes
    fix = fixes["--enforce-eager"]
    assert fix.command == "--enforce-eager" and "frees the CUDA graph pool" in fix.effect
    assert replan_with_fix(make, fix).fits
    assert "    --enforce-eager: KV cache" in plan.table()


def test_worker_processes_are_a_line_of_the_plan_where_they_share_its_memory():
    """The server's grammar-compile worker (and, where it trusts request templates, the template worker) may hold
    host memory up to its cap: on a CPU (or unified memory) that memory is the plan's, taken before the KV
    cache; on a discrete GPU the line says it is host memory and takes nothing."""
    from pagedllm.isolated_worker import (
        GRAMMAR_WORKER_START_BYTES,
        TEMPLATE_WORKER_MEMORY_BYTES,
        TEMPLATE_WORKER_START_BYTES,
    )

    served = dict(model="qwen2.5-0.5b", max_model_len=4096, structured_outputs_compile_timeout=10.0)
    cpu = dry_run_plan(EngineArgs(**served), device="cpu", device_memory="20GiB")
    compile_bytes = GRAMMAR_WORKER_START_BYTES + (2 << 30)  # its start and --structured-outputs-compile-memory
    assert cpu.settings.worker_processes == (("grammar compiles", compile_bytes),)
    assert cpu.worker_bytes == compile_bytes and cpu.to_json()["worker_process_bytes"] == compile_bytes
    offline = dry_run_plan(EngineArgs(model="qwen2.5-0.5b", max_model_len=4096), device="cpu", device_memory="20GiB")
    assert offline.worker_bytes == 0 and "worker processes" not in offline.table()  # compiles in its own process
    assert offline.kv_budget_bytes - cpu.kv_budget_bytes == compile_bytes
    both = dry_run_plan(EngineArgs(**served, trust_request_chat_template=True, structured_outputs_compile_memory="512MiB"),
                        device="cpu", device_memory="20GiB")
    assert both.worker_bytes == (GRAMMAR_WORKER_START_BYTES + (512 << 20) + TEMPLATE_WORKER_START_BYTES
                                 + TEMPLATE_WORKER_MEMORY_BYTES)
    assert any("worker processes (grammar compiles, request templates)" in line for line in both.table().splitlines())
    gpu = preset_plan("qwen2.5-0.5b", max_model_len=4096, structured_outputs_compile_timeout=10.0)
    assert gpu.worker_bytes == 0 and "host memory, not this device's" in gpu.table()


@pytest.mark.parametrize("handler,init,start", [
    ("pagedllm.structured_output:grammar_worker", "grammar", "GRAMMAR_WORKER_START_BYTES"),
    ("pagedllm.entrypoints.openai.request_templates:template_worker", {}, "TEMPLATE_WORKER_START_BYTES"),
])
def test_a_started_worker_holds_no_more_than_the_plan_counts(tiny_models, handler, init, start):
    """The plan's start figure is what a worker really holds once started (its resident memory)."""
    from pathlib import Path

    import os

    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pagedllm import isolated_worker

    if init == "grammar":
        tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
        init = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)).serialize_json()
    worker = isolated_worker.IsolatedWorker(handler, init, 1 << 30)
    try:
        pid = worker.start()
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    finally:
        worker.shutdown()
    assert 0 < rss <= getattr(isolated_worker, start), rss
