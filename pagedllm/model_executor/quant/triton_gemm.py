"""Products by quantized weights on CUDA: Triton dequant-GEMM kernels, y = x @ W^T for the formats' stored
bytes (int4 with or without zero points, fp8 with per-row or block scales, NVFP4), W never dequantized whole.

Each program computes a BLOCK_M x BLOCK_N tile of y, walking K a BLOCK_K tile at a time: it loads its rows of x,
the weight's bytes and scales for that K tile, dequantizes them in float32 in the order the format's dequantize()
does (so the tile equals that reference's weights in x's dtype, bit for bit on a GPU), casts the tile to x's
dtype and accumulates tl.dot in float32; y is written in x's dtype. K tiles lie inside one of the format's groups
(int4) or column blocks (fp8), so a tile needs one scale per row; NVFP4's blocks of 16 are reshaped inside a tile.
fp8 and E2M1 bytes are decoded with integer ops and an fp16 bitcast (exact, and on any GPU: no fp8 hardware
conversion). The bias is the caller's to add, as is an act-order layer's input permutation (x arrives gathered).

Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (how CI tests them); there 16-bit tl.dot operands are
multiplied as float32 (the interpreter's 16-bit dot is wrong; the values are exact in float32). Without triton,
triton_gemm() returns None.
"""
from __future__ import annotations

import math
import os

import torch

from pagedllm.model_executor.linear import Linear
from pagedllm.model_executor.quant.base import LinearFormat
from pagedllm.model_executor.quant.fp8 import FP8_DTYPE, Fp8Format
from pagedllm.model_executor.quant.int4 import Int4Format
from pagedllm.model_executor.quant.nvfp4 import NVFP4_BLOCK, Nvfp4Format
from pagedllm.utils import cdiv

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: nothing here runs, triton_gemm() says so with None
    triton = tl = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = triton is not None
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The largest K tile; a format's tile is the largest power of two up to this that its group / block is made of.
MAX_BLOCK_K = 64
MIN_BLOCK_K = 16  # tl.dot's least K
BLOCK_N = 64
_SYMMETRIC_ZERO = 8


def _jit(fn):
    return triton.jit(fn) if HAVE_TRITON else fn


# -- device helpers -----------------------------------------------------------------------------------------------
@_jit
def _e4m3_to_f32(b):
    """float8_e4m3fn bytes (read as uint8) -> float32, exactly: sign, exponent and mantissa moved into an fp16's
    bits (whose exponent bias, 15, is 8 more than e4m3's) scaled back by 2^8; subnormals land on fp16 subnormals.
    (The NaN code 0x7f reads as 480: checkpoints hold none.)"""
    u = b.to(tl.uint16)
    h = ((u & 0x80) << 8) | ((u & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@_jit
def _e2m1_to_f32(c):
    """E2M1 codes (0..15) -> float32, exactly: into an fp16's bits (bias 15 vs 1) scaled back by 2^14."""
    u = c.to(tl.uint16)
    h = ((u & 0x8) << 12) | ((u & 0x7) << 9)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@_jit
def accumulate_dot(acc, x, w, IEEE: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + x @ w in float32 (x and w in the activations' dtype; fp32 operands exactly, and 16-bit ones as fp32
    under the interpreter, whose 16-bit dot is wrong). The fused-MoE kernel's products too."""
    if IEEE:
        acc += tl.dot(x, w, input_precision="ieee")
    elif DOT_FP32:
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        acc += tl.dot(x, w)
    return acc


# -- kernels ------------------------------------------------------------------------------------------------------
@_jit
def _output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows of x and columns of the output (int64 offsets), and which lie inside (M, N)."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows.to(tl.int64), cols.to(tl.int64), rows < M, cols < N


@_jit
def _store(out_ptr, acc, rows64, cols64, row_ok, col_ok, stride_om):
    tl.store(out_ptr + rows64[:, None] * stride_om + cols64[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@_jit
def _int4_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """out = x @ ((q - zero) * scale)^T; q: (N, K / 2) bytes, column 2j in byte j's low nibble; a K tile lies in
    one group (GROUP % BLOCK_K == 0, K % GROUP == 0)."""
    rows64, cols64, row_ok, col_ok = _output_tile(M, N, BLOCK_M, BLOCK_N)
    half = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None], other=0.0)
        b = tl.load(w_ptr + cols64[:, None] * stride_wn + (k0 // 2 + half)[None, :], mask=col_ok[:, None], other=0)
        q = tl.interleave(b & 0xF, b >> 4).to(tl.float32)  # (BLOCK_N, BLOCK_K): the low nibble first
        g = k0 // GROUP
        s = tl.load(scale_ptr + cols64 * stride_sn + g, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            zb = tl.load(zero_ptr + cols64 * stride_zn + g // 2, mask=col_ok, other=0).to(tl.int32)
            z = ((zb >> ((g % 2) * 4)) & 0xF).to(tl.float32)
            w = (q - z[:, None]) * s[:, None]
        else:
            w = (q - 8.0) * s[:, None]
        acc = accumulate_dot(acc, x, tl.trans(w.to(x.dtype)), IEEE, DOT_FP32)
    _store(out_ptr, acc, rows64, cols64, row_ok, col_ok, stride_om)


@_jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """out = x @ (fp8 * scale)^T; w: (N, K) e4m3 bytes. SCALE_ROWS 0: a scale per row, (N,); else a block
    scale per SCALE_ROWS x SCALE_COLS, (cdiv(N, SCALE_ROWS), cdiv(K, SCALE_COLS)), a K tile inside one block
    column (SCALE_COLS % BLOCK_K == 0). K need not be a multiple of anything (the last tile is masked)."""
    rows64, cols64, row_ok, col_ok = _output_tile(M, N, BLOCK_M, BLOCK_N)
    if SCALE_ROWS == 0:
        s = tl.load(scale_ptr + cols64, mask=col_ok, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w_ptr + cols64[:, None] * stride_wn + kk[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0)
        if SCALE_ROWS != 0:
            s = tl.load(scale_ptr + (cols64 // SCALE_ROWS) * stride_sn + k0 // SCALE_COLS, mask=col_ok, other=0.0)
        w = _e4m3_to_f32(b) * s[:, None]
        acc = accumulate_dot(acc, x, tl.trans(w.to(x.dtype)), IEEE, DOT_FP32)
    _store(out_ptr, acc, rows64, cols64, row_ok, col_ok, stride_om)


@_jit
def _nvfp4_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, global_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    DIVIDES: tl.constexpr, FP4_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """out = x @ (value * (scale / global or scale * global))^T; w: (N, K / 2) E2M1 codes, the low nibble first;
    scale: (N, K / FP4_BLOCK) e4m3 bytes; K % BLOCK_K == 0 and BLOCK_K % FP4_BLOCK == 0."""
    rows64, cols64, row_ok, col_ok = _output_tile(M, N, BLOCK_M, BLOCK_N)
    half = tl.arange(0, BLOCK_K // 2)
    blocks = tl.arange(0, BLOCK_K // FP4_BLOCK)
    g = tl.load(global_ptr + cols64, mask=col_ok, other=1.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None], other=0.0)
        b = tl.load(w_ptr + cols64[:, None] * stride_wn + (k0 // 2 + half)[None, :], mask=col_ok[:, None], other=0)
        v = tl.interleave(_e2m1_to_f32(b & 0xF), _e2m1_to_f32(b >> 4))  # (BLOCK_N, BLOCK_K)
        sb = tl.load(scale_ptr + cols64[:, None] * stride_sn + (k0 // FP4_BLOCK + blocks)[None, :],
                     mask=col_ok[:, None], other=0)
        s = _e4m3_to_f32(sb)
        if DIVIDES:
            s = tl.div_rn(s, g[:, None])  # (correctly rounded, as torch's: `/` may be approximate on a GPU)
        else:
            s = s * g[:, None]
        w = tl.reshape(tl.reshape(v, (BLOCK_N, BLOCK_K // FP4_BLOCK, FP4_BLOCK)) * s[:, :, None],
                       (BLOCK_N, BLOCK_K))
        acc = accumulate_dot(acc, x, tl.trans(w.to(x.dtype)), IEEE, DOT_FP32)
    _store(out_ptr, acc, rows64, cols64, row_ok, col_ok, stride_om)


# -- launchers ----------------------------------------------------------------------------------------------------
def _block_k(span: int) -> int | None:
    """The K tile for groups / blocks of `span` columns: the largest power of two up to MAX_BLOCK_K dividing it,
    None when that is under tl.dot's least K."""
    tile = math.gcd(span, MAX_BLOCK_K)
    return tile if tile >= MIN_BLOCK_K else None


def _block_m(rows: int) -> int:
    return 16 if rows <= 16 else (32 if rows <= 32 else 64)


def _row_major(*tensors: torch.Tensor) -> bool:
    return all(t.stride(-1) == 1 for t in tensors)


def _int4_block_k(layer: Linear, fmt: Int4Format) -> int | None:
    k, n = layer.in_features, layer.out_features
    group = fmt.group_size or k
    zero = getattr(layer, "weight_zero", None)
    if (k % group or k % 2 or layer.weight.shape != (n, k // 2) or layer.weight.dtype != torch.uint8
            or layer.weight_scale.shape != (n, k // group) or fmt.symmetric != (zero is None)
            or not _row_major(layer.weight, layer.weight_scale, *(() if zero is None else (zero,)))):
        return None
    return _block_k(group)


def _fp8_block_k(layer: Linear, fmt: Fp8Format) -> int | None:
    n, k = layer.out_features, layer.in_features
    scale = layer.weight_scale
    if (layer.weight.shape != (n, k) or layer.weight.dtype != FP8_DTYPE or scale.dtype != torch.float32
            or not _row_major(layer.weight, scale)):
        return None
    if fmt.block is None:
        return MAX_BLOCK_K if scale.shape == (n,) and scale.is_contiguous() else None
    bn, bk = fmt.block
    if bn < 1 or scale.shape != (cdiv(n, bn), cdiv(k, bk)):
        return None
    return _block_k(bk)


def _nvfp4_block_k(layer: Linear, fmt: Nvfp4Format) -> int | None:
    n, k = layer.out_features, layer.in_features
    if (k % NVFP4_BLOCK or layer.weight.shape != (n, k // 2) or layer.weight.dtype != torch.uint8
            or layer.weight_scale.shape != (n, k // NVFP4_BLOCK) or layer.weight_scale.dtype != FP8_DTYPE
            or layer.weight_global.shape != (n,) or not layer.weight_global.is_contiguous()
            or not _row_major(layer.weight, layer.weight_scale)):
        return None
    return _block_k(k)


def _prepare(x: torch.Tensor, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """x with unit column stride, the output, and the launch's shared arguments."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], layer.out_features
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = _block_m(m)
    common = dict(BLOCK_M=block_m, BLOCK_N=BLOCK_N, IEEE=x.dtype == torch.float32,
                  DOT_FP32=INTERPRETED and x.dtype != torch.float32)
    return x, out, common


def _launch(kernel, x: torch.Tensor, layer: Linear, block_k: int, tensors: tuple, strides: tuple,
            **consts) -> torch.Tensor:
    """One format's kernel over x: its arguments are x, `tensors`, the output, m, n, k, x's row stride, `strides`,
    the output's row stride, then the constants."""
    x, out, common = _prepare(x, layer)
    m, n, k = x.shape[0], layer.out_features, layer.in_features
    kernel[_grid(m, n, common["BLOCK_M"])](x, *tensors, out, m, n, k, x.stride(0), *strides, out.stride(0),
                                           BLOCK_K=block_k, **consts, **common)
    return out


def _grid(m: int, n: int, block_m: int) -> tuple[int, int]:
    return cdiv(n, BLOCK_N), cdiv(m, block_m)


def _refuse(name: str, layer: Linear) -> ValueError:
    return ValueError(f"the {name} Triton GEMM does not take this layer ({layer.out_features}, "
                      f"{layer.in_features}) with {layer.quant_format.describe()}")


def int4_gemm(x: torch.Tensor, layer: Linear, fmt: Int4Format) -> torch.Tensor:
    """x (M, in) @ W^T of an int4 layer, (M, out) in x's dtype; x already gathered by the layer's input_perm."""
    block_k = _int4_block_k(layer, fmt)
    if block_k is None:
        raise _refuse("int4", layer)
    zero = getattr(layer, "weight_zero", None)
    return _launch(_int4_gemm_kernel, x, layer, block_k,
                   (layer.weight, layer.weight_scale, layer.weight if zero is None else zero),
                   (layer.weight.stride(0), layer.weight_scale.stride(0), 0 if zero is None else zero.stride(0)),
                   GROUP=fmt.group_size or layer.in_features, HAS_ZERO=zero is not None)


def fp8_gemm(x: torch.Tensor, layer: Linear, fmt: Fp8Format) -> torch.Tensor:
    """x (M, in) @ W^T of an fp8 layer (per-row or block scales), (M, out) in x's dtype."""
    block_k = _fp8_block_k(layer, fmt)
    if block_k is None:
        raise _refuse("fp8", layer)
    scale = layer.weight_scale
    rows, cols = (0, 1) if fmt.block is None else fmt.block
    return _launch(_fp8_gemm_kernel, x, layer, block_k, (layer.weight.view(torch.uint8), scale),
                   (layer.weight.stride(0), scale.stride(0) if scale.dim() == 2 else 0),
                   SCALE_ROWS=rows, SCALE_COLS=cols)


def nvfp4_gemm(x: torch.Tensor, layer: Linear, fmt: Nvfp4Format) -> torch.Tensor:
    """x (M, in) @ W^T of an NVFP4 layer, (M, out) in x's dtype."""
    block_k = _nvfp4_block_k(layer, fmt)
    if block_k is None:
        raise _refuse("nvfp4", layer)
    return _launch(_nvfp4_gemm_kernel, x, layer, block_k,
                   (layer.weight, layer.weight_scale.view(torch.uint8), layer.weight_global),
                   (layer.weight.stride(0), layer.weight_scale.stride(0)), DIVIDES=fmt.divides, FP4_BLOCK=NVFP4_BLOCK)


_KERNELS = ((Int4Format, _int4_block_k, int4_gemm), (Fp8Format, _fp8_block_k, fp8_gemm),
            (Nvfp4Format, _nvfp4_block_k, nvfp4_gemm))


def triton_gemm(layer: Linear, x2d: torch.Tensor) -> torch.Tensor | None:
    """x2d (M, in) @ W^T of a quantized Linear through its format's kernel, (M, out) in x2d's dtype, no bias;
    x2d already gathered by an act-order layer's input_perm. None where no kernel takes it: triton missing, a
    tensor not on CUDA (on the CPU under TRITON_INTERPRET=1), x2d not 2-D fp16 / bf16 / fp32 of in_features
    columns, a format without a kernel here, or a shape or layout its kernel does not take (int4 groups and fp8
    block columns of a multiple of 16 columns; NVFP4 rows of a multiple of 16)."""
    fmt: LinearFormat | None = getattr(layer, "quant_format", None)
    weight = getattr(layer, "weight", None)
    if not HAVE_TRITON or fmt is None or weight is None:
        return None
    if x2d.dim() != 2 or x2d.dtype not in ACT_DTYPES or x2d.shape[1] != layer.in_features:
        return None
    device = x2d.device
    if weight.device != device or not (device.type == "cuda" or (INTERPRETED and device.type == "cpu")):
        return None
    for fmt_type, block_k, gemm in _KERNELS:
        if type(fmt) is fmt_type:
            if block_k(layer, fmt) is None:
                return None
            if x2d.shape[0] == 0:
                return x2d.new_empty(0, layer.out_features)
            return gemm(x2d, layer, fmt)
    return None
