"""KVCacheManager: which blocks each request holds, and room for the tokens it computes next."""
from __future__ import annotations

from pagedllm.engine.block_pool import BlockPool
from pagedllm.engine.request import Request
from pagedllm.utils import cdiv


class KVCacheManager:
    """Maps requests to their block tables over one BlockPool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more computed tokens.

        Returns False (and changes nothing) when the pool is too small: the caller must preempt.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[request.request_id]
            return False
        table.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.pool.free(table[::-1])

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        owned = sum(len(t) for t in self.block_tables.values())
        in_use = sum(self.pool.ref_counts)
        if owned != in_use:
            raise AssertionError(f"block tables hold {owned} blocks but the pool counts {in_use} owners")
