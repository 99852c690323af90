"""MXFP4 experts (OCP microscaling, as gpt-oss ships its experts): FP4 E2M1 values, two per byte (the low nibble
first), and per 32 values one E8M0 scale byte, 2^(byte - 127). weight = value * scale.

gpt-oss stores each layer's experts as `mlp.experts.gate_up_proj_blocks` (experts, 2 * width, hidden / 32, 16)
with `..._scales` (experts, 2 * width, hidden / 32), gate and up rows interleaved, and `down_proj_blocks` /
`down_proj_scales` over (experts, hidden, width): (out, in) per expert. A FusedMoE holds them as they are, rows
de-interleaved into [gate | up]: `w13_weight` (experts, 2 * width, hidden / 2) uint8 and `w13_scale` (experts,
2 * width, hidden / 32) uint8, `w2_weight` / `w2_scale` likewise, biases in the model's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.moe import FusedMoE, MoEMethod
from pagedllm.model_executor.quant.base import GEMV_MAX_ROWS
from pagedllm.model_executor.quant.packing import fp4_e2m1_pairs

MXFP4_BLOCK = 32
E8M0_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(rows, in / 2) bytes and (rows, in / 32) exponents -> (rows, in) weights in `dtype` (exact: every value is
    a power of two times an E2M1 value)."""
    rows = blocks.shape[0]
    values = fp4_e2m1_pairs(dtype, blocks.device)[blocks.long()].view(rows, -1, MXFP4_BLOCK)
    scale = torch.exp2(scales.to(torch.float32) - E8M0_BIAS).to(dtype)
    return (values * scale[..., None]).view(rows, -1)


def mxfp4_expert_bytes(num_experts: int, hidden: int, width: int) -> int:
    """Bytes of one layer's experts in MXFP4 (values and scales; biases not included)."""
    per_row_in = lambda cols: cols // 2 + cols // MXFP4_BLOCK  # noqa: E731
    return num_experts * (2 * width * per_row_in(hidden) + hidden * per_row_in(width))


class Mxfp4MoEMethod(MoEMethod):
    """The grouped experts (MoEMethod.apply): on a CPU in bf16 an expert with up to GEMV_MAX_ROWS tokens multiplies
    its stored bytes (quant_gemv.cpp's mxfp4_gemv; `kernels` set at load); otherwise its weights dequantized for
    its GEMMs, one matrix at a time."""

    name = "mxfp4"
    kernels = None

    def expert_forward(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
        b13 = None if layer.w13_bias is None else layer.w13_bias[expert]
        b2 = None if layer.w2_bias is None else layer.w2_bias[expert]
        if self.kernels is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" \
                and x.shape[0] <= GEMV_MAX_ROWS:
            h = self.kernels.mxfp4_gemv(x, layer.w13_weight[expert], layer.w13_scale[expert])
            h = layer.act_and_mul(h if b13 is None else h + b13)
            y = self.kernels.mxfp4_gemv(h, layer.w2_weight[expert], layer.w2_scale[expert])
            return y if b2 is None else y + b2
        w13 = self._dequantize(layer.w13_weight[expert], layer.w13_scale[expert], x)
        h = layer.act_and_mul(F.linear(x, w13, b13))
        del w13  # (one expert's weights widened at a time: the prefill's transient)
        return F.linear(h, self._dequantize(layer.w2_weight[expert], layer.w2_scale[expert], x), b2)

    def _dequantize(self, blocks: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One expert's weights in x's dtype: by quant_gemv.cpp's mxfp4_dequantize on a CPU in bf16 (no index
        temporaries), else by dequantize_mxfp4."""
        if self.kernels is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            return self.kernels.mxfp4_dequantize(blocks, scales)
        return dequantize_mxfp4(blocks, scales, x.dtype)


MXFP4_EXPERTS = Mxfp4MoEMethod()


def make_mxfp4_experts(moe: FusedMoE) -> None:
    """Give `moe` (still on the meta device) MXFP4 weights and scales in place of its dense ones."""
    e, h, w = moe.num_experts, moe.hidden_size, moe.width
    if h % MXFP4_BLOCK or w % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 experts need hidden ({h}) and width ({w}) in whole blocks of {MXFP4_BLOCK}")
    shapes = {"w13_weight": (e, 2 * w, h // 2), "w13_scale": (e, 2 * w, h // MXFP4_BLOCK),
              "w2_weight": (e, h, w // 2), "w2_scale": (e, h, w // MXFP4_BLOCK)}
    for name, shape in shapes.items():
        setattr(moe, name, nn.Parameter(torch.empty(shape, dtype=torch.uint8, device="meta"), requires_grad=False))
    moe.method = MXFP4_EXPERTS


def init_dummy_mxfp4(moe: FusedMoE, gen: torch.Generator) -> None:
    """Random codes, scales 2^-7: weights of std ~0.02 (E2M1 codes uniform: std ~3)."""
    for name in ("w13_weight", "w2_weight"):
        getattr(moe, name).random_(0, 256, generator=gen)
    for name in ("w13_scale", "w2_scale"):
        getattr(moe, name).fill_(E8M0_BIAS - 7)
