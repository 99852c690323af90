"""Sliding-window layers hold only their window's KV blocks (kv_layout.py, KVCacheManager): how layers group, a
long request's windowed blocks bounded by the block manager's counters while it decodes (and its tokens still
transformers'), a prefix hit's tables, and the plan's sequence count equal to what the engine then holds."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import pagedllm
from pagedllm import LLM, SamplingParams
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.request import Request
from pagedllm.kv_layout import NULL_BLOCK, KVCacheLayout, KVGroup
from pagedllm.utils import cdiv
from tests.helpers import hf_greedy, make_tiny_model

CONFIGS = Path(pagedllm.__file__).parent / "model_configs"
WINDOW, BS = 8, 4


def _shape(name: str) -> SimpleNamespace:
    return SimpleNamespace(**json.loads((CONFIGS / f"{name}.json").read_text()))


def test_layers_group_by_window():
    oss = KVCacheLayout.of_config(_shape("gpt-oss-20b"))  # alternating: two groups of 12
    assert [(g.window, g.layers) for g in oss.groups] == [(128, tuple(range(0, 24, 2))), (None, tuple(range(1, 24, 2)))]
    assert oss.num_slots == 12 and oss.slot_of(5) == (1, 2) and oss.reserved_blocks == 1
    dense = KVCacheLayout.of_config(_shape("llama-3.1-8b"))
    assert len(dense.groups) == 1 and dense.num_slots == 32 and dense.reserved_blocks == 0
    uneven = KVCacheLayout.of([8, 8, None, 8, None, 8])  # groups of gcd(4, 2) = 2 layers
    assert [(g.window, g.layers) for g in uneven.groups] == [(8, (0, 1)), (8, (3, 5)), (None, (2, 4))]
    assert KVCacheLayout.of([4096] * 4).groups == (KVGroup((0, 1, 2, 3), 4096),)  # Mistral: every layer windowed
    # A decode's keys span the window's 8 positions: 3 blocks of 4 where they do not start on a block's first.
    assert KVGroup((0,), 8).max_blocks_held(100, 4) == 3 and KVGroup((0,), 8).max_blocks_held(6, 4) == 2
    assert KVGroup((0,), 8).max_blocks_held(100, 4, num_new_tokens=20) == cdiv(8 + 20 - 2, 4) + 1


def test_a_prefix_hit_points_below_the_window_to_the_null_block():
    kv = KVCacheManager(40, BS, layout=KVCacheLayout((KVGroup((0,)), KVGroup((1,), WINDOW))))
    prompt = list(range(30))
    first = Request("a", prompt, SamplingParams(max_tokens=4), eos_token_ids=set(), max_model_len=64)
    assert kv.allocate_slots(first, 30)
    first.num_computed_tokens = 30
    kv.free(first)  # its full blocks stay cached, in both groups
    again = Request("b", prompt + [99], SamplingParams(max_tokens=4), eos_token_ids=set(), max_model_len=64)
    prefix = kv.find_cached_prefix(again)
    assert prefix.num_tokens == 28  # 7 full blocks of the 31 tokens (the last token is computed)
    window_table = prefix.table(1)
    below = (28 - WINDOW + 1) // BS  # blocks 0..4 end before the first query's window (keys 21..28)
    assert window_table[:below] == (NULL_BLOCK,) * below and NULL_BLOCK not in window_table[below:]
    assert kv.allocate_slots(again, 3, prefix)
    kv.check_integrity()
    assert kv.num_blocks_held("b") == 8 + (8 - below)  # the full group's 8 blocks, the window's last 3


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory) -> Path:
    """gpt-oss as its checkpoints have it: windowed and full layers alternating (two KV groups of two layers)."""
    return make_tiny_model(tmp_path_factory.mktemp("windowed") / "gpt_oss", "gpt_oss", num_hidden_layers=4,
                           layer_types=["sliding_attention", "full_attention"] * 2)


def test_a_long_request_keeps_only_its_window_in_the_windowed_layers(windowed_model):
    """60 tokens decoded after a 20-token prompt: the windowed group's table holds at most the 3 blocks a window
    of 8 spans, the pool's used count is that plus the full group's blocks and the null block, and the tokens
    are transformers'."""
    prompt = list(range(5, 25))
    llm = LLM(str(windowed_model), dtype="float32", max_model_len=128, block_size=BS)
    engine, kv = llm.llm_engine, llm.llm_engine.kv_cache
    assert [(g.window, g.layers) for g in kv.groups] == [(WINDOW, (0, 2)), (None, (1, 3))]
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=60,
                                                                         ignore_eos=True))
    outputs, most_held = [], 0
    while engine.has_unfinished_requests():
        outputs += engine.step()
        if "r" not in kv.tables:
            continue
        computed = engine.scheduler.running[0].num_computed_tokens
        window_table, full_table = kv.group_tables("r")
        held = [b for b in window_table if b != NULL_BLOCK]
        assert len(full_table) == len(window_table) == cdiv(computed, BS)
        assert kv.pool.num_used_blocks == 1 + len(held) + len(full_table)  # the null block, both groups
        if computed > len(prompt):  # decoding
            assert len(held) <= 3
            most_held = max(most_held, len(held))
    assert most_held == 3 == engine.memory_plan.sequence_blocks(80) - cdiv(80, BS)
    final = [o for o in outputs if o.finished][0]
    assert final.outputs[0].token_ids == hf_greedy(windowed_model, prompt, 60)[0]
    assert kv.num_free_blocks == kv.pool.num_blocks - 1


def test_the_plan_counts_the_sequences_the_engine_then_holds(windowed_model):
    """A pool of 34 blocks: the plan says 3 sequences of max_model_len 32 (each at most 8 full-group blocks and
    3 window blocks, plus the null block) where a full-attention count says 1.1. Three such requests decode to
    the end side by side without a preemption, their blocks filling the pool exactly; a fourth forces one."""
    def run(n: int):
        llm = LLM(str(windowed_model), dtype="float32", max_model_len=32, block_size=BS, num_gpu_blocks_override=34,
                  enable_prefix_caching=False)
        engine = llm.llm_engine
        for i in range(n):
            engine.add_request(str(i), {"prompt_token_ids": [7 + i] * 8}, SamplingParams(
                temperature=0.0, max_tokens=24, ignore_eos=True))
        most_used = most_running = 0
        while engine.has_unfinished_requests():
            engine.step()
            most_used = max(most_used, engine.kv_cache.pool.num_used_blocks)
            most_running = max(most_running, len(engine.scheduler.running))
        return engine, most_used, most_running

    engine, most_used, most_running = run(3)
    plan = engine.memory_plan
    assert plan.sequence_blocks(32) == 8 + 3 and plan.max_concurrency == 3.0
    assert plan.full_attention_concurrency == pytest.approx(34 * BS * 2 / 4 / 32)  # 2 of 4 layers per block
    assert engine.scheduler.num_preemptions == 0 and most_running == 3 and most_used == 34
    engine, _, _ = run(4)
    assert engine.scheduler.num_preemptions > 0
