"""BlockPool: the ids, reference counts and prefix-cache hashes of the KV cache's blocks. No tensors."""
from __future__ import annotations

from collections import OrderedDict

BlockHash = bytes  # names a full block's tokens and everything before them (see kv_cache_manager)


class BlockPool:
    """Hands out block ids from a fixed pool, takes them back, and remembers which hold cached prefixes.

    The tensors that hold K/V for a block live in the model runner; this class only decides
    which block ids are in use, so it can be unit-tested in microseconds.

    A block freed by its last owner keeps its hash: it stays findable in the prefix cache while it
    waits in the free queue, and loses the hash only when `allocate` hands it out again (LRU order).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # hash -> the one block that holds it
        # Freed blocks go to the back: the least recently used block is handed out first. An ordered
        # dict, not a deque, so a cached free block that is hit again leaves the middle in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash, in use or free."""
        return len(self._cached)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (each with ref count 1), evicting their cached prefixes. Raises if
        there are too few."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks but only {len(self._free)} are free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(count)]
        for b in blocks:
            self._evict(b)
            self.ref_counts[b] = 1
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Add an owner to blocks that are already in use."""
        for b in block_ids:
            if self.ref_counts[b] < 1:
                raise RuntimeError(f"block {b} is free and cannot be shared")
            self.ref_counts[b] += 1

    def touch(self, block_ids: list[int]) -> None:
        """Add an owner to cached blocks (prefix-cache hits): a free one leaves the free queue."""
        for b in block_ids:
            if self.block_hashes[b] is None:
                raise RuntimeError(f"block {b} is not cached: only cached blocks are reused by hash")
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one owner of each block; blocks nobody owns go back to the free queue (still cached).

        Callers pass a request's blocks tail first, so a request's last blocks are reused first.
        """
        for b in block_ids:
            if self.ref_counts[b] < 1:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    # -- the prefix cache -------------------------------------------------------------------------
    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding this prefix, or None."""
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Make a block in use findable by hash. False when another block already holds that prefix
        (two requests computed the same tokens): this one then stays uncached."""
        if self.ref_counts[block_id] < 1:
            raise RuntimeError(f"block {block_id} is free: only a block in use can be cached")
        current = self.block_hashes[block_id]
        if current is not None:
            if current != block_hash:
                raise RuntimeError(f"block {block_id} is already cached under another hash")
            return True
        if block_hash in self._cached:
            return False
        self._cached[block_hash] = block_id
        self.block_hashes[block_id] = block_hash
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self.block_hashes[block_id] = None

    def check_integrity(self) -> None:
        """free + used == total, no block both free and owned, and the hash map and the blocks'
        hashes name each other one to one."""
        free = set(self._free)
        used = {b for b, rc in enumerate(self.ref_counts) if rc > 0}
        if free & used:
            raise AssertionError(f"blocks both free and in use: {sorted(free & used)[:10]}")
        if len(free) + len(used) != self.num_blocks:
            raise AssertionError(
                f"free ({len(free)}) + used ({len(used)}) != total ({self.num_blocks}): blocks leaked")
        if any(rc < 0 for rc in self.ref_counts):
            raise AssertionError("negative reference count")
        for block_hash, b in self._cached.items():
            if self.block_hashes[b] != block_hash:
                raise AssertionError(f"the hash map points to block {b}, which holds another hash")
        hashed = sum(h is not None for h in self.block_hashes)
        if hashed != len(self._cached):
            raise AssertionError(f"{hashed} blocks carry a hash but the hash map holds {len(self._cached)}")
