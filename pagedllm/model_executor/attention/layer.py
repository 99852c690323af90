"""The attention module of one layer: its views of the paged KV cache and its fp8 scales. What it
computes is its step's backend's business (base.py)."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.kv_layout import KVCacheLayout
from pagedllm.model_executor.attention.base import current_metadata


class PagedAttention(nn.Module):
    """Attention of one layer over its slice of the paged KV cache (bound by the model runner)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # (kv_heads, num_blocks * block_size, head_dim) views into the cache, set by bind_kv_cache.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.kv_group = 0  # whose block tables address its blocks (kv_layout.py), set by bind_kv_cache
        # Per-tensor scales of an fp8 cache (stored = x / scale), from the checkpoint or 1.0.
        self.k_scale = self.v_scale = 1.0
        # A sliding window: a query at position p sees the keys at p - window + 1 .. p (None: all before it).
        self.sliding_window: int | None = None
        # Attention sinks (gpt-oss): a learned logit per query head in each softmax's denominator, (heads,);
        # the weights then sum to less than one.
        self.sinks: nn.Parameter | None = None

    def enable_sinks(self) -> None:
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (tokens, heads, dim); k, v: (tokens, kv_heads, dim)
        meta = current_metadata(self.kv_group)
        if meta is None or self.k_cache is None:
            raise RuntimeError("PagedAttention needs a bound KV cache and a forward_context")
        return meta.backend.forward(self, q, k, v, meta)


def kv_cache_shape(num_slots: int, num_kv_heads: int, num_positions: int, head_dim: int) -> tuple[int, ...]:
    """Every layer's K and V in one tensor, head-major: (slots, 2, kv_heads, positions, head_dim). A slot is a
    layer's, or with several KV groups the same layer index of every group's (kv_layout.py).

    A block of one head is then a contiguous run of positions: the torch backend gathers a request's
    keys straight into the (kv_heads, B, keys, dim) layout its matmuls read, and the kernels of the
    cpu and triton backends read a block's keys as contiguous rows."""
    return (num_slots, 2, num_kv_heads, num_positions, head_dim)


def bind_kv_cache(layers: list[PagedAttention], kv_cache: torch.Tensor | None,
                  layout: KVCacheLayout | None = None) -> None:
    """Give each attention layer its views of a kv_cache_shape() tensor (None unbinds them) and its KV group:
    layer i's slot is i, or where `layout` is given, its place in its group."""
    for i, attn in enumerate(layers):
        attn.kv_group, slot = (0, i) if layout is None else layout.slot_of(i)
        attn.k_cache, attn.v_cache = (None, None) if kv_cache is None else (kv_cache[slot, 0], kv_cache[slot, 1])
