"""BlockPool: the ids and reference counts of the KV cache's blocks. No tensors live here."""
from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids from a fixed pool and takes them back.

    The tensors that hold K/V for a block live in the model runner; this class only decides
    which block ids are in use, so it can be unit-tested in microseconds.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Freed blocks go to the back: the least recently used block is handed out first.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (each with ref count 1). Raises if there are too few."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks but only {len(self._free)} are free")
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Add an owner to blocks that are already in use."""
        for b in block_ids:
            if self.ref_counts[b] < 1:
                raise RuntimeError(f"block {b} is free and cannot be shared")
            self.ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one owner of each block; blocks nobody owns go back to the free queue.

        Callers pass a request's blocks tail first, so a request's last blocks are reused first.
        """
        for b in block_ids:
            if self.ref_counts[b] < 1:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def check_integrity(self) -> None:
        """free + used == total, no block both free and owned, no duplicates in the free queue."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice in the free queue")
        used = {b for b, rc in enumerate(self.ref_counts) if rc > 0}
        if free & used:
            raise AssertionError(f"blocks both free and in use: {sorted(free & used)[:10]}")
        if len(free) + len(used) != self.num_blocks:
            raise AssertionError(
                f"free ({len(free)}) + used ({len(used)}) != total ({self.num_blocks}): blocks leaked")
        if any(rc < 0 for rc in self.ref_counts):
            raise AssertionError("negative reference count")
