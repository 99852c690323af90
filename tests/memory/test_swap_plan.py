"""--swap-space in the memory plan: its own line (host memory), checked against the host on a discrete
GPU and against the same RAM as the KV cache on CPU, and offered as a fix (verified by re-planning)
where the KV cache cannot hold max_num_seqs full-length sequences. No model loaded, no device needed."""
from __future__ import annotations

import json

import pytest
import torch

from pagedllm import KVCacheMemoryError
from pagedllm.entrypoints.cli import main
from pagedllm.memory.plan import (
    DeviceFacts,
    GiB,
    KiB,
    MemoryPlan,
    MiB,
    ModelFacts,
    PlanSettings,
)
from pagedllm.utils import gib_to_bytes

KV_PER_TOKEN = 112 * KiB  # Llama-3.2-3B in bfloat16
BLOCK = 16 * KV_PER_TOKEN


def make_plan(device: str = "cuda", unified: bool = False, host_total: int | None = 64 * GiB,
              host_used: int = 8 * GiB, **settings) -> MemoryPlan:
    """16 GiB device, 1 GiB used by others, utilization 0.5: 4480 MiB left for 2560 blocks of the KV cache."""
    model = ModelFacts(
        model_max_len=131072,
        weight_bytes=lambda s: 2 * GiB,
        activation_bytes=lambda s: 64 * KiB * s.max_num_batched_tokens,
        overhead_bytes=lambda s: 512 * MiB,
        kv_bytes_per_token=lambda s: KV_PER_TOKEN,
    )
    s = PlanSettings(**{"dtype": torch.bfloat16, "max_model_len": 2048, "gpu_memory_utilization": 0.5, **settings})
    host = (host_total, host_used) if host_total is not None else (None, None)
    return MemoryPlan(s, DeviceFacts(device, 16 * GiB, 1 * GiB, unified, source="given", host_total_bytes=host[0],
                                     host_used_bytes=host[1]), model)


def test_swap_space_is_whole_blocks_of_host_memory_beside_the_device():
    plain, swap = make_plan(), make_plan(swap_space_bytes=1 * GiB)
    assert swap.num_swap_blocks == GiB // BLOCK == 585
    assert swap.swap_bytes == 585 * BLOCK and swap.swap_tokens == 585 * 16
    assert swap.kv_budget_bytes == plain.kv_budget_bytes and swap.num_blocks == plain.num_blocks  # not device memory
    assert swap.fits and swap.cause is None and swap.fixes() == []
    row = next(line for line in swap.table().splitlines() if "swap space (--swap-space)" in line)
    assert f"{585 * 16} tokens" in row and "host memory, 56.00 GiB free" in row
    assert "swap space (--swap-space)" not in plain.table()
    data = json.loads(json.dumps(swap.to_json()))
    assert (data["swap_bytes"], data["num_swap_blocks"], data["swap_tokens"]) == (585 * BLOCK, 585, 585 * 16)
    assert data["host_free_bytes"] == 56 * GiB and plain.to_json()["swap_bytes"] == 0


def test_swap_space_past_the_host_limit_does_not_fit_and_the_largest_that_does_is_offered():
    plan = make_plan(host_total=16 * GiB, host_used=2 * GiB, swap_space_bytes=12 * GiB)
    assert plan.host_swap_limit() == int(0.7 * 16 * GiB)  # vLLM's 70% of the host, under the 14 GiB free
    assert plan.kv_fits and not plan.swap_fits and not plan.fits
    assert "--swap-space 12.00 GiB is host memory" in plan.cause and "70%" in plan.cause
    with pytest.raises(KVCacheMemoryError, match="^Not enough memory for the swap space"):
        plan.check()
    (fix,) = [f for f in plan.fixes() if f.flag == "--swap-space"]
    fixed = plan.with_settings(swap_space_bytes=gib_to_bytes(float(fix.value)))
    assert fixed.fits and fix.effect.startswith(fixed.effect())
    assert not plan.with_settings(swap_space_bytes=gib_to_bytes(float(fix.value) + 0.01)).fits  # the largest
    assert "no gpu_memory_utilization can fit it" not in plan.table()


def test_swap_space_smaller_than_a_block_does_not_fit():
    plan = make_plan(swap_space_bytes=BLOCK - 1)
    assert plan.num_swap_blocks == 0 and not plan.fits
    assert "smaller than one KV block" in plan.cause


def test_on_cpu_the_swap_space_comes_out_of_the_same_budget_as_the_kv_cache():
    plain = make_plan(device="cpu", host_total=None)
    swap = make_plan(device="cpu", host_total=None, swap_space_bytes=1 * GiB)
    assert swap.swap_shares_device_memory
    assert swap.kv_budget_bytes == plain.kv_budget_bytes - swap.swap_bytes
    assert swap.num_blocks + swap.num_swap_blocks <= plain.num_blocks  # the same RAM, never more in all
    assert "the same RAM as the KV cache" in swap.table()
    assert swap.preemption_fixes() == []  # there the bytes serve better as KV cache
    # With an explicit KV cache size, the swap space counts against the whole memory beside it.
    explicit = make_plan(device="cpu", host_total=None, kv_cache_memory_bytes=11 * GiB)
    assert explicit.fits and not explicit.with_settings(swap_space_bytes=2 * GiB).fits
    # Unified memory is the same case.
    assert make_plan(unified=True, swap_space_bytes=1 * GiB).kv_budget_bytes == swap.kv_budget_bytes


def test_a_kv_cache_short_of_max_num_seqs_sequences_gets_a_verified_swap_space_fix():
    plan = make_plan(max_num_seqs=64)  # holds 20 of 64 sequences of 2048
    assert plan.fits and plan.fixes() == [] and plan.num_blocks < plan.max_useful_blocks
    (fix,) = plan.preemption_fixes()
    assert fix.flag == "--swap-space"
    fixed = plan.with_settings(swap_space_bytes=gib_to_bytes(float(fix.value)))
    assert fixed.fits and fixed.num_blocks == plan.num_blocks  # the KV cache is unchanged
    short = plan.max_useful_blocks - plan.num_blocks  # blocks the cache lacks for 64 full sequences
    assert short <= fixed.num_swap_blocks < short + GiB // 100 // BLOCK + 1  # rounded up to 0.01 GiB
    assert fix.effect == fixed.swap_effect(plan) and fix.effect.startswith(f"+{fixed.swap_tokens} tokens")
    assert fixed.preemption_fixes() == []  # nothing short any more
    lines = plan.table().splitlines()
    assert any(line.startswith("  preemption: the KV cache holds 20.0 of max_num_seqs 64") for line in lines)
    assert f"    --swap-space {fix.value}: {fix.effect}" in lines
    assert plan.to_json()["preemption_fixes"] == [{"flag": fix.flag, "value": fix.value, "effect": fix.effect}]


def test_the_swap_space_fix_is_capped_by_the_host_and_not_offered_where_it_cannot_help():
    capped = make_plan(host_total=16 * GiB, host_used=2 * GiB)  # 256 sequences would want ~50 GiB
    (fix,) = capped.preemption_fixes()
    assert fix.value == "6.39"  # 0.01 GiB steps under 40% of the host's 16 GiB (vLLM warns past it)
    assert make_plan(max_num_seqs=4).preemption_fixes() == []  # the KV cache holds all 4 at once
    assert make_plan(unified=True).preemption_fixes() == []
    assert make_plan(host_total=None).preemption_fixes() == []  # host memory unknown
    assert make_plan(max_model_len=131072).preemption_fixes() == []  # does not fit: no model starts from swap
    assert make_plan(host_used=64 * GiB - MiB).preemption_fixes() == []  # no host memory left


def test_plan_command_shows_the_swap_line_and_the_fix(capsys):
    gpu = ["plan", "llama-3.1-8b", "--device", "cuda", "--device-memory", "24GiB", "--max-model-len", "8192"]
    code = main([*gpu, "--swap-space", "4", "--host-memory", "64GiB", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["fits"]
    block = 16 * 128 * KiB  # 32 layers x 8 kv heads x 128 x 2 (K, V) x 2 bytes a token
    assert data["swap_space_bytes"] == 4 * GiB and data["num_swap_blocks"] == 4 * GiB // block
    assert data["host_free_bytes"] == 64 * GiB
    main([*gpu, "--swap-space", "4", "--host-memory", "64GiB"])
    lines = capsys.readouterr().out.splitlines()
    assert any("swap space (--swap-space)" in line and f"{data['num_swap_blocks']} blocks" in line for line in lines)
    (fix,) = data["preemption_fixes"]  # 4.3 sequences of 8192 held, 256 asked for: more swap helps
    assert f"    --swap-space {fix['value']}: {fix['effect']}" in lines
    code = main([*gpu, "--swap-space", fix["value"], "--host-memory", "64GiB", "--json"])  # re-planned by the CLI
    fixed = json.loads(capsys.readouterr().out)
    assert code == 0 and fixed["fits"] and fixed["swap_tokens"] > data["swap_tokens"]
    # Without --host-memory, the host of a described machine is unknown: nothing checked, nothing offered.
    main([*gpu, "--swap-space", "4", "--json"])
    unknown = json.loads(capsys.readouterr().out)
    assert unknown["host_free_bytes"] is None and unknown["preemption_fixes"] == [] and unknown["fits"]
