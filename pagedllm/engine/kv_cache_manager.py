"""KVCacheManager: which blocks each request holds, room for the tokens it computes next, and the
prefix cache: full blocks found again by the hash of their tokens and of everything before them."""
from __future__ import annotations

import hashlib
import pickle
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.engine.block_pool import BlockHash, BlockPool
from pagedllm.engine.request import Request
from pagedllm.utils import cdiv


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """sha256 of (parent block's hash, this block's token ids, extra keys such as a cache salt).

    The parent makes the hash name the whole prefix, not just this block. A cryptographic hash
    (as vLLM's default) because a collision would hand one request another's K/V.
    """
    data = pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.sha256(data).digest()


@dataclass(frozen=True)
class CachedPrefix:
    """The longest cached prefix of a request that holds no blocks yet."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0  # tokens those blocks hold: computed without running the model
    num_queried_tokens: int = 0  # tokens looked up; 0 when the lookup was skipped


@dataclass
class SwapStats:
    """Blocks copied between the device pool and the host (swap) pool since start."""

    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0


from pagedllm.step_input import BlockCopy  # (source block, destination block) of one K/V block copy


@dataclass
class PrefixCacheStats:
    """Counted in tokens, as vLLM: each lookup adds the request's tokens to queries and its hit to hits."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """Maps requests to their block tables over one BlockPool, sharing cached prefix blocks.

    Full blocks are offered to the prefix cache when they are scheduled, before the step computes
    them (as vLLM does), so a request scheduled later in the same step (the other samples of an
    n > 1 prompt) already hits them. That is safe because the step's attention writes every new
    token's K/V into the cache before any request reads it, and a block cached in a step is
    always computed in that step: the scheduler only preempts requests not yet scheduled in it.

    With `num_swap_blocks`, a second pool of host blocks holds the K/V of swapped-out requests
    (`swapped_tables`); a request holds blocks in one pool or the other, never both. A swapped-in
    request's full blocks are offered to the prefix cache at once too: the model runner copies them
    back at the start of the step, before any attention reads them.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_swap_blocks: int = 0) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_swap_blocks) if num_swap_blocks else None  # no hashes: nothing is cached
        self.swapped_tables: dict[str, list[int]] = {}
        self.swap_stats = SwapStats()
        self.block_tables: dict[str, list[int]] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self._requests: dict[str, Request] = {}  # the owner of each table
        self._num_cached_blocks: dict[str, int] = {}  # leading table blocks already offered to the cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The chain hashes of the request's full blocks, extended as its tokens grow."""
        hashes, size = request.block_hashes, self.block_size
        for i in range(len(hashes), request.num_tokens // size):
            parent = hashes[-1] if hashes else None
            extra = ("cache_salt", request.cache_salt) if i == 0 and request.cache_salt is not None else ()
            if request.has_audio:  # audio positions share placeholder ids: their codes tell them apart
                extra = (*extra, "audio_frames", tuple(request.frames(i * size, (i + 1) * size)))
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * size:(i + 1) * size], extra))
        return hashes

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The request's longest run of cached full blocks, leaving at least its last token to compute
        (its logits give the next token). Changes nothing: `allocate_slots` takes the blocks."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return CachedPrefix()  # prompt logprobs need every prompt position computed
        if self.block_tables.get(request.request_id):
            raise RuntimeError(f"request {request.request_id} already holds blocks: only a new table starts "
                               f"from a cached prefix")
        blocks = self._cached_run(request, (request.num_tokens - 1) // self.block_size)
        return CachedPrefix(tuple(blocks), len(blocks) * self.block_size, request.num_tokens)

    def allocate_slots(self, request: Request, num_new_tokens: int, prefix: CachedPrefix | None = None) -> bool:
        """Make room for `num_new_tokens` more computed tokens, after the cached `prefix` (from
        `find_cached_prefix`, for a request without blocks) whose blocks become the table's first.

        Returns False (and changes nothing) when the pool is too small: the caller must preempt.
        On success the caller moves num_computed_tokens past the prefix.
        """
        prefix = prefix or CachedPrefix()
        rid = request.request_id
        table = self.block_tables.get(rid, [])
        if prefix.block_ids and table:
            raise RuntimeError(f"request {rid} already holds blocks: only a new table starts from a cached prefix")
        if prefix.block_ids and any(
                self.pool.block_hashes[b] != h for b, h in zip(prefix.block_ids, self.block_hashes(request))):
            raise RuntimeError(f"the cached prefix of request {rid} is stale or another request's: look it up "
                               f"right before allocating")
        num_tokens = request.num_computed_tokens + prefix.num_tokens + num_new_tokens
        needed = self.blocks_needed(num_tokens) - len(table) - len(prefix.block_ids)
        revived = sum(1 for b in prefix.block_ids if self.pool.ref_counts[b] == 0)  # they leave the free queue
        if needed > self.pool.num_free_blocks - revived:
            return False
        if rid not in self.block_tables:
            self.block_tables[rid] = table
            self._requests[rid] = request
            self._num_cached_blocks[rid] = len(prefix.block_ids)
            self._record_lookup(prefix)
        self.pool.touch(list(prefix.block_ids))
        table.extend(prefix.block_ids)
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        self._cache_full_blocks(request, min(num_tokens, request.num_tokens))
        return True

    def _record_lookup(self, prefix: CachedPrefix) -> None:
        if prefix.num_queried_tokens:
            self.prefix_cache_stats.queries += prefix.num_queried_tokens
            self.prefix_cache_stats.hits += prefix.num_tokens

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the request's blocks that `num_tokens` tokens fill to the prefix cache."""
        rid = request.request_id
        done, full = self._num_cached_blocks[rid], num_tokens // self.block_size
        if not self.enable_caching or full <= done:
            return
        table, hashes = self.block_tables[rid], self.block_hashes(request)
        for i in range(done, full):
            self.pool.cache_block(table[i], hashes[i])
        self._num_cached_blocks[rid] = full

    def free(self, request: Request) -> None:
        """Give the request's blocks back (device or host), tail first; full ones stay cached until evicted."""
        rid = request.request_id
        table = self.block_tables.pop(rid, None)
        self._requests.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        if table:
            self.pool.free(table[::-1])
        host = self.swapped_tables.pop(rid, None)
        if host:
            self.host_pool.free(host[::-1])

    # -- swapping -----------------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        """The host pool has room for all of the request's device blocks."""
        table = self.block_tables.get(request.request_id, [])
        return self.host_pool is not None and 0 < len(table) <= self.host_pool.num_free_blocks

    def swap_out(self, request: Request) -> list[BlockCopy]:
        """Move the request to host blocks: returns the (device, host) copies, which must run before
        the device blocks are written again (the model runner does them at the start of the step).

        Every block is copied, shared or cached ones too; then this request's reference is dropped as
        in `free`, so a block another request still holds stays theirs, and full blocks stay cached.
        """
        if not self.can_swap_out(request):
            raise RuntimeError(f"request {request.request_id} cannot be swapped out: no room in the host pool")
        table = self.block_tables[request.request_id]
        host = self.host_pool.allocate(len(table))
        copies = list(zip(table, host))
        self.free(request)
        self.swapped_tables[request.request_id] = host
        self.swap_stats.swapped_out_blocks += len(copies)
        return copies

    def swap_in(self, request: Request, num_new_tokens: int) -> list[BlockCopy] | None:
        """Bring a swapped-out request back to device blocks, with room for `num_new_tokens` more
        computed tokens. Returns the (host, device) copies, or None (changing nothing) when the device
        pool is too small. Leading full blocks still in the prefix cache are reused, not copied."""
        rid = request.request_id
        host = self.swapped_tables[rid]
        reused = self._cached_computed_blocks(request)[:len(host)]
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(reused)
        revived = sum(1 for b in reused if self.pool.ref_counts[b] == 0)  # they leave the free queue
        if needed > self.pool.num_free_blocks - revived:
            return None
        self.pool.touch(reused)
        fresh = self.pool.allocate(len(host) - len(reused))
        self.block_tables[rid] = reused + fresh
        self._requests[rid] = request
        self._num_cached_blocks[rid] = len(reused)
        self._cache_full_blocks(request, request.num_computed_tokens)
        del self.swapped_tables[rid]
        self.host_pool.free(host[::-1])
        copies = list(zip(host[len(reused):], fresh))
        self.swap_stats.swapped_in_blocks += len(copies)
        if not self.allocate_slots(request, num_new_tokens):
            raise RuntimeError(f"request {rid} was swapped in without room for its next tokens")
        return copies

    def _cached_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of the request's computed full blocks still findable in the prefix cache."""
        if not self.enable_caching:
            return []
        return self._cached_run(request, request.num_computed_tokens // self.block_size)

    def _cached_run(self, request: Request, max_blocks: int) -> list[int]:
        """Cached blocks of the request's first full blocks, up to `max_blocks`, stopping at the first miss."""
        blocks = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block = self.pool.cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    @property
    def num_swapped_blocks(self) -> int:
        return self.host_pool.num_used_blocks if self.host_pool is not None else 0

    @property
    def swap_usage(self) -> float:
        """Fraction of the host pool in use (0 without swap space)."""
        return self.host_pool.usage if self.host_pool is not None else 0.0

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def check_integrity(self) -> None:
        """The pool's checks, each block's ref count equal to the tables that hold it, and every cached
        block in a table sitting where the owner's own prefix hash says it belongs."""
        self.pool.check_integrity()
        owners = Counter(b for table in self.block_tables.values() for b in table)
        owned, in_use = sum(owners.values()), sum(self.pool.ref_counts)
        if owned != in_use:
            raise AssertionError(f"block tables hold {owned} blocks but the pool counts {in_use} owners")
        wrong = [b for b, rc in enumerate(self.pool.ref_counts) if rc != owners.get(b, 0)]
        if wrong:
            raise AssertionError(f"blocks {wrong[:10]}: ref counts differ from their owners in the tables")
        for rid, table in self.block_tables.items():
            self._check_table(rid, table, owners)
        self._check_host_pool()

    def _check_host_pool(self) -> None:
        """Each used host block is held by exactly one swapped-out request, which holds no device block."""
        if self.host_pool is None:
            if self.swapped_tables:
                raise AssertionError("swapped-out requests without a host pool")
            return
        self.host_pool.check_integrity()
        both = set(self.swapped_tables) & set(self.block_tables)
        if both:
            raise AssertionError(f"requests {sorted(both)[:10]} hold blocks in both pools")
        owners = Counter(b for table in self.swapped_tables.values() for b in table)
        wrong = [b for b, rc in enumerate(self.host_pool.ref_counts) if rc != owners.get(b, 0) or rc > 1]
        if wrong:
            raise AssertionError(f"host blocks {wrong[:10]}: ref counts differ from their (single) owners")

    def _check_table(self, rid: str, table: list[int], owners: Counter) -> None:
        if len(set(table)) != len(table):
            raise AssertionError(f"request {rid} holds a block twice")
        hashes = self._requests[rid].block_hashes
        for i, b in enumerate(table):
            block_hash = self.pool.block_hashes[b]
            if block_hash is None and owners[b] > 1:
                raise AssertionError(f"block {b} is shared by {owners[b]} tables but is not cached")
            if block_hash is not None and (i >= len(hashes) or hashes[i] != block_hash):
                raise AssertionError(f"block {b} at position {i} of request {rid} caches another prefix")
