"""The dequant-GEMM Triton kernels (quant/triton_gemm.py) against the formats' PyTorch reference (dequantize() in
float32, then F.linear), run by Triton's interpreter on the CPU: int4 symmetric and with zero points (groups of 32,
128, a whole row; act-order through the caller's gather), fp8 per-row and block scales (128x128, and 32x32 for
tiny shapes, both with partial blocks), NVFP4 with its global scale multiplied and divided; in float32 to the
bound of a sum in another order, in bfloat16 within bf16 rounding; and the shapes no kernel takes: None.

Tolerances, elementwise, with mag = |x| @ |W|^T (the sum of the products' magnitudes) and u = 2^-24:
- float32: the kernel's weight tile is the reference's dequantized weight bit for bit (the same float32 operations
  in the same order), so only the order of the K-term sums differs. Any order of a K-term sum is within
  (K - 1) u mag of the exact sum (Higham, Accuracy and Stability of Numerical Algorithms, 3.1), so two orders
  differ by at most 2 (K - 1) u mag: ~1.2e-7 K relative to mag (1.5e-5 at K = 128, 4.6e-5 at K = 384; a wrong
  nibble, scale or zero shows as ~1e-2 of mag).
- bfloat16 (x and output in bf16) against float32 arithmetic on the same x: the weight tile is rounded to bf16
  and so is the output, each within a relative e of its value (bf16 has 8 significant bits: e = 2^-8 rounding to
  nearest, as on a GPU; 2^-7 under the interpreter, which truncates float32 -> bf16 casts), plus the float32
  sum's error: e (mag + |y|) + 2 K u mag, with a 1% margin for the second-order terms; and the error's norm
  under e of the output's (the roundings are not all on the bound).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pagedllm.model_executor.linear import Linear  # noqa: E402
from pagedllm.model_executor.quant import triton_gemm as tg  # noqa: E402
from pagedllm.model_executor.quant.base import LinearFormat, make_quantized  # noqa: E402
from pagedllm.model_executor.quant.fp8 import FP8_DTYPE, Fp8Format  # noqa: E402
from pagedllm.model_executor.quant.int4 import Int4Format  # noqa: E402
from pagedllm.model_executor.quant.nvfp4 import Nvfp4Format  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="set by tests/conftest.py wherever there is no GPU")

DEVICE = "cpu" if tg.INTERPRETED else "cuda"
U32 = 2.0 ** -24


def _layer(fmt: LinearFormat, out_features: int, in_features: int, dtype: torch.dtype = torch.float32,
           seed: int = 0, bias: bool = False) -> Linear:
    """A quantized Linear with random valid stored values: every int4 nibble and zero, every finite e4m3 code as
    an fp8 weight (subnormals and +-448 included), every E2M1 code with positive e4m3 block scales."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        layer = Linear(in_features, out_features, bias=bias).to(dtype)
    make_quantized(layer, fmt)
    layer.to_empty(device="cpu")
    if bias:
        layer.bias.requires_grad_(False).copy_(torch.randn(out_features, generator=gen).to(dtype))
    if isinstance(fmt, Int4Format):
        layer.weight.random_(0, 256, generator=gen)
        layer.weight_scale.copy_((torch.rand(layer.weight_scale.shape, generator=gen) * 0.02 + 0.001).to(dtype))
        if not fmt.symmetric:
            layer.weight_zero.random_(0, 256, generator=gen)
    elif isinstance(fmt, Fp8Format):
        codes = torch.randint(0, 254, layer.weight.shape, generator=gen, dtype=torch.int32)
        codes = codes + (codes >= 0x7F).int()  # 0..254 but 0x7f: no NaN (0xff, the other, is past the range)
        layer.weight.view(torch.uint8).copy_(codes.to(torch.uint8))
        layer.weight_scale.copy_(torch.rand(layer.weight_scale.shape, generator=gen) * 1e-3 + 1e-5)
    else:
        layer.weight.random_(0, 256, generator=gen)
        layer.weight_scale.view(torch.uint8).copy_(torch.randint(0x18, 0x50, layer.weight_scale.shape,
                                                                 generator=gen).to(torch.uint8))
        layer.weight_global.copy_(torch.rand(out_features, generator=gen) * 1.5 + 0.5)
    return layer.to(DEVICE)


def _weight(layer: Linear) -> torch.Tensor:
    return layer.quant_format.dequantize(layer, 0, layer.out_features, torch.float32)


def _x(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _check_float32(layer: Linear, rows: int, seed: int) -> None:
    x = _x(rows, layer.in_features, seed)
    w = _weight(layer)
    got = tg.triton_gemm(layer, x)
    assert got is not None and got.dtype == torch.float32 and got.shape == (rows, layer.out_features)
    want = F.linear(x, w)
    mag = x.abs() @ w.abs().T
    bound = 2 * (layer.in_features - 1) * U32 * mag
    err = (got - want).abs()
    assert bool((err <= bound).all()), (err / mag).max().item()


@pytest.mark.parametrize("rows", [3, 70])
@pytest.mark.parametrize("group, symmetric, out_features, in_features", [
    (32, True, 72, 128), (32, False, 72, 128), (128, True, 40, 384), (128, False, 40, 384), (None, False, 24, 96)])
def test_int4_equals_the_reference_in_float32(group, symmetric, out_features, in_features, rows):
    """Groups of 32 (K tiles of 32), 128 (two K tiles per group; three groups: a zero byte's high nibble unused),
    a whole row of 96 (tiles of 32); out not a multiple of BLOCK_N, rows over one or two BLOCK_M tiles."""
    layer = _layer(Int4Format("gptq", group, symmetric), out_features, in_features, seed=in_features + rows)
    _check_float32(layer, rows, seed=rows)


@pytest.mark.parametrize("rows", [3, 70])
@pytest.mark.parametrize("block, out_features, in_features", [
    (None, 72, 100), ((32, 32), 72, 80), ((128, 128), 136, 288), ((16, 48), 40, 112)])
def test_fp8_equals_the_reference_in_float32(block, out_features, in_features, rows):
    """Per-row scales (K = 100: a partial last tile), 32x32 and 128x128 blocks with partial row and column blocks
    at the ends, a 16x48 block (tiles of 16 columns, a tile of rows across several row blocks)."""
    layer = _layer(Fp8Format(block=block), out_features, in_features, seed=in_features + rows)
    _check_float32(layer, rows, seed=rows)


@pytest.mark.parametrize("rows", [3, 70])
@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("in_features", [96, 128])
def test_nvfp4_equals_the_reference_in_float32(layout, in_features, rows):
    """The global scale multiplied (ModelOpt) and divided (compressed-tensors); K tiles of 32 and 64 (two and four
    blocks of 16 each)."""
    fmt = Nvfp4Format(layout)
    assert fmt.divides == (layout == "compressed-tensors")
    layer = _layer(fmt, 72, in_features, seed=in_features + rows)
    _check_float32(layer, rows, seed=rows)


def test_e4m3_and_e2m1_decode_every_code():
    """Every finite e4m3 byte as an fp8 weight, every E2M1 code, through the kernels: x = I picks W^T out exactly
    (one nonzero product per sum), so the product is the reference's dequantized weight bit for bit."""
    fp8 = _layer(Fp8Format(), 254, 16)
    codes = torch.arange(255, dtype=torch.uint8)
    codes = codes[codes != 0x7F]
    fp8.weight.view(torch.uint8).copy_(codes[:, None].expand(254, 16).to(DEVICE))
    fp8.weight_scale.fill_(1.0)
    assert torch.equal(tg.triton_gemm(fp8, torch.eye(16, device=DEVICE)), _weight(fp8).T)
    nv = _layer(Nvfp4Format("modelopt"), 16, 32)
    nv.weight.copy_(torch.arange(256, dtype=torch.uint8).view(16, 16).to(DEVICE))
    nv.weight_global.fill_(1.0)
    assert torch.equal(tg.triton_gemm(nv, torch.eye(32, device=DEVICE)), _weight(nv).T)


def test_act_order_and_bias_are_the_callers():
    """A layer with act-order and a bias: the kernel on x gathered by input_perm, plus the bias, is the layer's
    reference forward (DequantLinearMethod.apply)."""
    layer = _layer(Int4Format("gptq", 32, False, act_order=True), 40, 128, seed=5, bias=True)
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    layer.input_perm.copy_(perm.to(DEVICE))
    x = _x(9, 128, seed=2)
    got = tg.triton_gemm(layer, x.index_select(1, layer.input_perm)) + layer.bias
    want = layer(x)
    w = _weight(layer)
    mag = x.index_select(1, layer.input_perm).abs() @ w.abs().T + layer.bias.abs()
    assert bool(((got - want).abs() <= 2 * 128 * U32 * mag).all())


@pytest.mark.parametrize("fmt", [Int4Format("awq", 32, False), Fp8Format(block=(32, 32)), Nvfp4Format("modelopt")],
                         ids=["int4", "fp8-block", "nvfp4"])
def test_bfloat16_within_bf16_rounding(fmt):
    """bf16 x, scales (int4's) and output, against float32 arithmetic on the same x and stored values."""
    layer = _layer(fmt, 72, 128, dtype=torch.bfloat16, seed=11)
    x = _x(19, 128, seed=4, dtype=torch.bfloat16)
    got = tg.triton_gemm(layer, x)
    assert got is not None and got.dtype == torch.bfloat16
    w = _weight(layer)
    truth = F.linear(x.float(), w)
    mag = x.float().abs() @ w.abs().T
    e = 2.0 ** (-7 if tg.INTERPRETED else -8)
    bound = 1.01 * (e * (mag + truth.abs()) + 2 * 128 * U32 * mag)
    err = (got.float() - truth).abs()
    assert bool((err <= bound).all()), (err / (mag + truth.abs())).max().item()
    assert (got.float() - truth).norm() < e * truth.norm(), ((got.float() - truth).norm() / truth.norm()).item()


def test_what_no_kernel_takes_is_none(monkeypatch):
    int4 = _layer(Int4Format("gptq", 32, True), 16, 64)
    x = _x(4, 64, seed=0)
    assert tg.triton_gemm(int4, x) is not None
    assert tg.triton_gemm(int4, x.double()) is None  # not fp16 / bf16 / fp32
    assert tg.triton_gemm(int4, x[:, :32]) is None  # not in_features columns
    assert tg.triton_gemm(int4, x[None]) is None  # not 2-D
    assert tg.triton_gemm(int4, x[:0]).shape == (0, 16)  # no rows: an empty product, no launch
    # groups / blocks of columns not made of 16: no K tile for tl.dot inside them
    assert tg.triton_gemm(_layer(Int4Format("gptq", 8, True), 16, 64), x) is None
    assert tg.triton_gemm(_layer(Int4Format("gptq", None, False), 16, 40), _x(4, 40, seed=0)) is None
    assert tg.triton_gemm(_layer(Fp8Format(block=(16, 24)), 16, 64), x) is None
    plain = Linear(64, 16, bias=False).to(DEVICE)  # not quantized
    assert tg.triton_gemm(plain, x) is None
    with pytest.raises(ValueError):
        tg.int4_gemm(x, _layer(Int4Format("gptq", 8, True), 16, 64), Int4Format("gptq", 8, True))
    if tg.INTERPRETED:  # CPU tensors only under the interpreter
        monkeypatch.setattr(tg, "INTERPRETED", False)
        assert tg.triton_gemm(int4, x) is None
