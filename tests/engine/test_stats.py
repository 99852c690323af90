"""LLMEngine.stats(): one snapshot of what the engine holds, the only thing /metrics, /v1/memory and the benches
read of it."""
from __future__ import annotations

from pagedllm import LLM, SamplingParams


def test_stats_say_what_the_scheduler_and_the_kv_cache_hold(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64, block_size=4, max_num_seqs=2,
              num_gpu_blocks_override=40)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(10 + i, 23 + i))}, params)
    before = engine.stats()
    assert (before.num_running, before.num_waiting, before.kv_cache.blocks_used) == (0, 3, 0)
    engine.step()
    stats = engine.stats(with_requests=True)
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (2, 1, 0)  # max_num_seqs 2
    assert {r.request_id for r in stats.requests} == {"r0", "r1"}
    assert all(r.blocks == 4 and r.computed_tokens == 13 for r in stats.requests)  # 13 tokens in 4-token blocks
    kv = stats.kv_cache
    assert kv.blocks_total == 40 and kv.blocks_used == 8 and kv.blocks_free == 32 and kv.usage == 8 / 40
    assert stats.memory_plan is engine.memory_plan and stats.preemptions.total == 0
    assert before.num_waiting == 3  # a snapshot: later steps do not change it
    body = stats.memory_json()
    assert body["kv_cache_usage"]["blocks_used"] == 8 and body["num_waiting"] == 1
    assert body["requests"][0] == {"request_id": "r0", "blocks": 4, "computed_tokens": 13}
    assert set(engine.memory_plan.to_json()) < set(body)  # the plan's fields, then the cache's
    while engine.has_unfinished_requests():
        engine.step()
    done = engine.stats(with_requests=True)
    assert (done.num_running, done.kv_cache.blocks_used, done.requests) == (0, 0, ())
