"""Preemption with swap space end to end on a tiny model (float32): a pool too small for the batch
forces preemption; outputs equal transformers and an unconstrained run whether preempted requests
swap or recompute, the swapped K/V is really what they resume from, and no block leaks in either pool."""
from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM, KVCacheMemoryError, SamplingParams
from pagedllm.entrypoints.cli import build_parser, engine_args_from
from pagedllm.entrypoints.openai.api_server import build_parser as server_parser
from pagedllm.entrypoints.openai.api_server import refuse_unimplemented
from tests.helpers import hf_greedy

LOGPROB_TOL = 1e-4
MAX_TOKENS = 20
SWAP = 2**-13  # GiB = 128 KiB: 64 blocks of 4 tokens of the tiny Llama in float32 (2 KiB a block)
TIGHT = {"dtype": "float32", "max_model_len": 64, "block_size": 4, "num_gpu_blocks_override": 16}  # 64 tokens
ROOMY = {**TIGHT, "num_gpu_blocks_override": 1024}
PROMPTS = [list(range(10 + 7 * i, 22 + 9 * i)) for i in range(6)]  # 12..57 tokens: 6 x up to 77 > 64


@pytest.fixture(scope="module")
def path(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def reference(path) -> list[tuple[list[int], list[float]]]:
    return [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]


def count_computed_tokens(llm: LLM) -> list[int]:
    """Wrap the model runner so every step adds the tokens it computes to the returned counter."""
    runner, total = llm.llm_engine.executor.driver, [0]
    execute = runner.execute_async

    def counted(step):
        total[0] += step.num_tokens
        return execute(step)

    runner.execute_async = counted
    return total


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, **params):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, **params)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_no_leak(llm)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def assert_no_leak(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.check_integrity()  # both pools
    kv = engine.kv_cache
    assert kv.num_free_blocks == kv.pool.num_blocks - (kv.null_block is not None) and kv.num_swapped_blocks == 0
    assert not engine.scheduler.swapped and not kv.swapped_tables


def assert_equal(got, want) -> None:
    for (ids, lps), (ref_ids, ref_lps) in zip(got, want, strict=True):
        assert ids == ref_ids
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < LOGPROB_TOL


@pytest.mark.parametrize("caching", [False, True])
def test_swap_preemption_equals_transformers_and_recomputes_nothing(path, reference, caching):
    llm = LLM(str(path), swap_space=SWAP, preemption_mode="swap", enable_prefix_caching=caching, **TIGHT)
    computed = count_computed_tokens(llm)
    assert_equal(greedy(llm, PROMPTS), reference)
    stats, swaps = llm.llm_engine.preemption_stats, llm.llm_engine.swap_stats
    assert stats.swap > 0 and stats.recompute == 0 and stats.recomputed_tokens == 0
    assert swaps.swapped_out_blocks > 0 and swaps.swapped_in_blocks > 0
    least = sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS)  # every position once; the last token is never fed
    if caching:
        assert computed[0] <= least  # prefix hits (and swap-ins that found their blocks cached) save more
    else:
        assert computed[0] == least  # no token computed twice: they resumed from the swapped K/V
        assert swaps.swapped_in_blocks == swaps.swapped_out_blocks


@pytest.mark.parametrize("caching", [False, True])
def test_recompute_preemption_equals_transformers(path, reference, caching):
    llm = LLM(str(path), preemption_mode="recompute", enable_prefix_caching=caching, **TIGHT)
    computed = count_computed_tokens(llm)
    assert_equal(greedy(llm, PROMPTS), reference)
    stats = llm.llm_engine.preemption_stats
    assert stats.recompute > 0 and stats.swap == 0 and stats.recomputed_tokens > 0
    assert llm.llm_engine.kv_cache.host_pool is None
    if not caching:
        assert computed[0] == sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS) + stats.recomputed_tokens


def test_without_the_swap_in_copies_the_outputs_change(path, reference):
    """The check above could fail: skip the copies back and the resumed requests read stale K/V."""
    llm = LLM(str(path), swap_space=SWAP, preemption_mode="swap", enable_prefix_caching=False, **TIGHT)
    runner = llm.llm_engine.executor.driver
    swap_blocks = runner.swap_blocks

    def swap_out_only(step):
        step.blocks_to_swap_in = []
        swap_blocks(step)

    runner.swap_blocks = swap_out_only
    got = greedy(llm, PROMPTS)
    assert llm.llm_engine.swap_stats.swapped_in_blocks > 0
    assert [ids for ids, _ in got] != [ids for ids, _ in reference]


def test_a_windowed_model_swaps_every_groups_blocks(tiny_models):
    """gpt-oss (a full-attention KV group and two window groups, kv_layout.py): swapped-out requests resume from
    every group's K/V, the blocks below their windows staying dropped; equal to transformers, nothing recomputed."""
    path = tiny_models["gpt_oss"]
    # 49 blocks of one layer each: one 64-token sequence with its prompt in one step (16 per group + the null block)
    llm = LLM(str(path), swap_space=SWAP, preemption_mode="swap", enable_prefix_caching=False,
              **{**TIGHT, "num_gpu_blocks_override": 49})
    assert len(llm.llm_engine.kv_cache.groups) == 3
    computed = count_computed_tokens(llm)
    assert_equal(greedy(llm, PROMPTS), [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS])
    stats, swaps = llm.llm_engine.preemption_stats, llm.llm_engine.swap_stats
    assert stats.swap > 0 and stats.recompute == 0 and swaps.swapped_in_blocks == swaps.swapped_out_blocks > 0
    assert computed[0] == sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS)


def test_automatic_mode_with_a_small_host_pool_mixes_both_kinds(path, reference):
    llm = LLM(str(path), swap_space=2**-16, **TIGHT)  # 16 KiB: 8 blocks, less than some requests hold
    assert llm.llm_engine.num_swap_blocks == 8
    assert_equal(greedy(llm, PROMPTS), reference)
    stats = llm.llm_engine.preemption_stats
    assert stats.swap > 0 and stats.recompute > 0


@pytest.mark.parametrize("mode, swap", [("swap", SWAP), ("recompute", 0.0)])
@pytest.mark.parametrize("caching", [False, True])
def test_a_load_five_times_the_pool_completes_correctly(path, mode, swap, caching):
    """20 requests of 16 tokens' KV each (320 tokens) through a pool of 64: every output equals an
    unconstrained run's, and neither pool keeps a block."""
    prompts = [list(range(30 + 11 * i, 38 + 11 * i)) for i in range(20)]  # 8 tokens + 8 generated
    unconstrained = greedy(LLM(str(path), enable_prefix_caching=caching, **ROOMY), prompts, max_tokens=8)
    llm = LLM(str(path), swap_space=swap, preemption_mode=mode, enable_prefix_caching=caching,
              **{**TIGHT, "num_gpu_blocks_override": 16})
    assert sum(len(p) + 8 for p in prompts) >= 5 * 16 * 4
    assert_equal(greedy(llm, prompts, max_tokens=8), unconstrained)
    assert llm.llm_engine.preemption_stats.total > 0


def test_n_samples_with_a_seed_survive_swapping(path):
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    want = [[c.token_ids for c in o.outputs] for o in LLM(str(path), **ROOMY).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(path), swap_space=SWAP, preemption_mode="swap", **TIGHT)
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.llm_engine.preemption_stats.swap > 0
    assert_no_leak(llm)


def test_fp8_cache_swaps_as_bytes(path):
    """An fp8 cache is copied as raw bytes: swap-preempted outputs equal the unconstrained fp8 run's
    (to the float noise of batching requests differently, as any two schedules)."""
    want = greedy(LLM(str(path), kv_cache_dtype="fp8", **ROOMY), PROMPTS)
    llm = LLM(str(path), kv_cache_dtype="fp8", swap_space=SWAP, preemption_mode="swap", **TIGHT)
    assert llm.llm_engine.executor.driver.swap_cache.dtype == torch.float8_e4m3fn
    assert_equal(greedy(llm, PROMPTS), want)
    assert llm.llm_engine.preemption_stats.swap > 0


def test_priority_picks_the_victim(path):
    """The older request with the larger priority value is swapped out, not the newer important one."""
    engine = LLM(str(path), swap_space=SWAP, preemption_mode="swap", scheduling_policy="priority", **TIGHT).llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("unimportant", {"prompt_token_ids": PROMPTS[0]}, params, priority=1)
    engine.add_request("important", {"prompt_token_ids": PROMPTS[1]}, params, priority=0)
    swapped_out = []
    while engine.has_unfinished_requests():
        swapped_out += [r.request_id for r in engine.scheduler.swapped]
        engine.step()
    assert swapped_out and set(swapped_out) == {"unimportant"}
    with pytest.raises(TypeError, match="priority"):
        engine.add_request("x", [1, 2], params, priority="high")


def test_generate_takes_one_priority_per_prompt(path):
    with pytest.raises(ValueError, match="scheduling-policy priority"):  # the default policy is fcfs
        LLM(str(path), **ROOMY).generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])
    llm = LLM(str(path), scheduling_policy="priority", **ROOMY)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1, 0])
    assert len(outs) == 2
    with pytest.raises(ValueError, match="priorities"):
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])


# -- the plan's numbers are what the engine allocates ----------------------------------------------

@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_plan_swap_line_equals_the_host_tensor(path, kv_cache_dtype):
    llm = LLM(str(path), swap_space=SWAP, kv_cache_dtype=kv_cache_dtype, **TIGHT)
    engine, plan = llm.llm_engine, llm.memory_plan
    host, device = engine.executor.driver.swap_cache, engine.executor.driver.kv_cache
    assert host.device.type == "cpu" and host.dtype == device.dtype
    assert host.shape[:3] == device.shape[:3] and host.shape[4:] == device.shape[4:]  # the same per-layer layout
    assert plan.swap_bytes == host.numel() * host.element_size()
    assert plan.num_swap_blocks == engine.num_swap_blocks == engine.kv_cache.host_pool.num_blocks
    assert plan.block_bytes == engine.executor.driver.kv_block_bytes
    assert plan.num_swap_blocks == int(SWAP * 2**30) // plan.block_bytes
    assert f"{plan.num_swap_blocks} blocks" in plan.table() and "swap space (--swap-space)" in plan.table()
    assert plan.to_json()["swap_bytes"] == plan.swap_bytes


# -- settings -----------------------------------------------------------------------------------

def test_flags_reach_the_engine_args():
    ns = build_parser().parse_args(["generate", "x", "--swap-space", "0.5", "--preemption-mode", "swap"])
    args = engine_args_from(ns)
    assert (args.swap_space, args.preemption_mode) == (0.5, "swap")
    ns = server_parser().parse_args(["--swap-space", "2", "--preemption-mode", "recompute"])
    refuse_unimplemented(ns)  # real flags now, not refused ones
    assert engine_args_from(ns).swap_space == 2.0
    defaults = engine_args_from(build_parser().parse_args(["generate", "x"]))
    assert (defaults.swap_space, defaults.preemption_mode) == (0.0, None)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"preemption_mode": "swap"}, ValueError, "needs swap space"),
    ({"preemption_mode": "recompute", "swap_space": 1}, ValueError, "never uses"),
    ({"preemption_mode": "sometimes"}, ValueError, "preemption_mode must be one of"),
    ({"swap_space": -1}, ValueError, "swap_space must be"),
    ({"swap_space": "4GiB"}, ValueError, "swap_space must be"),
    ({"swap_space": 1e-9}, KVCacheMemoryError, "smaller than one KV block"),
])
def test_bad_settings_are_refused(path, kwargs, error, match):
    with pytest.raises(error, match=match):
        LLM(str(path), **{**TIGHT, **kwargs})


def test_bench_throughput_reports_the_preemptions(path, tmp_path, capsys):
    from pagedllm.bench.throughput import main as bench_main

    out = tmp_path / "bench.json"
    common = ["--model", str(path), "--dtype", "float32", "--max-model-len", "64", "--block-size", "4",
              "--num-gpu-blocks-override", "16", "--num-prompts", "6", "--input-len", "20", "--output-len", "20",
              "--ignore-eos", "--output-json", str(out)]
    assert bench_main([*common, "--swap-space", str(SWAP), "--preemption-mode", "swap"]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["swap_preemptions"] > 0 and result["recompute_preemptions"] == 0
    assert result["swapped_out_blocks"] > 0 and result["recomputed_tokens"] == 0
    assert f"pagedllm preemptions: {result['swap_preemptions']} swap" in capsys.readouterr().out
