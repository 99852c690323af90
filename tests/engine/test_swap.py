"""Preemption with swap space, without a model: when the scheduler swaps and when it recomputes, the
block copies it asks for, swapped requests coming back before new ones, priorities, and a simulated
device + host KV cache proving every request reads its own K/V after any number of swaps."""
from __future__ import annotations

import random

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.kv_layout import KVCacheLayout, KVGroup
from pagedllm.sampling_params import SamplingParams

BS = 4  # block size of these tests


def make_request(rid: str, prompt_len: int, priority: int = 0, first: int = 100, **params) -> Request:
    params.setdefault("max_tokens", 8)
    prompt = [first + i for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(**params), eos_token_ids=set(), max_model_len=1024, priority=priority)


def make_scheduler(num_blocks: int, num_swap_blocks: int, mode: str | None = None, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, enable_caching: bool = False,
                   layout: KVCacheLayout | None = None) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          preemption_mode=mode)
    kv = KVCacheManager(num_blocks, BS, enable_caching=enable_caching, num_swap_blocks=num_swap_blocks, layout=layout)
    return Scheduler(cfg, kv)


# gpt-oss' shape in small: a full-attention layer and a layer with a 6-token window, one KV group each.
WINDOWED = KVCacheLayout((KVGroup((0,)), KVGroup((1,), window=6)))


class SimulatedCache:
    """Device and host slots holding (KV group, position, token id), written by the step's tokens and moved by
    its block copies exactly as the model runner orders them: swap-outs, swap-ins, then the forward. Every
    group's blocks are slots of the same memory (kv_layout.py); a window group's queries read only the keys
    their window covers."""

    def __init__(self, layout: KVCacheLayout | None = None) -> None:
        self.windows = [g.window for g in layout.groups] if layout is not None else [None]
        self.device: dict[int, tuple[int, int, int]] = {}
        self.host: dict[int, tuple[int, int, int]] = {}

    def copy(self, out: SchedulerOutput) -> None:
        assert not (out.blocks_to_swap_out and out.blocks_to_swap_in), "one kind of copy per step"
        for src, dst in out.blocks_to_swap_out:
            for k in range(BS):
                self.host[dst * BS + k] = self.device.get(src * BS + k)
        for src, dst in out.blocks_to_swap_in:
            for k in range(BS):
                self.device[dst * BS + k] = self.host.get(src * BS + k)

    def run(self, out: SchedulerOutput) -> None:
        self.copy(out)
        for s in out.scheduled:  # all writes first, as the attention layers do
            r = s.request
            for g, table in enumerate(s.block_tables):
                for pos in range(r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens):
                    self.device[table[pos // BS] * BS + pos % BS] = (g, pos, r.all_token_ids[pos])
        for s in out.scheduled:
            r = s.request
            for (g, table), window in zip(enumerate(s.block_tables), self.windows):
                first = 0 if window is None else max(0, r.num_computed_tokens - window + 1)  # the first query's
                for pos in range(first, r.num_computed_tokens + s.num_new_tokens):
                    assert self.device.get(table[pos // BS] * BS + pos % BS) == (g, pos, r.all_token_ids[pos]), (
                        f"{r.request_id} would read a wrong K/V at position {pos} of group {g}")


def step(sched: Scheduler, cache: SimulatedCache | None = None) -> SchedulerOutput:
    """Schedule, check the step's invariants, "run" it, sample 1000 + k, update; both pools stay sound."""
    out = sched.schedule()
    kv = sched.kv_cache
    for r in out.swapped_out:
        assert r.status == RequestStatus.SWAPPED and r in sched.swapped and r.num_computed_tokens > 0
        assert r.request_id in kv.swapped_tables and r.request_id not in kv.block_tables
    for r in out.preempted:
        assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0 and r in sched.waiting
    for r in out.swapped_in:
        assert r.status == RequestStatus.RUNNING and r.request_id not in kv.swapped_tables
    if cache is not None:
        cache.run(out)
    sampled = {s.request.request_id: 1000 + s.request.num_output_tokens for s in out.scheduled if s.samples}
    sched.update(out, sampled)
    kv.check_integrity()
    return out


def run_all(sched: Scheduler, cache: SimulatedCache | None = None, max_steps: int = 2000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched, cache))
        assert len(outs) <= max_steps, "not finished"
    kv = sched.kv_cache
    assert kv.num_free_blocks == kv.pool.num_blocks - (kv.null_block is not None)
    assert kv.host_pool is None or kv.host_pool.num_free_blocks == kv.host_pool.num_blocks
    assert not kv.swapped_tables and not sched.swapped
    return outs


def three_on_four_blocks(sched: Scheduler, prompt_len: int = 4, cache: SimulatedCache | None = None
                         ) -> tuple[Request, Request, Request, Request]:
    """a, b, c fill a 4-block pool (one block each, one spare); d waits (max_num_seqs 3)."""
    a, b, c = (make_request(n, prompt_len) for n in "abc")
    d = make_request("d", 4, max_tokens=1)
    for r in (a, b, c, d):
        sched.add_request(r)
    out = step(sched, cache)
    assert [s.request for s in out.scheduled] == [a, b, c]
    return a, b, c, d


# --------------------------------------------------------------------------------------------
# Swap or recompute
# --------------------------------------------------------------------------------------------
def test_swap_out_when_the_host_pool_has_room_then_swap_in_before_new_requests() -> None:
    sched = make_scheduler(num_blocks=4, num_swap_blocks=8, max_num_seqs=3)
    a, b, c, d = three_on_four_blocks(sched)
    c_block = sched.kv_cache.block_table("c")
    # Each needs a second block: a takes the spare one, b makes c (the newest) give its block back.
    out = step(sched)
    assert out.swapped_out == [c] and out.preempted == []
    assert [s.request for s in out.scheduled] == [a, b]
    host = sched.kv_cache.swapped_tables["c"]
    assert out.blocks_to_swap_out == list(zip(c_block, host)) and len(host) == 1
    assert c.num_computed_tokens == 4 and c.num_tokens == 5  # nothing to recompute
    assert sched.preemption_stats.swap == 1 and sched.num_preemptions == 1 and c.num_preemptions == 1
    assert sched.kv_cache.swap_stats.swapped_out_blocks == 1 and sched.kv_cache.swap_usage == 1 / 8
    e = make_request("e", 4, max_tokens=1)
    sched.add_request(e)

    started, c_back = [], None
    while sched.has_unfinished():
        out = sched.schedule()
        if c in out.swapped_in and c_back is None:
            c_back = (c.num_computed_tokens, [h for h, _ in out.blocks_to_swap_in],
                      next(s.num_new_tokens for s in out.scheduled if s.request is c))
        started += [s.request for s in out.scheduled if s.request in (c, d, e) and s.request not in started]
        sched.update(out, {s.request.request_id: 1000 + s.request.num_output_tokens for s in out.scheduled
                           if s.samples})
        sched.kv_cache.check_integrity()
    assert c_back == (4, host, 1)  # its own host block comes back and it resumes: no recompute
    assert started == [c, d, e]  # the swapped request comes back first, then the waiting ones in order
    assert c.output_token_ids == [1000 + k for k in range(8)]
    stats = sched.kv_cache.swap_stats
    assert stats.swapped_in_blocks == stats.swapped_out_blocks >= 1  # every block out came back


def test_recompute_when_the_host_pool_is_full() -> None:
    sched = make_scheduler(num_blocks=4, num_swap_blocks=1, max_num_seqs=3)
    _a, _b, c, d = three_on_four_blocks(sched)
    sched.kv_cache.host_pool.allocate(1)  # someone else's swapped blocks: no room left
    out = sched.schedule()
    assert out.preempted == [c] and out.swapped_out == [] and not out.blocks_to_swap_out
    assert c.num_computed_tokens == 0 and list(sched.waiting) == [c, d]
    assert sched.preemption_stats.recompute == 1 and sched.preemption_stats.recomputed_tokens == 4


def test_a_request_larger_than_the_host_pool_is_recomputed() -> None:
    sched = make_scheduler(num_blocks=6, num_swap_blocks=1, max_num_seqs=3)
    _a, _b, c, _d = three_on_four_blocks(sched, prompt_len=8)  # two blocks each
    out = step(sched)
    assert out.preempted == [c] and not out.swapped_out


@pytest.mark.parametrize("mode, swapped", [(None, False), ("swap", True)])
def test_a_prefix_shorter_than_a_block_is_recomputed_unless_swap_is_forced(mode, swapped) -> None:
    sched = make_scheduler(num_blocks=3, num_swap_blocks=8, mode=mode)
    a, b = make_request("a", BS), make_request("b", BS)
    c = make_request("c", 2)  # 2 computed tokens: less than a block
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    out = step(sched)  # a needs a second block: c (the newest) gives its one back, then b preempts itself
    assert (c in out.swapped_out) == swapped and (c in out.preempted) == (not swapped)
    assert b in out.swapped_out  # a full block: swapped in both modes
    run_all(sched)


def test_a_request_with_a_full_block_swaps_in_automatic_mode() -> None:
    sched = make_scheduler(num_blocks=4, num_swap_blocks=8, max_num_seqs=3)
    _a, _b, c, _d = three_on_four_blocks(sched, prompt_len=BS)
    assert step(sched).swapped_out == [c]


def test_recompute_mode_never_swaps() -> None:
    sched = make_scheduler(num_blocks=4, num_swap_blocks=8, mode="recompute", max_num_seqs=3)
    _a, _b, c, _d = three_on_four_blocks(sched)
    out = step(sched)
    assert out.preempted == [c] and not out.swapped_out
    run_all(sched)
    assert sched.preemption_stats.swap == 0 and sched.kv_cache.swap_stats.swapped_out_blocks == 0


def test_without_swap_space_preemption_recomputes() -> None:
    sched = make_scheduler(num_blocks=4, num_swap_blocks=0, max_num_seqs=3)
    _a, _b, c, _d = three_on_four_blocks(sched)
    assert step(sched).preempted == [c]
    assert sched.kv_cache.host_pool is None and sched.kv_cache.swap_usage == 0.0


# --------------------------------------------------------------------------------------------
# Who is preempted
# --------------------------------------------------------------------------------------------
def test_the_largest_priority_value_is_preempted_first_then_the_newest() -> None:
    sched = make_scheduler(num_blocks=4, num_swap_blocks=8, max_num_seqs=3)
    a = make_request("a", 4, priority=0)
    b = make_request("b", 4, priority=5)  # older than c but less important
    c = make_request("c", 4, priority=0)
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    out = step(sched)
    assert out.swapped_out == [b] and [s.request for s in out.scheduled] == [a, c]


def test_swapped_requests_come_back_in_priority_order() -> None:
    sched = make_scheduler(num_blocks=3, num_swap_blocks=8, max_num_seqs=3)
    a = make_request("a", 4, max_tokens=6)
    b = make_request("b", 4, priority=2, max_tokens=2)
    c = make_request("c", 4, priority=1, max_tokens=2)
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    out = step(sched)  # a needs a second block: b (priority 2) goes first, then c
    assert out.swapped_out == [b, c] and sched.swapped == [c, b]
    back = [r for o in run_all(sched) for r in o.swapped_in]
    assert back[:2] == [c, b]


# --------------------------------------------------------------------------------------------
# Blocks: shared, cached, aborted
# --------------------------------------------------------------------------------------------
def test_swapping_out_a_shared_block_leaves_it_to_its_other_owner() -> None:
    sched = make_scheduler(num_blocks=5, num_swap_blocks=8, max_num_seqs=3, enable_caching=True)
    a = make_request("a", 9, max_tokens=8)  # 3 blocks, two of them full and cached
    b = make_request("b", 9, max_tokens=8)  # the same prompt: shares a's two full blocks
    for r in (a, b):
        sched.add_request(r)
    cache = SimulatedCache()
    step(sched, cache)
    kv = sched.kv_cache
    shared = kv.block_table("a")[:2]
    assert kv.block_table("b")[:2] == shared and [kv.pool.ref_counts[x] for x in shared] == [2, 2]
    for _ in range(4):  # 12 tokens fill the third blocks; the 13th needs a fourth (a takes the last one)
        out = step(sched, cache)
        if out.swapped_out:
            break
    assert out.swapped_out == [b]
    assert [src for src, _ in out.blocks_to_swap_out][:2] == shared  # copied out like any other block
    assert [kv.pool.ref_counts[x] for x in shared] == [1, 1] and kv.block_table("a")[:2] == shared
    run_all(sched, cache)
    assert a.output_token_ids == b.output_token_ids == [1000 + k for k in range(8)]


@pytest.mark.parametrize("evicted", [False, True])
def test_swap_in_reuses_blocks_still_in_the_prefix_cache(evicted: bool) -> None:
    kv = KVCacheManager(8, BS, enable_caching=True, num_swap_blocks=8)
    r = make_request("r", 9)
    assert kv.allocate_slots(r, 9)
    r.num_computed_tokens = 9
    r.append_token(7)
    table = list(kv.block_table("r"))  # two full (cached) blocks and one partial
    out = kv.swap_out(r)
    host = kv.swapped_tables["r"]
    assert out == list(zip(table, host)) and kv.num_free_blocks == 8
    if evicted:  # another request takes every block: r's cached prefix is gone
        other = make_request("o", 32, first=500)
        assert kv.allocate_slots(other, 32)
        kv.free(other)
    copies = kv.swap_in(r, 1)
    kv.check_integrity()
    if evicted:
        assert [h for h, _ in copies] == host  # everything comes back from the host
    else:
        assert kv.block_table("r")[:2] == table[:2]  # found again in the prefix cache, not copied
        assert copies == [(host[2], kv.block_table("r")[2])]
    assert kv.swap_stats.swapped_in_blocks == len(copies)
    assert kv.num_swapped_blocks == 0 and "r" not in kv.swapped_tables


def test_swap_in_without_room_changes_nothing() -> None:
    kv = KVCacheManager(3, BS, num_swap_blocks=8)
    r = make_request("r", 8)
    assert kv.allocate_slots(r, 8)
    r.num_computed_tokens = 8
    r.append_token(7)
    kv.swap_out(r)
    other = make_request("o", 8, first=500)
    assert kv.allocate_slots(other, 8)  # 2 of 3 blocks: r needs 2 + 1 for its next token
    assert kv.swap_in(r, 1) is None
    assert kv.num_swapped_blocks == 2 and kv.num_free_blocks == 1
    kv.check_integrity()


def test_aborting_a_swapped_request_frees_its_host_blocks() -> None:
    sched = make_scheduler(num_blocks=4, num_swap_blocks=8, max_num_seqs=3)
    _a, _b, c, _d = three_on_four_blocks(sched)
    assert step(sched).swapped_out == [c]
    assert sched.kv_cache.num_swapped_blocks == 1
    sched.finish_request(c, RequestStatus.FINISHED_ABORTED)
    assert c.is_finished and c not in sched.swapped and "c" not in sched.kv_cache.swapped_tables
    assert sched.kv_cache.num_swapped_blocks == 0
    sched.kv_cache.check_integrity()
    run_all(sched)


def test_host_pool_integrity_catches_a_leak() -> None:
    kv = KVCacheManager(4, BS, num_swap_blocks=4)
    kv.host_pool.allocate(1)  # used, but no swapped request holds it
    with pytest.raises(AssertionError, match="host blocks"):
        kv.check_integrity()


def test_swap_out_without_room_is_refused() -> None:
    kv = KVCacheManager(4, BS, num_swap_blocks=1)
    r = make_request("r", 8)
    assert kv.allocate_slots(r, 8)
    assert not kv.can_swap_out(r)
    with pytest.raises(RuntimeError, match="host pool"):
        kv.swap_out(r)


# --------------------------------------------------------------------------------------------
# A random workload
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", [None, WINDOWED], ids=["full", "windowed"])
@pytest.mark.parametrize("enable_caching", [False, True])
@pytest.mark.parametrize("mode, num_swap_blocks", [("swap", 40), (None, 40), (None, 6), ("swap", 5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_workload_every_request_reads_its_own_kv(seed, mode, num_swap_blocks, enable_caching, layout) -> None:
    """Many preemptions of both kinds in a tight pool, shared prompt prefixes, arrivals between steps:
    after every step both pools are sound and every request attended only to its own tokens (with a window
    group: to the ones its window covers, its other blocks given back)."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=20 if layout is None else 30, num_swap_blocks=num_swap_blocks, mode=mode,
                           max_num_seqs=6, max_num_batched_tokens=rng.choice([8, 20, 40]),
                           enable_caching=enable_caching, layout=layout)
    cache = SimulatedCache(layout)
    reqs = []
    for i in range(30):
        r = make_request(f"r{i}", rng.randint(1, 40), priority=rng.choice([0, 0, 1]), first=rng.choice([100, 200]),
                         max_tokens=rng.randint(1, 30))
        reqs.append(r)
        sched.add_request(r)
        for _ in range(rng.randint(0, 3)):
            step(sched, cache)
    run_all(sched, cache, max_steps=5000)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [1000 + k for k in range(r.max_output_tokens)]
    stats = sched.preemption_stats
    assert stats.total == sum(r.num_preemptions for r in reqs)
    assert stats.swap > 0 and sched.kv_cache.swap_stats.swapped_out_blocks > 0
    if num_swap_blocks < 10:
        assert stats.recompute > 0  # the host pool filled up: some fell back to recompute
