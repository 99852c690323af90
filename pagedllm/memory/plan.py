"""MemoryPlan: where the engine's memory goes and how many KV blocks fit. Pure arithmetic."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.errors import KVCacheMemoryError

GiB = 1 << 30
MiB = 1 << 20


def fmt_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= GiB:
        return f"{sign}{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{sign}{n / MiB:.1f} MiB"
    return f"{sign}{n / 1024:.1f} KiB"


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    total_bytes: int
    utilization: float
    used_by_others_bytes: int
    weight_bytes: int
    activation_bytes: int
    overhead_bytes: int
    kv_bytes_per_token: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    kv_cache_memory_bytes: int | None = None  # explicit KV budget from the user
    num_blocks_override: int | None = None

    @property
    def budget_bytes(self) -> int:
        return int(self.total_bytes * self.utilization)

    @property
    def kv_budget_bytes(self) -> int:
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        return (self.budget_bytes - self.used_by_others_bytes - self.weight_bytes
                - self.activation_bytes - self.overhead_bytes)

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def max_useful_blocks(self) -> int:
        """Blocks enough for max_num_seqs sequences of max_model_len: more could never be used."""
        return self.max_num_seqs * -(-self.max_model_len // self.block_size)

    @property
    def num_blocks(self) -> int:
        if self.num_blocks_override is not None:
            return self.num_blocks_override
        return max(0, min(self.kv_budget_bytes // self.block_bytes, self.max_useful_blocks))

    @property
    def max_tokens_in_cache(self) -> int:
        return self.num_blocks * self.block_size

    def check(self) -> None:
        """Raise KVCacheMemoryError when no block, or not one max_model_len sequence, fits."""
        if self.num_blocks_override is None and self.kv_budget_bytes < self.block_bytes:
            raise KVCacheMemoryError(
                "No available memory for the cache blocks: the KV cache budget is "
                f"{fmt_bytes(self.kv_budget_bytes)}, less than one block ({fmt_bytes(self.block_bytes)}).\n"
                + self.table()
            )
        if self.max_tokens_in_cache < self.max_model_len:
            raise KVCacheMemoryError(
                f"The model's max seq len ({self.max_model_len}) is larger than the maximum number of "
                f"tokens that can be stored in the KV cache ({self.max_tokens_in_cache}). "
                f"Lower max_model_len to {self.max_tokens_in_cache} or give the KV cache more memory.\n"
                + self.table()
            )

    def table(self) -> str:
        rows = [
            (f"{self.device} memory total", fmt_bytes(self.total_bytes)),
            (f"budget (utilization {self.utilization:.2f})", fmt_bytes(self.budget_bytes)),
            ("used by other processes", fmt_bytes(self.used_by_others_bytes)),
            ("model weights", fmt_bytes(self.weight_bytes)),
            ("activation peak", fmt_bytes(self.activation_bytes)),
            ("runtime overhead", fmt_bytes(self.overhead_bytes)),
            ("KV cache", f"{fmt_bytes(self.num_blocks * self.block_bytes)} = {self.num_blocks} blocks x "
                         f"{self.block_size} tokens x {fmt_bytes(self.kv_bytes_per_token)}/token"),
            ("KV cache holds", f"{self.max_tokens_in_cache} tokens "
                               f"({self.max_tokens_in_cache / self.max_model_len:.1f}x max_model_len {self.max_model_len})"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
