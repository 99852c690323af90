"""--kv-cache-dtype in the memory plan: bytes per token in the cache dtype, the blocks the engine
allocates equal to the plan's, the fp8 fix with its tokens gained (verified by re-planning), and
the flag on every command that takes engine flags."""
from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import build_parser, engine_args_from, main
from pagedllm.entrypoints.plan import dry_run_plan
from pagedllm.model_executor.model_files import load_hf_config

CACHE_DTYPES = {"auto": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}


def kv_per_token_by_hand(path, itemsize: int) -> int:
    cfg = load_hf_config(path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * itemsize


def assert_allocation_is_the_plan(llm: LLM, dtype: torch.dtype) -> None:
    engine, plan = llm.llm_engine, llm.memory_plan
    kv_cache = engine.executor.driver.kv_cache
    assert kv_cache.dtype == dtype == plan.settings.kv_dtype
    assert kv_cache.numel() * kv_cache.element_size() == plan.kv_cache_bytes
    assert kv_cache.shape[3] == plan.max_tokens_in_cache == plan.num_blocks * plan.settings.block_size
    assert engine.kv_cache.pool.num_blocks == plan.num_blocks


@pytest.mark.parametrize("name", list(CACHE_DTYPES))
def test_blocks_from_a_kv_budget_follow_the_cache_dtype(tiny_models, name):
    path = tiny_models["llama"]
    dtype = CACHE_DTYPES[name]
    budget = 1000 * kv_per_token_by_hand(path, 4) + 7  # 1000 float32 tokens
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory=budget, kv_cache_dtype=name)
    plan = llm.memory_plan
    assert plan.kv_bytes_per_token == kv_per_token_by_hand(path, dtype.itemsize)
    assert plan.num_blocks == budget // (16 * plan.kv_bytes_per_token) == {4: 62, 2: 125, 1: 250}[dtype.itemsize]
    assert plan.to_json()["kv_cache_dtype"] == str(dtype).removeprefix("torch.")
    assert_allocation_is_the_plan(llm, dtype)


@pytest.mark.parametrize("model_dtype, name", [("bfloat16", "fp8"), ("bfloat16", "auto"), ("float32", "fp8_e5m2")])
def test_measured_plan_equals_the_allocation(tiny_models, model_dtype, name):
    """Sized from measured memory (the profile run with the cache dtype's scratch cache)."""
    llm = LLM(str(tiny_models["qwen2"]), dtype=model_dtype, max_model_len=64, kv_cache_dtype=name)
    dtype = CACHE_DTYPES[name] if name != "auto" else torch.bfloat16
    assert llm.memory_plan.fits and llm.memory_plan.model.activation_source == "measured"
    assert_allocation_is_the_plan(llm, dtype)


# -- the fix ------------------------------------------------------------------------------------------
def _short_kv(**changes):
    """Llama-3.2-3B, 4096 tokens: the device holds everything but 3/4 of one sequence's bfloat16 KV.
    Without CUDA graphs, whose null block (one block of the cache's dtype) would make fp8 blocks not
    exactly twice as many."""
    def make(**more):
        engine = {"model": "llama-3.2-3b", "max_model_len": 4096, "gpu_memory_utilization": 1.0, "enforce_eager": True,
                  **changes, **more}
        return dry_run_plan(EngineArgs(**engine), device="cuda", device_memory=str(total))

    probe = dry_run_plan(EngineArgs(model="llama-3.2-3b", max_model_len=4096, enforce_eager=True, **changes),
                         device="cuda", device_memory="80GiB")
    total = probe.non_kv_bytes + probe.seq_bytes * 3 // 4
    return make


def test_short_kv_cache_suggests_fp8_with_the_tokens_gained():
    make = _short_kv()
    plan = make()
    assert not plan.fits and plan.settings.kv_dtype == torch.bfloat16 and plan.kv_budget_bytes > 0
    fix = next(f for f in plan.fixes() if f.flag == "--kv-cache-dtype")
    assert fix.value == "fp8"
    fixed = make(kv_cache_dtype=fix.value)  # re-planned from the arguments, as the CLI would
    assert fixed.fits and fixed.fixes() == []
    assert fixed.kv_bytes_per_token * 2 == plan.kv_bytes_per_token and fixed.num_blocks == 2 * plan.num_blocks
    gained = fixed.max_tokens_in_cache - plan.max_tokens_in_cache
    assert gained == plan.max_tokens_in_cache > 0
    assert fix.effect == f"{fixed.effect()} (+{gained} tokens over the bfloat16 cache)"
    assert f"    --kv-cache-dtype fp8: {fix.effect}" in plan.table().splitlines()


def test_no_fp8_fix_when_it_cannot_help():
    already = _short_kv(kv_cache_dtype="fp8")()
    assert not already.fits and "--kv-cache-dtype" not in {f.flag for f in already.fixes()}
    # The weights alone overflow the budget: a smaller KV cache does not make it fit.
    no_room = dry_run_plan(EngineArgs(model="llama-3.2-3b", max_model_len=2048), device="cuda",
                           device_memory="4GiB")
    assert no_room.kv_budget_bytes < 0 and "--kv-cache-dtype" not in {f.flag for f in no_room.fixes()}
    blocks = dry_run_plan(EngineArgs(model="llama-3.2-3b", max_model_len=2048, num_gpu_blocks_override=10),
                          device="cuda", device_memory="80GiB")
    assert not blocks.fits and "--kv-cache-dtype" not in {f.flag for f in blocks.fixes()}


def test_float32_cache_fix_quarters_the_bytes():
    make = _short_kv(dtype="float32", kv_cache_dtype="float32")
    plan = make()
    fixed = make(kv_cache_dtype="fp8")
    assert fixed.kv_bytes_per_token * 4 == plan.kv_bytes_per_token
    assert [f.value for f in plan.fixes() if f.flag == "--kv-cache-dtype"] == ["fp8"] and fixed.fits


# -- the flag on the command line ---------------------------------------------------------------------
def test_plan_command_with_kv_cache_dtype_fp8(capsys):
    base = ["plan", "llama-3.2-3b", "--device", "cuda", "--device-memory", "24GiB", "--max-model-len", "8192",
            "--enforce-eager"]  # (CUDA graphs' null block is one block of the cache's dtype)
    assert main([*base, "--kv-cache-dtype", "fp8", "--json"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert main([*base, "--json"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert fp8["kv_cache_dtype"] == "float8_e4m3fn" and bf16["kv_cache_dtype"] == "bfloat16"
    assert fp8["kv_bytes_per_token"] * 2 == bf16["kv_bytes_per_token"] == 112 * 1024
    assert fp8["num_blocks"] // 2 == bf16["num_blocks"]  # the same budget, whole blocks of half the size
    assert main([*base, "--kv-cache-dtype", "fp8"]) == 0
    assert "KV cache per token (float8_e4m3fn)" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["generate", "x"], ["serve"], ["plan"]])
def test_every_engine_command_takes_the_flag(command):
    """`bench throughput` builds its parser with the same add_engine_args."""
    ns = build_parser().parse_args([*command, "--kv-cache-dtype", "fp8_e5m2"])
    assert engine_args_from(ns).kv_cache_dtype == "fp8_e5m2"
    assert engine_args_from(build_parser().parse_args(command)).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--kv-cache-dtype", "int4"])


def test_api_server_no_longer_refuses_the_flag():
    from pagedllm.entrypoints.openai.api_server import (
        UNIMPLEMENTED_FLAGS,
        refuse_unimplemented,
    )
    from pagedllm.entrypoints.openai.api_server import build_parser as server_parser

    assert "--kv-cache-dtype" not in UNIMPLEMENTED_FLAGS
    ns = server_parser().parse_args(["--kv-cache-dtype", "fp8"])
    refuse_unimplemented(ns)
    assert engine_args_from(ns).kv_cache_dtype == "fp8"
