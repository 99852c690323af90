"""Prefix caching without a model: the hash chain, hits and misses, LRU eviction of cached free
blocks, shared ref counts, and a simulated KV cache proving every hit reads the right tokens."""
from __future__ import annotations

import random

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.engine.block_pool import BlockPool
from pagedllm.engine.kv_cache_manager import (
    CachedPrefix,
    KVCacheManager,
    hash_block_tokens,
)
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

BS = 4  # block size of these tests


def make_request(rid: str, prompt: list[int], cache_salt: str | None = None, **params) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(rid, prompt, SamplingParams(**params), eos_token_ids=set(), max_model_len=1024,
                   cache_salt=cache_salt)


def admit(kv: KVCacheManager, req: Request) -> CachedPrefix:
    """What the scheduler does for a waiting request: look up, allocate the rest, skip the hit."""
    prefix = kv.find_cached_prefix(req)
    assert kv.allocate_slots(req, req.num_tokens - prefix.num_tokens, prefix)
    req.num_computed_tokens = req.num_tokens
    kv.check_integrity()
    return prefix


# --------------------------------------------------------------------------------------------
# The hash chain
# --------------------------------------------------------------------------------------------
def test_hash_is_deterministic_sha256() -> None:
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert h == hash_block_tokens(None, (1, 2, 3, 4))
    assert isinstance(h, bytes) and len(h) == 32
    assert h != hash_block_tokens(None, [1, 2, 3, 5])
    assert h != hash_block_tokens(h, [1, 2, 3, 4])  # the parent is part of the name
    assert h != hash_block_tokens(None, [1, 2, 3, 4], ("cache_salt", "x"))


def test_same_prefix_same_hashes_and_the_chain_names_the_whole_prefix() -> None:
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(10)))  # 2 full blocks
    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])  # same 2 blocks, another tail
    c = make_request("c", [9, 9, 9, 9] + list(range(4, 8)))  # 2nd block's tokens equal a's, 1st differs
    ha, hb, hc = kv.block_hashes(a), kv.block_hashes(b), kv.block_hashes(c)
    assert len(ha) == 2 and len(hb) == 3 and len(hc) == 2
    assert ha == hb[:2]
    assert hc[0] != ha[0] and hc[1] != ha[1]  # same tokens after a different prefix: another block


def test_block_hashes_grow_with_the_tokens() -> None:
    kv = KVCacheManager(16, BS)
    r = make_request("r", [1, 2, 3])
    assert kv.block_hashes(r) == []
    r.append_token(4)
    first = kv.block_hashes(r)[:]
    assert len(first) == 1
    for t in (5, 6, 7, 8):
        r.append_token(t)
    assert kv.block_hashes(r)[:1] == first and len(r.block_hashes) == 2


def test_cache_salt_separates_every_block() -> None:
    kv = KVCacheManager(16, BS)
    prompt = list(range(13))
    plain, salted, salted2 = (make_request(n, prompt, s) for n, s in (("p", None), ("s", "a"), ("t", "b")))
    hp, hs, ht = kv.block_hashes(plain), kv.block_hashes(salted), kv.block_hashes(salted2)
    assert not set(hp) & set(hs) and not set(hs) & set(ht)  # the salt of block 0 changes the chain

    admit(kv, salted)
    assert kv.find_cached_prefix(make_request("p2", prompt)).num_tokens == 0
    assert kv.find_cached_prefix(make_request("t2", prompt, "b")).num_tokens == 0
    assert kv.find_cached_prefix(make_request("s2", prompt, "a")).num_tokens == 12


# --------------------------------------------------------------------------------------------
# Hits, misses, ref counts
# --------------------------------------------------------------------------------------------
def test_miss_then_hit_counts_tokens() -> None:
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(10)))
    assert admit(kv, a) == CachedPrefix((), 0, 10)
    table_a = list(kv.block_table("a"))
    assert kv.pool.num_cached_blocks == 2  # the partial third block is not cached

    b = make_request("b", list(range(8)) + [60, 61, 62])
    prefix = admit(kv, b)
    assert prefix.block_ids == tuple(table_a[:2]) and prefix.num_tokens == 8
    table_b = kv.block_table("b")
    assert table_b[:2] == table_a[:2] and table_b[2] not in table_a
    assert [kv.pool.ref_counts[x] for x in table_a] == [2, 2, 1]
    assert kv.prefix_cache_stats.queries == 10 + 11
    assert kv.prefix_cache_stats.hits == 8


def test_fully_cached_prompt_leaves_its_last_token_to_compute() -> None:
    kv = KVCacheManager(16, BS)
    admit(kv, make_request("a", list(range(8))))  # exactly 2 full blocks
    again = make_request("b", list(range(8)))
    prefix = kv.find_cached_prefix(again)
    assert prefix.num_tokens == 4  # capped at 7 tokens, rounded down to a block
    longer = make_request("c", list(range(9)))
    assert kv.find_cached_prefix(longer).num_tokens == 8


def test_shared_blocks_are_freed_by_their_last_owner_and_stay_cached() -> None:
    kv = KVCacheManager(8, BS)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    admit(kv, a)
    admit(kv, b)
    shared = kv.block_table("a")[:2]
    assert kv.block_table("b")[:2] == shared
    assert kv.pool.num_used_blocks == 4  # 2 shared + one partial block each
    kv.free(a)
    kv.check_integrity()
    assert [kv.pool.ref_counts[x] for x in shared] == [1, 1]
    kv.free(b)
    kv.check_integrity()
    assert kv.num_free_blocks == 8 and kv.pool.num_cached_blocks == 2
    # Freed but still findable: a third request revives them out of the free queue.
    c = make_request("c", list(range(9)))
    assert admit(kv, c).block_ids == tuple(shared)
    assert kv.num_free_blocks == 8 - 3
    kv.free(c)
    kv.check_integrity()


def test_lru_eviction_of_cached_free_blocks_tail_first() -> None:
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(10)))  # blocks 0, 1 (cached) and 2 (partial)
    admit(kv, a)
    kv.free(a)  # free queue: 3, then a's blocks tail first: 2, 1, 0
    filler = make_request("f", list(range(500, 512)))
    assert kv.allocate_slots(filler, 5)
    assert kv.block_table("f") == [3, 2]  # the never-used block, then a's uncached partial block
    assert kv.find_cached_prefix(make_request("b", list(range(10)))).num_tokens == 8
    filler.num_computed_tokens = 5
    assert kv.allocate_slots(filler, 4)
    assert kv.block_table("f")[2] == 1  # a's second block is handed out: its hash is evicted
    assert kv.pool.block_hashes[1] != a.block_hashes[1]
    kv.check_integrity()
    # The chain is broken after block 0: a repeat of a hits one block only.
    assert kv.find_cached_prefix(make_request("c", list(range(10)))).num_tokens == 4


def test_hit_free_block_is_not_handed_out_again() -> None:
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(9)))
    prefix = admit(kv, b)
    assert len(prefix.block_ids) == 2
    # The two revived blocks are owned again: the pool hands out only the other two.
    rest = kv.pool.allocate(kv.num_free_blocks)
    assert not set(rest) & set(kv.block_table("b"))
    with pytest.raises(RuntimeError):
        kv.pool.allocate(1)


def test_failed_allocation_with_a_prefix_changes_nothing() -> None:
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(8)) + [70])
    admit(kv, a)  # 3 blocks, 2 cached
    kv.free(a)
    assert kv.allocate_slots(make_request("f", [500]), 1)  # a's 3 blocks are left free, 2 of them cached
    before = (list(kv.pool._free), list(kv.pool.ref_counts), dict(kv.pool._cached), kv.prefix_cache_stats)
    b = make_request("b", list(range(8)) + list(range(80, 90)))  # prefix 8 + 10 tokens: 3 more blocks
    prefix = kv.find_cached_prefix(b)
    assert prefix.num_tokens == 8
    assert not kv.allocate_slots(b, 10, prefix)  # the hit blocks leave the free queue: 1 left < 3
    assert "b" not in kv.block_tables
    assert (list(kv.pool._free), list(kv.pool.ref_counts), dict(kv.pool._cached)) == before[:3]
    assert kv.prefix_cache_stats.queries == 9  # a failed admission is not a lookup yet
    kv.check_integrity()


def test_prefix_only_starts_a_table() -> None:
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    prefix = kv.find_cached_prefix(make_request("b", list(range(9))))
    with pytest.raises(RuntimeError, match="already holds blocks"):
        kv.allocate_slots(a, 1, prefix)
    with pytest.raises(RuntimeError, match="already holds blocks"):
        kv.find_cached_prefix(a)
    stale = kv.find_cached_prefix(make_request("c", list(range(9))))
    kv.free(a)
    kv.pool.allocate(kv.num_free_blocks)  # evicts every cached block
    with pytest.raises(RuntimeError, match="stale"):
        kv.allocate_slots(make_request("c", list(range(9))), 1, stale)


def test_same_tokens_computed_twice_keep_one_cached_block() -> None:
    """Two requests that computed the same prefix side by side: the second block stays uncached."""
    kv = KVCacheManager(8, BS)
    a, b = make_request("a", list(range(5))), make_request("b", list(range(5)))
    assert kv.allocate_slots(a, 5) and kv.allocate_slots(b, 5)  # no lookup: both compute block 0
    assert kv.pool.block_hashes[kv.block_table("a")[0]] is not None
    assert kv.pool.block_hashes[kv.block_table("b")[0]] is None
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    assert kv.pool.num_cached_blocks == 1


def test_prompt_logprobs_skip_the_cache_and_disabled_caching_caches_nothing() -> None:
    kv = KVCacheManager(8, BS)
    admit(kv, make_request("a", list(range(9))))
    wants = make_request("b", list(range(9)), prompt_logprobs=1)
    assert kv.find_cached_prefix(wants) == CachedPrefix()

    off = KVCacheManager(8, BS, enable_caching=False)
    admit(off, make_request("a", list(range(9))))
    assert off.pool.num_cached_blocks == 0
    assert off.find_cached_prefix(make_request("b", list(range(9)))) == CachedPrefix()
    assert off.prefix_cache_stats.queries == off.prefix_cache_stats.hits == 0


# --------------------------------------------------------------------------------------------
# Integrity checks catch broken caches
# --------------------------------------------------------------------------------------------
def test_integrity_catches_cached_block_at_the_wrong_position() -> None:
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    table = kv.block_tables["a"]
    table[0], table[1] = table[1], table[0]  # the table now reads block 1's prefix first
    with pytest.raises(AssertionError, match="caches another prefix"):
        kv.check_integrity()


def test_integrity_catches_shared_uncached_block() -> None:
    kv = KVCacheManager(8, BS)
    a, b = make_request("a", [1, 2]), make_request("b", [3, 4])
    assert kv.allocate_slots(a, 2) and kv.allocate_slots(b, 2)
    kv.pool.share(kv.block_table("a"))
    kv.block_tables["b"].append(kv.block_table("a")[0])  # b reads a's K/V without a cache hit
    with pytest.raises(AssertionError, match="not cached"):
        kv.check_integrity()


def test_integrity_catches_ref_count_moved_between_blocks() -> None:
    kv = KVCacheManager(8, BS)
    assert kv.allocate_slots(make_request("a", [1, 2, 3, 4, 5]), 5)
    x, y = kv.block_table("a")
    kv.pool.ref_counts[x] += 1
    kv.pool.ref_counts[y] -= 1  # the total still matches, the blocks don't
    kv.pool._free[y] = None
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_pool_touch_and_cache_block_refuse_misuse() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    with pytest.raises(RuntimeError, match="not cached"):
        pool.touch([a])
    with pytest.raises(RuntimeError, match="free"):
        pool.cache_block(2, b"h")
    assert pool.cache_block(a, b"h")
    with pytest.raises(RuntimeError, match="another hash"):
        pool.cache_block(a, b"g")
    pool.check_integrity()


# --------------------------------------------------------------------------------------------
# Through the scheduler, with a simulated KV cache: each slot holds the token whose K/V it stores
# --------------------------------------------------------------------------------------------
def make_scheduler(num_blocks: int, max_num_batched_tokens: int = 64, max_num_seqs: int = 8) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS))


def simulated_step(sched: Scheduler, slots: dict[int, tuple[int, int]], token_of=lambda r: 1000 + r.num_output_tokens):
    """Schedule, "run" (write every new token's (position, id) to its slot, then check that each
    request sees its own tokens at every position it attends to), update. Returns the schedule."""
    out = sched.schedule()
    assert all(s.num_new_tokens >= 1 for s in out.scheduled)  # a sampled token needs a computed one
    for s in out.scheduled:  # all writes first, as the attention layers do
        r, table = s.request, s.block_tables[0]
        for pos in range(r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens):
            slots[table[pos // BS] * BS + pos % BS] = (pos, r.all_token_ids[pos])
    for s in out.scheduled:
        r, table = s.request, s.block_tables[0]
        for pos in range(r.num_computed_tokens + s.num_new_tokens):
            assert slots.get(table[pos // BS] * BS + pos % BS) == (pos, r.all_token_ids[pos]), (
                f"{r.request_id} would read a wrong K/V at position {pos}")
    sampled = {s.request.request_id: token_of(s.request) for s in out.scheduled if s.samples}
    sched.update(out, sampled)
    sched.kv_cache.check_integrity()
    return out


def test_scheduler_computes_only_the_uncached_tail() -> None:
    sched, slots = make_scheduler(32), {}
    a = make_request("a", list(range(10)), max_tokens=1)
    sched.add_request(a)
    simulated_step(sched, slots)
    assert a.is_finished
    b = make_request("b", list(range(8)) + [40, 41, 42], max_tokens=2)
    sched.add_request(b)
    out = simulated_step(sched, slots)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 3)]
    assert b.num_computed_tokens == 11 and b.num_output_tokens == 1


def test_n_samples_in_one_step_share_the_prompt_blocks() -> None:
    sched, slots = make_scheduler(32), {}
    prompt = list(range(13))
    samples = [make_request(f"{j}_r", prompt, max_tokens=3) for j in range(3)]
    for r in samples:
        sched.add_request(r)
    out = simulated_step(sched, slots)
    assert [s.num_new_tokens for s in out.scheduled] == [13, 1, 1]  # the others compute the last token
    shared = sched.kv_cache.block_table("0_r")[:3]
    for r in samples[1:]:
        assert sched.kv_cache.block_table(r.request_id)[:3] == shared
    assert [sched.kv_cache.pool.ref_counts[b] for b in shared] == [3, 3, 3]
    assert sched.kv_cache.prefix_cache_stats.hits == 2 * 12
    while sched.has_unfinished():
        simulated_step(sched, slots)
    assert sched.kv_cache.num_free_blocks == 32


def test_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    sched, slots = make_scheduler(6, max_num_batched_tokens=64), {}
    a = make_request("a", list(range(8)), max_tokens=12)  # grows to 20 tokens: 5 blocks
    b = make_request("b", list(range(100, 108)), max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    resumed = None
    while sched.has_unfinished():
        out = simulated_step(sched, slots)
        for s in out.scheduled:
            if s.request is b and b.num_preemptions and resumed is None:
                resumed = s.num_new_tokens, b.num_computed_tokens - s.num_new_tokens
    assert b.num_preemptions >= 1 and resumed is not None
    new_tokens, hit_tokens = resumed
    assert hit_tokens > 0 and new_tokens < b.num_tokens  # it found (part of) its own K/V again instead of recomputing all of it
    assert a.output_token_ids == b.output_token_ids == [1000 + k for k in range(12)]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_shared_prefix_workload_reads_only_right_kv(seed: int) -> None:
    """Requests from a few prompt families (shared prefixes, salts, n > 1, repeats) in a tight
    pool with preemption: every step every request attends to its own tokens, nothing leaks."""
    rng = random.Random(seed)
    sched, slots = make_scheduler(24, max_num_batched_tokens=rng.choice([8, 16, 40])), {}
    families = [[rng.randrange(500) for _ in range(rng.randint(4, 30))] for _ in range(3)]
    families.append([1, 2, 3, 4] * 7)  # equal blocks at different positions: only the chain tells them apart
    reqs = []
    for i in range(40):
        base = rng.choice(families)
        prompt = base[:rng.randint(1, len(base))] + [rng.randrange(500) for _ in range(rng.randint(0, 6))]
        r = make_request(f"r{i}", prompt, rng.choice([None, None, "s"]), max_tokens=rng.randint(1, 12))
        reqs.append(r)
        sched.add_request(r)
        for _ in range(rng.randint(0, 2)):
            simulated_step(sched, slots)
    steps = 0
    while sched.has_unfinished():
        simulated_step(sched, slots)
        steps += 1
        assert steps < 5000
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(r.output_token_ids == [1000 + k for k in range(r.max_output_tokens)] for r in reqs)
    stats = sched.kv_cache.prefix_cache_stats
    assert stats.hits > 0 and stats.queries >= sum(r.num_prompt_tokens for r in reqs)
    assert sched.kv_cache.num_free_blocks == 24
    sched.kv_cache.check_integrity()
