"""Triton kernels of the `triton` attention backend: paged attention that reads K/V in place through
the block tables, and the K/V write by slot mapping.

One attention kernel serves every step: each program takes one sequence, one KV head and a tile of
its queries (prefill, chunked prefill and decode alike; a mixed batch is one launch), with the
query heads that share the KV head stacked in the tile's rows (GQA/MQA without copying K/V). Keys
are walked BLOCK_N at a time, each key's block found through the sequence's block table, with an
online softmax in float32 (FlashAttention's recurrence). Long decodes with few programs split the
keys into partitions (split-K) whose partial results a second kernel combines. A layer with a sliding
window walks only the keys inside it; attention sinks (gpt-oss: a logit per head in each softmax's
denominator) join the sum at the end, or when the partitions are combined.

The cache is head-major, one (kv_heads, slots, head_dim) view per layer for K and one for V; an fp8
cache holds x / scale and is dequantized in the kernel (to the query dtype, times the scale, as the
`torch` backend does). Under TRITON_INTERPRET=1 the same kernels run on the CPU (how CI tests them).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter (TRITON_INTERPRET=1, how CI runs these kernels on the CPU) multiplies 16-bit
# tl.dot operands wrongly (triton 3.9: garbage for bfloat16), so there the same values (exact in
# float32) are multiplied as float32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Keys per inner iteration; queries x grouped heads per tile (rows of the score tile).
BLOCK_N = 32
BLOCK_M_DECODE, BLOCK_M_PREFILL = 16, 64
# Split-K for decode: keys per partition (at least; more where max_model_len / MAX_PARTITIONS is more).
PARTITION_TOKENS = 512
MAX_PARTITIONS = 64


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_ptr, seq_lens_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr,
    block_table_stride_ptr, scale, k_scale, v_scale, block_size, partition_tokens, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_cs,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_PARTS: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr, DOT_FP32: tl.constexpr,
    WINDOW: tl.constexpr, SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)  # a query tile, or (split-K) a key partition of a decode
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    q_tile = tile if NUM_PARTS == 1 else 0
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // GROUP_PAD  # query token within the sequence's new tokens
    in_group = rows % GROUP_PAD
    row_ok = (tok < q_len) & (in_group < GROUP)
    head = kv_head * GROUP + in_group
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # The last query of the tile sees keys 0 .. context + its token index.
    kv_end = context + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    kv_begin = 0
    if NUM_PARTS > 1:
        kv_begin = tile * partition_tokens
        kv_end = tl.minimum(kv_end, kv_begin + partition_tokens)
    if WINDOW:  # the first query of the tile sees keys from context + its index - window + 1
        kv_begin = tl.maximum(kv_begin, context + q_tile * BLOCK_Q - window + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    # The table's width is read here, not passed: a CUDA graph replays steps whose tables differ in width.
    table = block_table_ptr + seq * tl.load(block_table_stride_ptr)
    for n0 in range(kv_begin, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        block = tl.load(table + n // block_size, mask=n_ok, other=0)
        slot = block.to(tl.int64) * block_size + n % block_size
        k = tl.load(k_base + slot[None, :] * stride_cs + d[:, None], mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        elif DOT_FP32:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale
        visible = (n[None, :] <= (context + tok)[:, None]) & n_ok[None, :]
        if WINDOW:
            visible = visible & (n[None, :] > (context + tok)[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet (padding)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_cs + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if FP8:
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        elif DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if NUM_PARTS > 1:
        part = (seq * NUM_HEADS + head) * NUM_PARTS + tile
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc, mask=row_ok[:, None])
    else:
        if SINKS:  # the sink's exp(logit) joins the denominator (its value row is nothing)
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            m_all = tl.maximum(m_i, sink)
            rescale = tl.exp(m_i - m_all)
            acc = acc * rescale[:, None]
            l_i = l_i * rescale + tl.exp(sink - m_all)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_partitions_kernel(
    out_ptr, query_start_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_PARTS: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Split-K: combine a decode's partition results (max, sum of exponentials, weighted values), and the
    head's sink."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.arange(0, NUM_PARTS)
    base = (seq * NUM_HEADS + head) * NUM_PARTS
    m = tl.load(part_m_ptr + base + parts)
    l = tl.load(part_l_ptr + base + parts)
    m_max = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    d = tl.arange(0, HEAD_PAD)
    acc = tl.load(part_acc_ptr + (base + parts)[:, None] * HEAD_PAD + d[None, :])
    denominator = tl.sum(l * w, 0)
    if SINKS:
        denominator += tl.exp(sink - m_max)
    out = tl.sum(acc * w[:, None], 0) / denominator
    token = tl.load(query_start_ptr + seq)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ch, stride_cs,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    """One token's K and V of one KV head into the cache at its slot (fp8: x / scale, saturated)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    ok = d < HEAD
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok)
    if FP8:  # as kv_quant.quantize: x / scale in the model dtype, then saturated
        k = tl.minimum(tl.maximum((k / k_scale).to(k.dtype).to(tl.float32), -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum((v / v_scale).to(v.dtype).to(tl.float32), -FP8_MAX), FP8_MAX)
    dest = h * stride_ch + slot * stride_cs + d
    tl.store(k_cache_ptr + dest, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + dest, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """k, v: (tokens, kv_heads, dim); caches: (kv_heads, slots, dim), dim contiguous."""
    tokens, kv_heads, head = k.shape
    if tokens == 0:
        return
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    _write_kv_kernel[(tokens, kv_heads)](
        k, v, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        HEAD=head, HEAD_PAD=_pow2(head), FP8=fp8, FP8_MAX=float(torch.finfo(k_cache.dtype).max) if fp8 else 0.0,
    )


def partition_tokens_for(max_len: int) -> int:
    """Keys per split-K partition for sequences of up to max_len keys: PARTITION_TOKENS, or more so
    that MAX_PARTITIONS cover max_len (a multiple of BLOCK_N)."""
    return max(PARTITION_TOKENS, triton.cdiv(triton.cdiv(max_len, MAX_PARTITIONS), BLOCK_N) * BLOCK_N)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, max_seq_len: int,
                    block_size: int, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                    out: torch.Tensor | None = None, split_below: int = 0,
                    block_table_stride: torch.Tensor | None = None, partition_tokens: int = 0,
                    sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every query token of a step over its sequence's paged K/V.

    q: (tokens, heads, dim), tokens laid out sequence after sequence (query_start: (seqs + 1,) int32
    offsets); seq_lens: (seqs,) int32 keys per sequence after this step (its new tokens are the last
    ones, already written); block_table: (seqs, width) int32, its width also in block_table_stride,
    a (1,) int32 device tensor (made here when not given). Causal: query i of a sequence with q_len
    queries and seq_len keys sees keys 0 .. seq_len - q_len + i.

    A decode-only step with fewer than `split_below` programs (sequences x KV heads) splits its keys
    into partitions of `partition_tokens` keys (at least partition_tokens_for(max_seq_len)), as many as
    max_seq_len needs; split_below 0: never. Nothing here reads the tensors' values on the host, so a
    call can be captured in a CUDA graph (with max_seq_len then the longest sequence a replay may see).
    `sliding_window`: a query at position p sees keys p - window + 1 .. p; `sinks`: (heads,) logits added to
    each softmax's denominator."""
    tokens, num_heads, head = q.shape
    kv_heads = k_cache.shape[0]
    num_seqs = seq_lens.shape[0]
    group = num_heads // kv_heads
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    if block_table_stride is None:
        block_table_stride = torch.tensor([block_table.stride(0)], dtype=torch.int32, device=q.device)
    group_pad = _pow2(group)
    head_pad = max(16, _pow2(head))
    prefill_m = BLOCK_M_PREFILL if head_pad <= 128 else BLOCK_M_PREFILL // 2  # the accumulator fits in registers
    block_m = max(BLOCK_M_DECODE if max_query_len == 1 else prefill_m, group_pad)
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    partition_tokens = max(partition_tokens, partition_tokens_for(max_seq_len))  # MAX_PARTITIONS cover every key
    num_parts = 1
    if max_query_len == 1 and num_seqs * kv_heads < split_below:
        num_parts = min(MAX_PARTITIONS, _pow2(triton.cdiv(max_seq_len, partition_tokens)))
    if num_parts > 1:
        part_m = torch.empty(num_seqs * num_heads * num_parts, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_seqs * num_heads * num_parts * head_pad, dtype=torch.float32, device=q.device)
        grid = (num_seqs, kv_heads, num_parts)
    else:
        part_m = part_l = part_acc = out  # unused
        grid = (num_seqs, kv_heads, triton.cdiv(max_query_len, block_m // group_pad))
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_table, query_start, seq_lens, part_m, part_l, part_acc,
        out if sinks is None else sinks, block_table_stride, float(scale), float(k_scale), float(v_scale),
        block_size, partition_tokens, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=group_pad, HEAD=head, HEAD_PAD=head_pad,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, NUM_PARTS=num_parts, FP8=fp8, IEEE=q.dtype == torch.float32,
        DOT_FP32=INTERPRETED and q.dtype != torch.float32, WINDOW=bool(sliding_window), SINKS=sinks is not None,
        num_warps=4 if head_pad <= 64 else 8,
    )
    if num_parts > 1:
        _combine_partitions_kernel[(num_seqs, num_heads)](
            out, query_start, part_m, part_l, part_acc, out if sinks is None else sinks, out.stride(0),
            out.stride(1), NUM_HEADS=num_heads, HEAD=head, HEAD_PAD=head_pad, NUM_PARTS=num_parts,
            SINKS=sinks is not None,
        )
    return out
