"""The CPU kernels that read stored int4 weights (cpu_kernels/quant_gemv.cpp) against the formats' PyTorch
reference (quant/int4.py): the dequantized bf16 tiles bit for bit, the decode product within bf16 rounding of its
arithmetic (the fp32 product by the same weights; with int8 activations on VNNI CPUs, that product with x quantized
per group); and a Linear through the kernels against the reference at every batch size."""
from __future__ import annotations

import pytest
import torch

from pagedllm.model_executor.cpu_isa import cpu_kernels
from pagedllm.model_executor.linear import Linear
from pagedllm.model_executor.quant.base import GEMV_MAX_ROWS, DequantLinearMethod, make_quantized
from pagedllm.model_executor.quant.fp8 import Fp8Format
from pagedllm.model_executor.quant.int4 import Int4Format
from pagedllm.model_executor.quant.mxfp4 import dequantize_mxfp4

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the native CPU kernels do not build here")


def _int4_layer(out_features: int, in_features: int, group: int, symmetric: bool, seed: int) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        layer = Linear(in_features, out_features, bias=False).to(torch.bfloat16)
    fmt = Int4Format("gptq", group, symmetric)
    make_quantized(layer, fmt)
    layer.to_empty(device="cpu")
    layer.weight.random_(0, 256, generator=gen)
    layer.weight_scale.copy_((torch.rand(layer.weight_scale.shape, generator=gen) * 0.02 + 0.001).to(torch.bfloat16))
    if not symmetric:
        layer.weight_zero.random_(0, 256, generator=gen)
    return layer


def _reference_weight(layer: Linear, dtype: torch.dtype) -> torch.Tensor:
    fmt = layer.quant_format
    kernels, fmt.kernels = fmt.kernels, None
    try:
        return fmt.dequantize(layer, 0, layer.out_features, dtype)
    finally:
        fmt.kernels = kernels


@pytest.mark.parametrize("group, symmetric", [(32, True), (64, False), (128, True), (128, False)])
def test_dequantized_tiles_equal_the_reference_bit_for_bit(group, symmetric):
    layer = _int4_layer(96, 512, group, symmetric, seed=group)
    layer.quant_format.kernels = cpu_kernels()
    tile = cpu_kernels().int4_dequantize(layer.weight, layer.weight_scale, getattr(layer, "weight_zero", None), 16, 80)
    assert torch.equal(tile, _reference_weight(layer, torch.bfloat16)[16:80])


def _int8_activation_product(layer: Linear, x: torch.Tensor, group: int) -> torch.Tensor:
    """The VNNI path's arithmetic in float64: x quantized per group to int8 (absmax / 127, round half to even),
    then sum_g scale_g * x_scale_g * sum_i (q_i - zero_g) xq_i."""
    xf = x.double().view(x.shape[0], -1, group)
    x_scale = xf.abs().amax(dim=-1, keepdim=True) / 127
    xq = torch.where(x_scale > 0, torch.round(xf / x_scale), torch.zeros_like(xf))
    w = _reference_weight(layer, torch.float64).view(layer.out_features, -1, group)  # (q - zero) * scale
    return torch.einsum("mgi,ngi,mg->mn", xq, w, x_scale[..., 0])


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("group, symmetric", [(32, False), (64, True), (128, False), (256, True)])
def test_decode_product_equals_its_arithmetic_within_bf16_rounding(rows, group, symmetric):
    """Each path against its own arithmetic: bf16 and float paths the fp32 product by the dequantized weights; the
    VNNI path (groups of 128+ columns, int8 activations) that product with x quantized per group, which is itself
    within 2% (relative norm) of the fp32 product. Tolerance: one bf16 rounding of the output, fp32 sums."""
    layer = _int4_layer(200, 1024, group, symmetric, seed=rows)
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    got = cpu_kernels().int4_gemv(x, layer.weight, layer.weight_scale, getattr(layer, "weight_zero", None)).double()
    exact = x.double() @ _reference_weight(layer, torch.float64).T
    path = cpu_kernels().int4_gemv_path(group)
    want = _int8_activation_product(layer, x, group) if path == "vnni" else exact
    assert torch.allclose(got, want, rtol=2 ** -8, atol=1e-3 * want.abs().max().item()), path
    assert (got - exact).norm() < 0.02 * exact.norm(), path


def test_a_layer_multiplies_through_the_kernels_at_every_batch():
    """Through the Linear: up to GEMV_MAX_ROWS rows the gemv, more the dequantized tiles; act-order inputs permuted."""
    layer = _int4_layer(256, 512, 64, False, seed=3)
    perm = torch.randperm(512, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    layer.register_parameter("input_perm", torch.nn.Parameter(perm, requires_grad=False))
    assert isinstance(layer.method, DequantLinearMethod)
    for rows in (1, 8, 9, 40):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        layer.quant_format.kernels = None
        want = layer(x).double()
        layer.quant_format.kernels = cpu_kernels()
        got = layer(x).double()
        assert (got - want).norm() < 0.02 * want.norm(), rows
        if rows > GEMV_MAX_ROWS:  # dequantized tiles: the same bf16 weights, the same GEMM
            assert torch.equal(got, want), rows


def _fp8_layer(out_features: int, in_features: int, block, seed: int) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        layer = Linear(in_features, out_features, bias=False).to(torch.bfloat16)
    make_quantized(layer, Fp8Format(block=block))
    layer.to_empty(device="cpu")
    codes = torch.randint(0, 256, layer.weight.shape, generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x10  # (no NaN codes: a checkpoint holds none)
    layer.weight.copy_(codes.view(torch.float8_e4m3fn))
    layer.weight_scale.copy_(torch.rand(layer.weight_scale.shape, generator=gen) * 1e-3 + 1e-4)
    return layer


@pytest.mark.parametrize("block", [None, (128, 128), (32, 48)])
def test_fp8_tiles_and_decode_product_equal_the_reference(block):
    """Every e4m3 code: the bf16 tiles bit for bit (subnormals included), the decode product within bf16 rounding of
    the fp32 product by the same weights (K = 200: a tail past whole 16s and 32s; on the bf16 dot-product path a
    subnormal e4m3, |value| < 2^-6, counts as zero: within the same bound)."""
    layer = _fp8_layer(160, 200, block, seed=5)
    args = (1, 0) if block is None else block
    tile = cpu_kernels().fp8_dequantize(layer.weight, layer.weight_scale, *args, 32, 160)
    assert torch.equal(tile, _reference_weight(layer, torch.bfloat16)[32:160])
    for rows in (1, 4, 8):
        x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        got = cpu_kernels().fp8_gemv(x, layer.weight, layer.weight_scale, *args).double()
        want = x.double() @ _reference_weight(layer, torch.float64).T
        assert torch.allclose(got, want, rtol=2 ** -8, atol=1e-3 * want.abs().max().item()), rows


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("n, k", [(96, 256), (40, 96)])  # (K = 96: blocks of 32 bytes and a last block of 16)
def test_mxfp4_decode_product_equals_the_fp32_product_within_bf16_rounding(rows, n, k):
    """gpt-oss' experts read as stored (E2M1 codes and E8M0 scales per 32): within one bf16 rounding of the output
    of the fp32 product by the dequantized weights (quant/mxfp4.py's reference)."""
    gen = torch.Generator().manual_seed(rows)
    blocks = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 130, (n, k // 32), generator=gen, dtype=torch.uint8)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    got = cpu_kernels().mxfp4_gemv(x, blocks, scales).double()
    want = x.double() @ dequantize_mxfp4(blocks, scales, torch.float64).T
    assert torch.allclose(got, want, rtol=2 ** -8, atol=1e-3 * want.abs().max().item())


def test_mxfp4_tiles_equal_the_reference_bit_for_bit():
    """A prefill's widened experts (quant_gemv.cpp's mxfp4_dequantize): every code at scales from 2^-20 to 2^20,
    equal to quant/mxfp4.py's reference in bfloat16."""
    gen = torch.Generator().manual_seed(3)
    blocks = torch.arange(256, dtype=torch.uint8).repeat(48, 1)[:, torch.randperm(256, generator=gen)[:144]]
    blocks = blocks.contiguous()
    scales = torch.randint(107, 148, (48, 9), generator=gen, dtype=torch.uint8)
    assert torch.equal(cpu_kernels().mxfp4_dequantize(blocks, scales), dequantize_mxfp4(blocks, scales, torch.bfloat16))
