"""Paged attention: K/V are written into a block pool by slot, and read back through block tables.

Backend: requests are batched per group with the same padded query length (one group for decodes,
one for prefill chunks). On CPU a decode group runs the native kernel of cpu_kernels, which reads K/V
through the block tables in place; otherwise K/V are gathered from the pool and attended to with two
batched matmuls (decode) or PyTorch's scaled_dot_product_attention (prefill).
The metadata is built once per step by the model runner and reached through the forward context.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.cpu_kernels import cpu_kernels
from pagedllm.model_executor.kv_quant import block_rows, read_kv, write_kv
from pagedllm.utils import cdiv


@dataclass
class AttentionGroup:
    """Requests batched together: B requests, queries padded to max_q, keys to their longest block table."""

    query_index: torch.Tensor  # (B, max_q) flat token index of each query (padding -> 0)
    dest_index: torch.Tensor  # (n_real,) flat token index of each real query
    src_index: torch.Tensor  # (n_real,) its position in the flattened (B * max_q) group output
    block_index: torch.Tensor  # (B, blocks) the block table of each request (padding -> block 0)
    key_lens: torch.Tensor  # (B,) int64: keys 0 .. key_lens-1 of each request are in the cache after this step
    mask: torch.Tensor  # (B, 1, max_q, blocks * block_size) True where a query may attend to a key
    is_decode: bool  # every request has exactly one query
    covers_step: bool  # a decode group of every token in the step, in flat order (no index maps needed)
    # Shared by every layer in this step: gather buffers (kv_heads, B, keys, dim) for K and V, and the
    # row ids of the group's blocks in a cache's (kv_heads * blocks, block) view.
    scratch: dict[tuple, object] = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # (num_tokens,) position of each token in its sequence
    slot_mapping: torch.Tensor  # (num_tokens,) cache slot where each new token's K/V goes
    block_size: int
    groups: list[AttentionGroup]


_metadata: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata):
    """Make this step's attention metadata visible to every attention layer during one forward."""
    global _metadata
    prev, _metadata = _metadata, metadata
    try:
        yield
    finally:
        _metadata = prev


class PagedAttention(nn.Module):
    """Attention of one layer over its slice of the paged KV cache (bound by the model runner)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # (kv_heads, num_blocks * block_size, head_dim) views into the cache, set by bind_kv_cache.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # Per-tensor scales of an fp8 cache (stored = x / scale), from the checkpoint or 1.0.
        self.k_scale = self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (tokens, heads, dim); k, v: (tokens, kv_heads, dim)
        meta = _metadata
        if meta is None or self.k_cache is None:
            raise RuntimeError("PagedAttention needs a bound KV cache and a forward_context")
        self._write_kv(meta.slot_mapping, k, v)
        kernel = self._decode_kernel(q)
        # A group that covers the step returns its own output: no tensor to scatter into.
        out = None if meta.groups and meta.groups[0].covers_step else torch.empty_like(q)
        for g in meta.groups:
            if g.is_decode and kernel is not None:
                # Straight from the cache through the block tables: no gathered copy of K/V.
                if g.covers_step:
                    return kernel(q, self.k_cache, self.v_cache, g.block_index, g.key_lens, self.scale, meta.block_size)
                out[g.dest_index] = kernel(q[g.dest_index], self.k_cache, self.v_cache, g.block_index, g.key_lens,
                                           self.scale, meta.block_size)
                continue
            # One gather per tensor of the group's whole blocks, already (kv_heads, B, keys, dim):
            # the head-major cache makes each block of one head a contiguous run of positions.
            k_buf, v_buf, rows = self._gather_scratch(g, meta.block_size, q)
            kg = read_kv(self.k_cache, g.block_index, meta.block_size, self.k_scale, q.dtype, k_buf, rows)
            vg = read_kv(self.v_cache, g.block_index, meta.block_size, self.v_scale, q.dtype, v_buf, rows)
            if g.covers_step:
                return self._decode_attention(q, kg, vg, g.mask)
            if g.is_decode:
                out[g.dest_index] = self._decode_attention(q[g.dest_index], kg, vg, g.mask)
                continue
            qg = q[g.query_index].transpose(1, 2)  # (B, heads, max_q, dim)
            og = F.scaled_dot_product_attention(
                qg, kg.transpose(0, 1), vg.transpose(0, 1), attn_mask=g.mask, scale=self.scale,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )
            og = og.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)  # (B * max_q, heads, dim)
            out[g.dest_index] = og[g.src_index]
        return out

    def _write_kv(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's K/V into the cache: on CPU with the cache in their dtype, one native call for both
        (batch 64, Qwen2.5-0.5B shapes: 14 us against 56 us for two index_copy_ calls, per layer);
        otherwise write_kv (an fp8 cache quantizes)."""
        if k.device.type == "cpu" and self.k_cache.dtype == k.dtype == v.dtype:
            kernels = cpu_kernels()
            if kernels is not None:
                kernels.write_kv_cache(self.k_cache, self.v_cache, slots, k, v)
                return
        write_kv(self.k_cache, slots, k, self.k_scale)
        write_kv(self.v_cache, slots, v, self.v_scale)

    def _decode_kernel(self, q: torch.Tensor):
        """The native decode-attention kernel where it applies (a CPU cache in the query's dtype, a head
        size it is built for), else None and the PyTorch path below runs."""
        if q.device.type != "cpu" or self.k_cache.dtype != q.dtype or self.head_dim not in DECODE_KERNEL_HEAD_DIMS:
            return None
        kernels = cpu_kernels()
        return None if kernels is None else kernels.paged_decode_attention

    def _gather_scratch(self, g: AttentionGroup, block_size: int, q: torch.Tensor):
        b, n = g.block_index.shape
        shape = (self.num_kv_heads, b, n * block_size, self.head_dim)
        key = (q.dtype, shape, self.k_cache.shape)
        if key not in g.scratch:
            rows = block_rows(g.block_index, self.num_kv_heads, self.k_cache.shape[1] // block_size)
            g.scratch[key] = (q.new_empty(shape), q.new_empty(shape), rows)
        return g.scratch[key]

    def _decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
        """One query per request: two small batched matmuls beat SDPA's CPU kernel ~10x here.

        q: (B, heads, dim); k, v: (kv_heads, B, keys, dim). Same arithmetic as the reference's eager
        attention: scores in the model dtype, softmax in float32. Query heads h*g .. h*g+g-1 share
        KV head h, so GQA is a reshape, not a copy.
        """
        b = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        qg = q.view(b, self.num_kv_heads, group, self.head_dim).transpose(0, 1)  # (kv_heads, B, group, dim)
        scores = torch.matmul(qg, k.transpose(-1, -2)) * self.scale  # (kv_heads, B, group, keys)
        scores = scores.float().masked_fill_(~mask.view(1, b, 1, -1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(probs, v).transpose(0, 1).reshape(b, self.num_heads, self.head_dim)


DECODE_KERNEL_HEAD_DIMS = (32, 64, 80, 96, 128, 256)  # those cpu_kernels' decode attention is compiled for


def kv_cache_shape(num_layers: int, num_kv_heads: int, num_slots: int, head_dim: int) -> tuple[int, ...]:
    """Every layer's K and V in one tensor, head-major: (layers, 2, kv_heads, slots, head_dim).

    A block of one head is then a contiguous run of positions, so attention gathers a request's
    keys straight into the (kv_heads, B, keys, dim) layout its matmuls read, with no transposing copy.
    """
    return (num_layers, 2, num_kv_heads, num_slots, head_dim)


def bind_kv_cache(layers: list[PagedAttention], kv_cache: torch.Tensor | None) -> None:
    """Give each attention layer its views of a kv_cache_shape() tensor (None unbinds them)."""
    for i, attn in enumerate(layers):
        attn.k_cache, attn.v_cache = (None, None) if kv_cache is None else (kv_cache[i, 0], kv_cache[i, 1])


def build_attention_metadata(
    starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """Describe one step: request i computes tokens [starts[i], starts[i] + lengths[i]).

    Tokens are laid out flat, request after request. Python work is per request; per-token
    indices are made with tensor ops.
    """
    num_reqs = len(starts)
    lens = torch.tensor(lengths, dtype=torch.long)
    start = torch.tensor(starts, dtype=torch.long)
    offsets = torch.cumsum(lens, 0) - lens  # flat index of each request's first token
    max_blocks = max(len(t) for t in block_tables)
    # One tensor from padded lists (64 tables: ~0.1 ms; a row assignment per request took ~0.8 ms).
    table = torch.tensor([list(t) + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.long)

    req_of_token = torch.repeat_interleave(torch.arange(num_reqs), lens)
    positions = torch.arange(int(lens.sum())) - offsets[req_of_token] + start[req_of_token]
    slot_mapping = table[req_of_token, positions // block_size] * block_size + positions % block_size

    groups = []
    is_decode = lens == 1
    for members in (torch.nonzero(is_decode).flatten(), torch.nonzero(~is_decode).flatten()):
        if len(members) == 0:
            continue
        groups.append(_build_group(members, start, lens, offsets, table, block_size, device))
    return AttentionMetadata(positions=positions.to(device), slot_mapping=slot_mapping.to(device),
                             block_size=block_size, groups=groups)


def _build_group(members, start, lens, offsets, table, block_size, device) -> AttentionGroup:
    g_start, g_len, g_off, g_table = start[members], lens[members], offsets[members], table[members]
    max_q = int(g_len.max())
    num_blocks = cdiv(int((g_start + g_len).max()), block_size)
    q_pos = torch.arange(max_q)
    real = q_pos[None, :] < g_len[:, None]  # (B, max_q)
    query_index = torch.where(real, g_off[:, None] + q_pos[None, :], 0)
    kv_pos = torch.arange(num_blocks * block_size)  # keys are whole gathered blocks; the mask trims them
    # A query at absolute position p sees keys 0..p; padded query rows see key 0 (never read).
    q_abs = g_start[:, None] + q_pos[None, :]  # (B, max_q)
    mask = kv_pos[None, None, :] <= q_abs[:, :, None]
    mask = torch.where(real[:, :, None], mask, kv_pos[None, None, :] == 0)
    flat_real = real.flatten()
    return AttentionGroup(
        query_index=query_index.to(device),
        dest_index=query_index.flatten()[flat_real].to(device),
        src_index=torch.nonzero(flat_real).flatten().to(device),
        block_index=g_table[:, :num_blocks].contiguous().to(device),
        key_lens=(g_start + g_len).to(device),
        mask=mask.unsqueeze(1).to(device),
        is_decode=max_q == 1,
        covers_step=max_q == 1 and len(members) == len(lens),
    )
