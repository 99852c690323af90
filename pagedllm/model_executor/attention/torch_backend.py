"""The `torch` attention backend: PyTorch ops on any device, the reference the others are tested against.

Requests are batched per group with the same padded query length (one group for decodes, one for
prefill chunks). K/V are gathered from the pool into padded buffers and attended to with two batched
matmuls (decode) or PyTorch's scaled_dot_product_attention (prefill), under dense masks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.model_executor.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    flat_positions,
    padded_block_table,
)
from pagedllm.model_executor.attention.layer import PagedAttention
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
    query_positions: torch.Tensor  # (B, 1, max_q, 1) each query's position (what a sliding window is cut at)
    is_decode: bool  # every request has exactly one query
    covers_step: bool  # a decode group of every token in the step, in flat order (no index maps needed)
    in_step_order: bool  # the group's real queries are every token of the step, in flat order (dest_index = arange)
    # For a prefill kernel over the group's real queries (in dest_index's order, request after request): where
    # each request's queries start among them, how many it has, and the first one's position.
    query_offsets: torch.Tensor  # (B,) int64
    query_counts: torch.Tensor  # (B,) int64
    first_positions: torch.Tensor  # (B,) int64
    # Shared by every layer in this step: gather buffers (kv_heads, B, keys, dim) for K and V, and the
    # row ids of the group's blocks in a cache's (kv_heads * blocks, block) view; windowed masks.
    scratch: dict[tuple, object] = field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The mask of a layer with this sliding window: keys within `window` positions of the query."""
        if window is None:
            return self.mask
        key = ("window", window)
        if key not in self.scratch:
            keys = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self.scratch[key] = self.mask & (keys > self.query_positions - window)
        return self.scratch[key]


@dataclass
class GroupedMetadata(AttentionMetadata):
    groups: list[AttentionGroup] = field(default_factory=list)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int,
                       device: torch.device) -> GroupedMetadata:
        """Python work is per request; per-token indices are made with tensor ops."""
        table = padded_block_table(block_tables)
        positions, slot_mapping, start, lens, offsets = flat_positions(starts, lengths, table, block_size)
        groups = []
        is_decode = lens == 1
        for members in (torch.nonzero(is_decode).flatten(), torch.nonzero(~is_decode).flatten()):
            if len(members) == 0:
                continue
            groups.append(_build_group(members, start, lens, offsets, table, block_size, device))
        return GroupedMetadata(positions=positions.to(device), slot_mapping=slot_mapping.to(device),
                               block_size=block_size, backend=self, groups=groups)

    def forward(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: GroupedMetadata) -> torch.Tensor:
        self.write_kv(layer, meta.slot_mapping, k, v)
        kernel, prefill_kernel = self.decode_kernel(layer, q), self.prefill_kernel(layer, q)
        # A group that covers the step returns its own output: no tensor to scatter into.
        first = meta.groups[0] if meta.groups else None
        whole = first is not None and (first.covers_step or prefill_kernel is not None and first.in_step_order)
        out = None if whole else torch.empty_like(q)
        window = layer.sliding_window or 0
        for g in meta.groups:
            # The kernels read straight from the cache through the block tables: no gathered copy of K/V.
            if g.is_decode and kernel is not None:
                args = (layer.k_cache, layer.v_cache, g.block_index, g.key_lens, layer.scale, meta.block_size, window,
                        layer.sinks)
                if g.covers_step:
                    return kernel(q, *args)
                out[g.dest_index] = kernel(q[g.dest_index], *args)
                continue
            if not g.is_decode and prefill_kernel is not None:
                args = (layer.k_cache, layer.v_cache, g.block_index, g.query_offsets, g.query_counts, g.first_positions,
                        layer.scale, meta.block_size, window, layer.sinks)
                if g.in_step_order:
                    return prefill_kernel(q, *args)
                out[g.dest_index] = prefill_kernel(q[g.dest_index], *args)
                continue
            # One gather per tensor of the group's whole blocks, already (kv_heads, B, keys, dim):
            # the head-major cache makes each block of one head a contiguous run of positions.
            k_buf, v_buf, rows = _gather_scratch(layer, g, meta.block_size, q)
            kg = read_kv(layer.k_cache, g.block_index, meta.block_size, layer.k_scale, q.dtype, k_buf, rows)
            vg = read_kv(layer.v_cache, g.block_index, meta.block_size, layer.v_scale, q.dtype, v_buf, rows)
            mask = g.mask_for(layer.sliding_window)
            if g.covers_step:
                return _decode_attention(layer, q, kg, vg, mask)
            if g.is_decode:
                out[g.dest_index] = _decode_attention(layer, q[g.dest_index], kg, vg, mask)
                continue
            qg = q[g.query_index].transpose(1, 2)  # (B, heads, max_q, dim)
            if layer.sinks is not None:
                og = _attention_with_sinks(layer, qg, kg.transpose(0, 1), vg.transpose(0, 1), mask)
            else:
                og = F.scaled_dot_product_attention(
                    qg, kg.transpose(0, 1), vg.transpose(0, 1), attn_mask=mask, scale=layer.scale,
                    enable_gqa=layer.num_kv_heads != layer.num_heads,
                )
            og = og.transpose(1, 2).reshape(-1, layer.num_heads, layer.head_dim)  # (B * max_q, heads, dim)
            out[g.dest_index] = og[g.src_index]
        return out

    def write_kv(self, layer: PagedAttention, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's K/V into the cache (an fp8 cache quantizes)."""
        write_kv(layer.k_cache, slots, k, layer.k_scale)
        write_kv(layer.v_cache, slots, v, layer.v_scale)

    def decode_kernel(self, layer: PagedAttention, q: torch.Tensor):
        """A kernel that attends one query per request straight from the cache, or None (gather + matmuls):
        kernel(q, k_cache, v_cache, block_table, key_lens, scale, block_size, window, sinks)."""
        return None

    def prefill_kernel(self, layer: PagedAttention, q: torch.Tensor):
        """A kernel that attends a prefill group's queries causally straight from the cache, or None (gather +
        SDPA under a mask): kernel(q, k_cache, v_cache, block_table, query_offsets, query_counts,
        first_positions, scale, block_size, window, sinks)."""
        return None


def _gather_scratch(layer: PagedAttention, g: AttentionGroup, block_size: int, q: torch.Tensor):
    b, n = g.block_index.shape
    shape = (layer.num_kv_heads, b, n * block_size, layer.head_dim)
    key = (q.dtype, shape, layer.k_cache.shape)
    if key not in g.scratch:
        rows = block_rows(g.block_index, layer.num_kv_heads, layer.k_cache.shape[1] // block_size)
        g.scratch[key] = (q.new_empty(shape), q.new_empty(shape), rows)
    return g.scratch[key]


def _decode_attention(layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
    """One query per request: two small batched matmuls beat SDPA's CPU kernel ~10x here.

    q: (B, heads, dim); k, v: (kv_heads, B, keys, dim). Same arithmetic as the reference's eager
    attention: scores in the model dtype, softmax in float32. Query heads h*g .. h*g+g-1 share
    KV head h, so GQA is a reshape, not a copy.
    """
    b = q.shape[0]
    group = layer.num_heads // layer.num_kv_heads
    qg = q.view(b, layer.num_kv_heads, group, layer.head_dim).transpose(0, 1)  # (kv_heads, B, group, dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * layer.scale  # (kv_heads, B, group, keys)
    scores = scores.float().masked_fill_(~mask.view(1, b, 1, -1), float("-inf"))
    if layer.sinks is None:
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
    else:  # the sink's logit joins each softmax, its weight dropped
        sinks = layer.sinks.float().view(layer.num_kv_heads, 1, group, 1).expand(-1, b, -1, -1)
        probs = torch.softmax(torch.cat((scores, sinks), dim=-1), dim=-1)[..., :-1].to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(b, layer.num_heads, layer.head_dim)


def _attention_with_sinks(layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
    """Prefill attention with a sink logit per head in each softmax (SDPA has no such term): q (B, heads, max_q,
    dim), k and v (B, kv_heads, keys, dim), mask (B, 1, max_q, keys).

    A sink adds exp(sink) to each softmax's denominator and nothing to its numerator, so the output is plain
    attention's scaled by Z / (Z + exp(sink)) = sigmoid(logsumexp - sink). On a CPU the flash kernel gives both
    without the (heads, queries, keys) score matrix, which at 2048 tokens and gpt-oss' 64 heads is 1 GiB in
    float32; elsewhere the scores are materialised as the reference's eager attention does."""
    group = layer.num_heads // layer.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    sinks = layer.sinks.float()
    if q.device.type == "cpu":
        additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=additive,
                                                                              scale=layer.scale)
        return out * torch.sigmoid(lse - sinks.view(1, -1, 1)).unsqueeze(-1).to(out.dtype)
    scores = (torch.matmul(q, k.transpose(-1, -2)) * layer.scale).float().masked_fill_(~mask, float("-inf"))
    sinks = sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)
    probs = torch.softmax(torch.cat((scores, sinks), dim=-1), dim=-1)[..., :-1].to(v.dtype)
    return torch.matmul(probs, v)


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
        query_positions=torch.where(real, q_abs, 0)[:, None, :, None].to(device),  # (padding rows: position 0)
        is_decode=max_q == 1,
        covers_step=max_q == 1 and len(members) == len(lens),
        in_step_order=len(members) == len(lens),
        query_offsets=(torch.cumsum(g_len, 0) - g_len).to(device),
        query_counts=g_len.to(device),
        first_positions=g_start.to(device),
    )
