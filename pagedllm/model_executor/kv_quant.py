"""Storing K/V in a narrower dtype than the model computes in (--kv-cache-dtype).

16/32-bit caches store K/V cast to their dtype. fp8 caches (float8_e4m3fn, float8_e5m2) store
x / scale with one scale per tensor per layer (k_scale, v_scale), saturated to the format's finite
range, and give back float8 -> model dtype times the scale; attention computes in the model dtype.

Scales come from the checkpoint (vLLM's names) or default to 1.0, as in vLLM. 1.0 is safe for both
formats because every write is clamped first: e4m3 (max 448; a cast past it gives NaN) and e5m2 (max
57344; past it inf) saturate instead, and K/V activations of real models are far below 448. What 1.0
costs is resolution at the small end: values under 2**-6 (e4m3) lose relative precision and under
2**-9 flush to zero, where they add almost nothing to a dot product. No calibrated scale is derived.
"""
from __future__ import annotations

import math
import re

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# model.layers.N.self_attn.{k,v}_scale, with vLLM's variants: .attn.k_scale, .k_proj.k_scale (ModelOpt),
# and the deprecated .kv_scale (one scale for both).
_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.|[kv]_proj\.)?(k|v|kv)_scale$")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in an fp8 dtype, clamped to its finite range so nothing becomes NaN or inf."""
    fmax = torch.finfo(dtype).max
    scaled = x / scale if scale != 1.0 else x
    return scaled.clamp(-fmax, fmax).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored K/V in the compute dtype: a cast (a no-op when the dtypes agree), times the scale for fp8."""
    out = x.to(dtype)
    return out * scale if is_fp8(x.dtype) and scale != 1.0 else out


def write_kv(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """Store x (tokens, heads, dim) into a head-major cache (heads, slots, dim) at `slots`."""
    if not is_fp8(cache.dtype):
        cache.index_copy_(1, slots, x.transpose(0, 1).to(cache.dtype))
        return
    # index_copy_ has no float8 kernel: copy the bytes.
    cache.view(torch.uint8).index_copy_(1, slots, quantize(x, scale, cache.dtype).transpose(0, 1).view(torch.uint8))


def block_rows(block_index: torch.Tensor, heads: int, num_blocks: int) -> torch.Tensor:
    """Row ids, head by head, of the blocks of B block tables (B, blocks) in a head-major cache viewed
    as (heads * num_blocks, one block of one head)."""
    offsets = torch.arange(heads, device=block_index.device)[:, None] * num_blocks
    return (offsets + block_index.flatten()[None, :]).flatten()


def read_kv(cache: torch.Tensor, block_index: torch.Tensor, block_size: int, scale: float,
            dtype: torch.dtype, out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The blocks of B block tables (B, blocks) from a head-major cache (heads, slots, dim), as
    (heads, B, blocks * block_size, dim) in the compute dtype.

    One row gather from the cache viewed as a 2-D table of blocks (`rows` from block_rows, computed
    here when not given): on CPU that is ~2x faster than index_select along a middle dimension, and
    ~2x faster again into an existing buffer, which `out` (that shape, reused across layers) is when
    the cache is already in the compute dtype."""
    heads, slots, dim = cache.shape
    b, n = block_index.shape
    num_blocks = slots // block_size
    if rows is None:
        rows = block_rows(block_index, heads, num_blocks)
    raw = cache.view(torch.uint8) if is_fp8(cache.dtype) else cache  # fp8 gathered as bytes, like the write
    table = raw.view(heads * num_blocks, block_size * dim)
    shape = (heads, b, n * block_size, dim)
    if out is not None and cache.dtype == dtype:
        torch.index_select(table, 0, rows, out=out.view(heads * b * n, block_size * dim))
        return out.view(shape)
    gathered = table.index_select(0, rows).view(shape)
    return dequantize(gathered.view(cache.dtype), scale, dtype) if is_fp8(cache.dtype) else gathered.to(dtype)


def kv_scale_target(name: str) -> tuple[int, tuple[str, ...]] | None:
    """(layer, which of 'k'/'v') for a checkpoint's KV-cache scale tensor; None for any other tensor."""
    m = _SCALE_NAME.match(name)
    if m is None:
        return None
    return int(m.group(1)), ("k", "v") if m.group(2) == "kv" else (m.group(2),)


def scale_value(name: str, tensor: torch.Tensor) -> float:
    """A per-tensor scale as a float; per-head or invalid scales are refused."""
    if tensor.numel() != 1:
        raise ValueError(f"checkpoint tensor {name} holds {tensor.numel()} KV-cache scales; pagedllm supports "
                         f"one per tensor (shape [] or [1]).")
    value = float(tensor.reshape(()).float())
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"checkpoint tensor {name} is a KV-cache scale of {value}; it must be finite and > 0.")
    return value
