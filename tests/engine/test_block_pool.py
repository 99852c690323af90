"""BlockPool and KVCacheManager: block ids, reference counts, reuse order and integrity checks."""
from __future__ import annotations

import random

import pytest

from pagedllm.engine.block_pool import BlockPool
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv


def make_request(rid: str, num_prompt_tokens: int = 4) -> Request:
    return Request(rid, list(range(num_prompt_tokens)), SamplingParams(), eos_token_ids=set(), max_model_len=4096)


# --------------------------------------------------------------------------------------------
# BlockPool
# --------------------------------------------------------------------------------------------
def test_new_pool_is_all_free() -> None:
    pool = BlockPool(8)
    assert pool.num_free_blocks == 8
    assert pool.num_used_blocks == 0
    assert pool.usage == 0.0
    assert pool.ref_counts == [0] * 8
    pool.check_integrity()


@pytest.mark.parametrize("n", [0, -1])
def test_pool_needs_at_least_one_block(n: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(n)


def test_allocate_hands_out_distinct_blocks_with_ref_count_one() -> None:
    pool = BlockPool(10)
    a = pool.allocate(3)
    b = pool.allocate(4)
    assert a == [0, 1, 2]  # a fresh pool hands out ids in order
    assert b == [3, 4, 5, 6]
    assert not set(a) & set(b)
    for blk in a + b:
        assert pool.ref_counts[blk] == 1
    for blk in (7, 8, 9):
        assert pool.ref_counts[blk] == 0
    assert pool.num_free_blocks == 3
    assert pool.num_used_blocks == 7
    assert pool.usage == pytest.approx(0.7)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 3
    pool.check_integrity()


def test_allocate_everything_then_nothing_left() -> None:
    pool = BlockPool(5)
    assert sorted(pool.allocate(5)) == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.check_integrity()


def test_over_allocation_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    before_counts = list(pool.ref_counts)
    with pytest.raises(RuntimeError, match="3"):
        pool.allocate(3)
    assert pool.ref_counts == before_counts
    assert pool.num_free_blocks == 2
    # The two free blocks are still handed out, in order.
    assert pool.allocate(2) == [2, 3]
    pool.check_integrity()


def test_free_returns_blocks_and_resets_ref_counts() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(4)
    pool.free(blocks)
    assert pool.num_free_blocks == 6
    assert pool.ref_counts == [0] * 6
    pool.check_integrity()


def test_freed_blocks_go_to_the_back_lru() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)  # [0, 1]
    pool.allocate(2)  # [2, 3]
    pool.free(a)  # free queue: 4, 5, 0, 1
    # Never-used blocks 4, 5 come before the just-freed 0, 1.
    assert pool.allocate(2) == [4, 5]
    assert pool.allocate(2) == [0, 1]
    assert pool.num_free_blocks == 0
    pool.check_integrity()


def test_free_order_decides_reuse_order() -> None:
    pool = BlockPool(4)
    pool.allocate(4)  # [0, 1, 2, 3]
    pool.free([2])
    pool.free([0])
    pool.free([3, 1])
    assert pool.allocate(4) == [2, 0, 3, 1]


def test_request_blocks_freed_tail_first_through_manager() -> None:
    """KVCacheManager.free passes the table tail first, so a request's last block is reused first."""
    kv = KVCacheManager(num_blocks=6, block_size=4)
    req = make_request("r")
    req.num_computed_tokens = 0
    assert kv.allocate_slots(req, 16)  # 4 blocks
    table = list(kv.block_table("r"))
    assert table == [0, 1, 2, 3]
    kv.free(req)
    # The free queue is now 4, 5 then the table reversed.
    assert kv.pool.allocate(6) == [4, 5] + table[::-1]


def test_share_increments_and_free_needs_every_owner() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.share(blocks)
    pool.share(blocks[:1])
    assert pool.ref_counts[blocks[0]] == 3
    assert pool.ref_counts[blocks[1]] == 2
    assert pool.num_used_blocks == 2  # sharing takes no new blocks
    pool.check_integrity()

    pool.free(blocks)
    assert pool.ref_counts[blocks[0]] == 2
    assert pool.ref_counts[blocks[1]] == 1
    assert pool.num_free_blocks == 2  # still owned
    pool.free(blocks)
    assert pool.ref_counts[blocks[0]] == 1
    assert pool.ref_counts[blocks[1]] == 0
    assert pool.num_free_blocks == 3  # block 1 returned
    pool.free(blocks[:1])
    assert pool.num_free_blocks == 4
    assert pool.ref_counts == [0] * 4
    pool.check_integrity()


def test_share_free_block_raises() -> None:
    pool = BlockPool(4)
    pool.allocate(1)  # block 0
    with pytest.raises(RuntimeError, match="block 2"):
        pool.share([2])
    assert pool.ref_counts == [1, 0, 0, 0]
    pool.check_integrity()


def test_double_free_raises() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(blocks[:1])
    # The failed free did not put the block in the queue a second time.
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_free_never_allocated_block_raises() -> None:
    pool = BlockPool(3)
    with pytest.raises(RuntimeError):
        pool.free([1])
    assert pool.num_free_blocks == 3
    pool.check_integrity()


def test_check_integrity_catches_leak() -> None:
    """A block removed from the free queue without an owner: free + used != total."""
    pool = BlockPool(4)
    pool.allocate(1)
    pool._free.popitem()  # simulate a leak: block disappears from both free queue and owners
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_integrity()


def test_check_integrity_catches_owned_block_in_free_queue() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool._free[blocks[0]] = None  # both owned and free
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_catches_ref_count_poked_on_free_block() -> None:
    pool = BlockPool(4)
    pool.ref_counts[3] = 1  # a free block that also claims an owner
    with pytest.raises(AssertionError, match="both free and in use"):
        pool.check_integrity()


def test_check_integrity_catches_lost_ref_count() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.ref_counts[blocks[1]] = 0  # an allocated block that nobody owns and is not free
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_integrity()


def test_check_integrity_catches_hash_map_pointing_at_another_block() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"h")
    pool._cached[b"h"] = b  # the map names a block that does not carry the hash
    with pytest.raises(AssertionError, match="hash map points to block"):
        pool.check_integrity()


def test_check_integrity_catches_hash_the_map_does_not_know() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.block_hashes[a] = b"h"  # cached in the block, unknown to the map: never found, never evicted
    with pytest.raises(AssertionError, match="carry a hash"):
        pool.check_integrity()


def test_check_integrity_catches_negative_ref_count() -> None:
    pool = BlockPool(4)
    pool.ref_counts[0] = -1
    with pytest.raises(AssertionError):
        pool.check_integrity()


# --------------------------------------------------------------------------------------------
# KVCacheManager
# --------------------------------------------------------------------------------------------
def test_cdiv() -> None:
    assert [cdiv(a, 4) for a in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_allocate_slots_grows_table_by_exact_amount(block_size: int) -> None:
    kv = KVCacheManager(num_blocks=200, block_size=block_size)
    req = make_request("r")
    rng = random.Random(block_size)
    expected_len = 0
    for _ in range(60):
        new = rng.randint(0, 2 * block_size + 1)
        old_table = list(kv.block_tables.get("r", []))
        before = len(old_table)
        free_before = kv.num_free_blocks
        assert kv.allocate_slots(req, new)
        want = max(before, -(-(req.num_computed_tokens + new) // block_size))
        table = kv.block_table("r")
        assert len(table) == want
        assert free_before - kv.num_free_blocks == want - before
        assert len(set(table)) == len(table)
        assert table[:before] == old_table  # growing never rewrites existing entries
        expected_len = want
        req.num_computed_tokens += new
        kv.check_integrity()
    assert len(kv.block_table("r")) == expected_len == -(-req.num_computed_tokens // block_size)


def test_allocate_slots_example() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("r")
    assert kv.allocate_slots(req, 5)  # 5 tokens -> 2 blocks
    assert kv.block_table("r") == [0, 1]
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 3)  # 8 tokens -> still 2 blocks
    assert kv.block_table("r") == [0, 1]
    assert kv.num_free_blocks == 8
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 1)  # 9 tokens -> 3 blocks
    assert kv.block_table("r") == [0, 1, 2]
    assert kv.num_free_blocks == 7
    kv.check_integrity()


def test_allocate_slots_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, b = make_request("a"), make_request("b")
    assert kv.allocate_slots(a, 12)  # 3 blocks
    a.num_computed_tokens = 12
    before_tables = {k: list(v) for k, v in kv.block_tables.items()}
    before_counts = list(kv.pool.ref_counts)
    # a needs 2 more blocks, only 1 free.
    assert not kv.allocate_slots(a, 5)
    # b is new and needs 2 blocks: fails and leaves no empty table behind.
    assert not kv.allocate_slots(b, 8)
    assert kv.block_tables == before_tables
    assert "b" not in kv.block_tables
    assert kv.pool.ref_counts == before_counts
    assert kv.num_free_blocks == 1
    kv.check_integrity()
    # Exactly what is left still fits.
    assert kv.allocate_slots(b, 4)
    assert kv.num_free_blocks == 0
    kv.check_integrity()


def test_free_returns_all_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=2)
    reqs = [make_request(f"r{i}") for i in range(4)]
    for i, r in enumerate(reqs):
        assert kv.allocate_slots(r, 2 * i + 3)
    used = kv.pool.num_used_blocks
    assert used == sum(cdiv(2 * i + 3, 2) for i in range(4))
    kv.free(reqs[1])
    assert "r1" not in kv.block_tables
    assert kv.pool.num_used_blocks == used - cdiv(5, 2)
    for r in reqs:
        kv.free(r)
    assert kv.num_free_blocks == 16
    assert kv.block_tables == {}
    kv.free(reqs[0])  # freeing a request without blocks is a no-op
    assert kv.num_free_blocks == 16
    kv.check_integrity()


def test_check_integrity_catches_table_pool_mismatch() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("r")
    assert kv.allocate_slots(req, 8)
    kv.block_tables["r"].pop()  # the table forgets a block the pool still counts
    with pytest.raises(AssertionError, match="owners"):
        kv.check_integrity()


def test_random_alloc_free_keeps_integrity() -> None:
    rng = random.Random(1234)
    num_blocks, block_size = 64, 4
    kv = KVCacheManager(num_blocks, block_size)
    live: dict[str, Request] = {}
    next_id = 0
    failures = successes = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.7 or not live:
            if live and rng.random() < 0.6:
                req = live[rng.choice(sorted(live))]
            else:
                req = make_request(f"r{next_id}")
                next_id += 1
            new = rng.randint(1, 60)
            table_before = list(kv.block_tables.get(req.request_id, []))
            free_before = kv.num_free_blocks
            need = cdiv(req.num_computed_tokens + new, block_size) - len(table_before)
            ok = kv.allocate_slots(req, new)
            assert ok == (need <= free_before)
            if ok:
                successes += 1
                req.num_computed_tokens += new
                live[req.request_id] = req
                table = kv.block_table(req.request_id)
                assert len(table) == cdiv(req.num_computed_tokens, block_size)
                assert table[:len(table_before)] == table_before
            else:
                failures += 1
                assert kv.block_tables.get(req.request_id, []) == table_before
                assert (req.request_id in kv.block_tables) == bool(table_before)
                assert kv.num_free_blocks == free_before
        else:
            req = live.pop(rng.choice(sorted(live)))
            n = len(kv.block_table(req.request_id))
            free_before = kv.num_free_blocks
            kv.free(req)
            assert kv.num_free_blocks == free_before + n
        kv.check_integrity()
        pool = kv.pool
        assert pool.num_free_blocks + pool.num_used_blocks == num_blocks
        assert pool.num_used_blocks == sum(len(t) for t in kv.block_tables.values())
        all_owned = [b for t in kv.block_tables.values() for b in t]
        assert len(all_owned) == len(set(all_owned))  # no block in two tables
    assert successes > 100 and failures > 10  # both paths were exercised
    for req in live.values():
        kv.free(req)
    assert kv.num_free_blocks == num_blocks
    kv.check_integrity()


def test_random_share_free_keeps_integrity() -> None:
    rng = random.Random(99)
    pool = BlockPool(32)
    owners: list[int] = []  # one entry per reference held
    for _ in range(3000):
        op = rng.random()
        if op < 0.4:
            k = rng.randint(0, 4)
            if k <= pool.num_free_blocks:
                owners.extend(pool.allocate(k))
            else:
                with pytest.raises(RuntimeError):
                    pool.allocate(k)
        elif op < 0.6 and owners:
            b = rng.choice(owners)
            pool.share([b])
            owners.append(b)
        elif owners:
            b = owners.pop(rng.randrange(len(owners)))
            pool.free([b])
        pool.check_integrity()
        for blk in range(32):
            assert pool.ref_counts[blk] == owners.count(blk)
        assert pool.num_used_blocks == len(set(owners))
