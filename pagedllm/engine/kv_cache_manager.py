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
from pagedllm.kv_layout import NULL_BLOCK, KVCacheLayout, KVGroup
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

    block_ids: tuple[int, ...] = ()  # the first KV group's blocks (every model's only group, unless it mixes windows)
    num_tokens: int = 0  # tokens those blocks hold: computed without running the model
    num_queried_tokens: int = 0  # tokens looked up; 0 when the lookup was skipped
    other_groups: tuple[tuple[int, ...], ...] = ()  # the other groups' blocks (NULL_BLOCK below a window)

    def table(self, group: int) -> tuple[int, ...]:
        tables = (self.block_ids, *self.other_groups)
        return tables[group] if group < len(tables) else ()


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


HOST_NULL = -1  # a swapped-out window group's entry below its window: no host block


def _group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix cache's key of a block of `group`: groups hold different layers' K/V for the same tokens."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


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

    A request holds one table per KV group of the `layout` (kv_layout.py). A sliding-window group's blocks
    that every future query of the request sees past go back to the pool when the request is next given
    room (`allocate_slots`), their entries pointing to NULL_BLOCK from then on; they stay findable in the
    prefix cache until handed out again. A prefix hit then needs every full-attention group's blocks of the
    prefix and each window group's blocks that its window still covers.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_swap_blocks: int = 0, layout: KVCacheLayout | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = layout.groups if layout is not None else (KVGroup(()),)
        self.pool = BlockPool(num_blocks)
        self.null_block: int | None = None
        if any(g.window is not None for g in self.groups):  # window tables point here below the window
            self.null_block, = self.pool.allocate(1)
            if self.null_block != NULL_BLOCK:
                raise RuntimeError(f"the null block must be block {NULL_BLOCK}, got {self.null_block}")
        self.host_pool = BlockPool(num_swap_blocks) if num_swap_blocks else None  # no hashes: nothing is cached
        self.host_tables: dict[str, list[list[int]]] = {}
        self.swap_stats = SwapStats()
        self.tables: dict[str, list[list[int]]] = {}  # each request's table in every group
        self.prefix_cache_stats = PrefixCacheStats()
        self._requests: dict[str, Request] = {}  # the owner of each table
        self._num_cached_blocks: dict[str, list[int]] = {}  # per group: leading table blocks offered to the cache

    @property
    def block_tables(self) -> dict[str, list[int]]:
        """Each request's table of the first group (a model's only one unless it mixes windows and full layers)."""
        return {rid: tables[0] for rid, tables in self.tables.items()}

    @property
    def swapped_tables(self) -> dict[str, list[int]]:
        """Each swapped-out request's host table of the first group."""
        return {rid: tables[0] for rid, tables in self.host_tables.items()}

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
        if self.tables.get(request.request_id):
            raise RuntimeError(f"request {request.request_id} already holds blocks: only a new table starts "
                               f"from a cached prefix")
        hashes = self.block_hashes(request)[:(request.num_tokens - 1) // self.block_size]
        runs = {g: self._cached_run(hashes, g, len(hashes)) for g, group in enumerate(self.groups)
                if group.window is None}
        length = min((len(run) for run in runs.values()), default=len(hashes))
        while True:  # the longest length whose blocks every window group still has (those its window reads)
            tables = [tuple(runs[g][:length]) if g in runs else self._window_blocks(hashes, g, length)
                      for g in range(len(self.groups))]
            if None not in tables:
                break
            length -= 1
        return CachedPrefix(tables[0], length * self.block_size, request.num_tokens, tuple(tables[1:]))

    def _window_blocks(self, hashes: list[BlockHash], group: int, length: int) -> tuple[int, ...] | None:
        """A window group's table of a cached prefix of `length` blocks: NULL_BLOCK below the window of the
        first query after it, then the cached blocks the window reads; None where one is not cached."""
        first = self.groups[group].first_needed_block(length * self.block_size, self.block_size)
        blocks = tuple(self.pool.cached_block(_group_key(h, group)) for h in hashes[first:length])
        return None if None in blocks else (NULL_BLOCK,) * first + blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, prefix: CachedPrefix | None = None) -> bool:
        """Make room for `num_new_tokens` more computed tokens, after the cached `prefix` (from
        `find_cached_prefix`, for a request without blocks) whose blocks become the tables' first.

        Returns False (and changes nothing, but for window blocks no query reads any more, which go back to
        the pool either way) when the pool is too small: the caller must preempt.
        On success the caller moves num_computed_tokens past the prefix.
        """
        prefix = prefix or CachedPrefix()
        rid = request.request_id
        tables = self.tables.get(rid)
        prefix_tables = [prefix.table(g) for g in range(len(self.groups))]
        if prefix.num_tokens and tables:
            raise RuntimeError(f"request {rid} already holds blocks: only a new table starts from a cached prefix")
        if prefix.num_tokens:
            self._check_prefix(request, prefix_tables)
        if tables and self.null_block is not None:  # (only window groups drop blocks)
            self._drop_blocks_below_windows(request, tables)
        num_tokens = request.num_computed_tokens + prefix.num_tokens + num_new_tokens
        current = tables or [list(t) for t in prefix_tables]
        needed = [max(0, self.blocks_needed(num_tokens) - len(t)) for t in current]
        revived = sum(1 for t in prefix_tables for b in self._real(t) if self.pool.ref_counts[b] == 0)
        if sum(needed) > self.pool.num_free_blocks - revived:
            return False
        if tables is None:
            tables = self.tables[rid] = [[] for _ in self.groups]
            self._requests[rid] = request
            self._num_cached_blocks[rid] = [len(t) for t in prefix_tables]
            self._record_lookup(prefix)
        for table, prefix_table in zip(tables, prefix_tables):  # every hit out of the free queue before any
            self.pool.touch(self._real(prefix_table))  # allocation evicts the LRU blocks
            table.extend(prefix_table)
        for table, count in zip(tables, needed):
            if count > 0:
                table.extend(self.pool.allocate(count))
        self._cache_full_blocks(request, min(num_tokens, request.num_tokens))
        return True

    def _real(self, table) -> list[int]:
        """A table's blocks without its NULL_BLOCK entries."""
        return list(table) if self.null_block is None else [b for b in table if b != NULL_BLOCK]

    def _check_prefix(self, request: Request, prefix_tables: list[tuple[int, ...]]) -> None:
        hashes = self.block_hashes(request)
        for g, table in enumerate(prefix_tables):
            if any(b != self.null_block and self.pool.block_hashes[b] != _group_key(h, g)
                   for b, h in zip(table, hashes)):
                raise RuntimeError(f"the cached prefix of request {request.request_id} is stale or another "
                                   f"request's: look it up right before allocating")

    def _drop_blocks_below_windows(self, request: Request, tables: list[list[int]]) -> None:
        """Give back the window groups' blocks that no query from the request's next token on reads."""
        for group, table in zip(self.groups, tables):
            first = min(group.first_needed_block(request.num_computed_tokens, self.block_size), len(table))
            dropped = [b for b in table[:first] if b != NULL_BLOCK]
            if dropped:
                table[:first] = [NULL_BLOCK] * first
                self.pool.free(dropped[::-1])

    def _record_lookup(self, prefix: CachedPrefix) -> None:
        if prefix.num_queried_tokens:
            self.prefix_cache_stats.queries += prefix.num_queried_tokens
            self.prefix_cache_stats.hits += prefix.num_tokens

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the request's blocks that `num_tokens` tokens fill to the prefix cache."""
        rid = request.request_id
        done, full = self._num_cached_blocks[rid], num_tokens // self.block_size
        if not self.enable_caching or min(done) >= full:
            return
        hashes = self.block_hashes(request)
        for g, table in enumerate(self.tables[rid]):
            for i in range(done[g], full):
                if table[i] != self.null_block:
                    self.pool.cache_block(table[i], _group_key(hashes[i], g))
            done[g] = max(done[g], full)

    def trim(self, request: Request, lookahead: int = 0) -> int:
        """Give back the blocks past the request's computed tokens and `lookahead` more (speculative decoding: the
        slots of drafts the target rejected, tail first; a draft model's next drafts go in the lookahead). Returns
        how many blocks went back. None of them is cached: a block is offered to the prefix cache only once the
        request's own (not draft) tokens fill it."""
        tables = self.tables.get(request.request_id)
        keep = self.blocks_needed(request.num_computed_tokens + lookahead)
        freed = 0
        for table in tables or ():
            tail = [b for b in table[keep:] if b != NULL_BLOCK]
            if tail:
                del table[keep:]
                self.pool.free(tail[::-1])
                freed += len(tail)
        return freed

    def free(self, request: Request) -> None:
        """Give the request's blocks back (device or host), tail first; full ones stay cached until evicted."""
        rid = request.request_id
        tables = self.tables.pop(rid, None)
        self._requests.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        for table in tables or ():
            self.pool.free(self._real(table)[::-1])
        for host in self.host_tables.pop(rid, None) or ():
            self.host_pool.free([b for b in host[::-1] if b != HOST_NULL])

    def num_blocks_held(self, request_id: str) -> int:
        """Device blocks the request holds, every group's table together."""
        return sum(len(self._real(t)) for t in self.tables.get(request_id, ()))

    def group_tables(self, request_id: str) -> list[list[int]]:
        """The request's table in every KV group."""
        return self.tables[request_id]

    # -- swapping -----------------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        """The host pool has room for all of the request's device blocks."""
        held = self.num_blocks_held(request.request_id)
        return self.host_pool is not None and 0 < held <= self.host_pool.num_free_blocks

    def swap_out(self, request: Request) -> list[BlockCopy]:
        """Move the request to host blocks: returns the (device, host) copies, which must run before
        the device blocks are written again (the model runner does them at the start of the step).

        Every block is copied, shared or cached ones too; then this request's reference is dropped as
        in `free`, so a block another request still holds stays theirs, and full blocks stay cached.
        """
        if not self.can_swap_out(request):
            raise RuntimeError(f"request {request.request_id} cannot be swapped out: no room in the host pool")
        tables = self.tables[request.request_id]
        host_blocks = iter(self.host_pool.allocate(self.num_blocks_held(request.request_id)))
        copies, host_tables = [], []
        for table in tables:
            host = [HOST_NULL if b == self.null_block else next(host_blocks) for b in table]
            copies.extend((b, h) for b, h in zip(table, host) if h != HOST_NULL)
            host_tables.append(host)
        self.free(request)
        self.host_tables[request.request_id] = host_tables
        self.swap_stats.swapped_out_blocks += len(copies)
        return copies

    def swap_in(self, request: Request, num_new_tokens: int) -> list[BlockCopy] | None:
        """Bring a swapped-out request back to device blocks, with room for `num_new_tokens` more
        computed tokens. Returns the (host, device) copies, or None (changing nothing) when the device
        pool is too small. Leading full blocks still in the prefix cache are reused, not copied (in the
        full-attention groups)."""
        rid = request.request_id
        hosts = self.host_tables[rid]
        hashes = self.block_hashes(request)[:request.num_computed_tokens // self.block_size]
        reused = [self._cached_run(hashes, g, len(host)) if self.enable_caching and group.window is None else []
                  for g, (group, host) in enumerate(zip(self.groups, hosts))]
        total = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        needed = sum(total - len(r) - host.count(HOST_NULL) for r, host in zip(reused, hosts))
        revived = sum(1 for r in reused for b in r if self.pool.ref_counts[b] == 0)  # they leave the free queue
        if needed > self.pool.num_free_blocks - revived:
            return None
        for r in reused:  # every hit out of the free queue before any allocation evicts the LRU blocks
            self.pool.touch(r)
        copies, tables = [], []
        for r, host in zip(reused, hosts):
            rest = host[len(r):]
            fresh = iter(self.pool.allocate(sum(h != HOST_NULL for h in rest)))
            table = r + [NULL_BLOCK if h == HOST_NULL else next(fresh) for h in rest]
            copies.extend((h, b) for h, b in zip(rest, table[len(r):]) if h != HOST_NULL)
            tables.append(table)
        self.tables[rid] = tables
        self._requests[rid] = request
        self._num_cached_blocks[rid] = [len(r) for r in reused]
        self._cache_full_blocks(request, request.num_computed_tokens)
        del self.host_tables[rid]
        for host in hosts:
            self.host_pool.free([h for h in host[::-1] if h != HOST_NULL])
        self.swap_stats.swapped_in_blocks += len(copies)
        if not self.allocate_slots(request, num_new_tokens):
            raise RuntimeError(f"request {rid} was swapped in without room for its next tokens")
        return copies

    def _cached_run(self, hashes: list[BlockHash], group: int, max_blocks: int) -> list[int]:
        """Cached blocks of `group` holding the first of `hashes`, up to `max_blocks`, stopping at the first miss."""
        blocks = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.cached_block(_group_key(block_hash, group))
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
        """The request's table of the first group."""
        return self.tables[request_id][0]

    def check_integrity(self) -> None:
        """The pool's checks, each block's ref count equal to the tables that hold it (the null block: one,
        its reservation), and every cached block in a table sitting where the owner's own prefix hash
        says it belongs."""
        self.pool.check_integrity()
        owners = Counter(b for tables in self.tables.values() for table in tables for b in self._real(table))
        if self.null_block is not None:
            owners[self.null_block] += 1
        owned, in_use = sum(owners.values()), sum(self.pool.ref_counts)
        if owned != in_use:
            raise AssertionError(f"block tables hold {owned} blocks but the pool counts {in_use} owners")
        wrong = [b for b, rc in enumerate(self.pool.ref_counts) if rc != owners.get(b, 0)]
        if wrong:
            raise AssertionError(f"blocks {wrong[:10]}: ref counts differ from their owners in the tables")
        for rid, tables in self.tables.items():
            for g, table in enumerate(tables):
                self._check_table(rid, g, table, owners)
        self._check_host_pool()

    def _check_host_pool(self) -> None:
        """Each used host block is held by exactly one swapped-out request, which holds no device block."""
        if self.host_pool is None:
            if self.host_tables:
                raise AssertionError("swapped-out requests without a host pool")
            return
        self.host_pool.check_integrity()
        both = set(self.host_tables) & set(self.tables)
        if both:
            raise AssertionError(f"requests {sorted(both)[:10]} hold blocks in both pools")
        owners = Counter(b for tables in self.host_tables.values() for t in tables for b in t if b != HOST_NULL)
        wrong = [b for b, rc in enumerate(self.host_pool.ref_counts) if rc != owners.get(b, 0) or rc > 1]
        if wrong:
            raise AssertionError(f"host blocks {wrong[:10]}: ref counts differ from their (single) owners")

    def _check_table(self, rid: str, group: int, table: list[int], owners: Counter) -> None:
        real = self._real(table)
        if len(set(real)) != len(real):
            raise AssertionError(f"request {rid} holds a block twice")
        if self.null_block is not None and NULL_BLOCK in table[len(table) - len(real):]:
            raise AssertionError(f"request {rid}'s table of group {group} points to the null block above its window")
        hashes = self._requests[rid].block_hashes
        for i, b in enumerate(table):
            if b == self.null_block:
                continue
            block_hash = self.pool.block_hashes[b]
            if block_hash is None and owners[b] > 1:
                raise AssertionError(f"block {b} is shared by {owners[b]} tables but is not cached")
            if block_hash is not None and (i >= len(hashes) or _group_key(hashes[i], group) != block_hash):
                raise AssertionError(f"block {b} at position {i} of request {rid} caches another prefix")
