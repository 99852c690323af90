"""What an engine shows of itself: one snapshot, taken on the engine's thread, that `/metrics`, `/v1/memory` and
the benches read instead of the scheduler's, the KV cache manager's or the runner's own state."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.engine.kv_cache_manager import PrefixCacheStats, SwapStats
from pagedllm.engine.scheduler import PreemptionStats
from pagedllm.memory.plan import MemoryPlan


@dataclass(frozen=True)
class KVCacheUsage:
    """The device pool of KV blocks."""

    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int  # free blocks still holding a prefix that can be found again
    usage: float  # blocks_used / blocks_total


@dataclass(frozen=True)
class RequestBlocks:
    """One request's share of the pool."""

    request_id: str
    blocks: int
    computed_tokens: int  # 0 for a request not running (swapped out)


@dataclass(frozen=True)
class EngineStats:
    memory_plan: MemoryPlan
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache: KVCacheUsage
    swap_blocks_total: int  # host blocks of --swap-space
    swap_blocks_used: int
    swap_usage: float
    preemptions: PreemptionStats  # so far, by kind
    swaps: SwapStats  # blocks swapped out and in so far
    prefix_cache: PrefixCacheStats  # queries and hits so far, in tokens
    structured_output_cache_bytes: int  # compiled grammars held
    requests: tuple[RequestBlocks, ...] = ()  # each request holding blocks (only when asked for)

    def memory_json(self) -> dict:
        """`/v1/memory`'s body: the plan, then what the KV cache holds now."""
        return self.memory_plan.to_json() | {
            "kv_cache_usage": {"block_size": self.kv_cache.block_size, "blocks_total": self.kv_cache.blocks_total,
                               "blocks_used": self.kv_cache.blocks_used, "blocks_free": self.kv_cache.blocks_free,
                               "blocks_cached": self.kv_cache.blocks_cached, "usage": self.kv_cache.usage},
            "requests": [{"request_id": r.request_id, "blocks": r.blocks, "computed_tokens": r.computed_tokens}
                         for r in self.requests],
            "num_waiting": self.num_waiting,
            "num_swapped": self.num_swapped,
            "swap_usage": {"blocks_total": self.swap_blocks_total, "blocks_used": self.swap_blocks_used,
                           "usage": self.swap_usage},
            "num_preemptions": self.preemptions.total,
            "structured_output_cache_bytes": self.structured_output_cache_bytes,
        }
