"""Weight-only int8 (`--quantization int8`): symmetric, one scale per output channel. (`--quantization fp8` goes
through the same walk: quant/fp8.py's quantize_linear_fp8.)

Every Linear of the decoder layers (fused qkv, o_proj, fused gate_up, down_proj) is quantized at
load from the 16/32-bit weights: scale = absmax(row) / 127, weight = round(w / scale) in [-127, 127].
Activations stay in the model dtype. The embeddings and the LM head stay in the model dtype (vLLM's
default too: they are a small share of the bytes of all but the smallest models, and the LM head's
error would reach every logit directly).
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import QUANTIZE_AT_LOAD
from pagedllm.model_executor.linear import Linear, LinearMethod

INT8_MAX = 127
# torch._weight_int8pack_mm (CPU) is a row-by-row kernel. At the Qwen2.5-0.5B shapes on this
# project's CPU machine it beats bf16 (oneDNN-packed) at 1 row by 1.0-2.0x, and dequantize-then-GEMM
# up to 12-16 rows; at 64 rows it is 3-4x slower than dequantize-then-GEMM.
INT8PACK_MAX_ROWS = 8
# Its bf16 kernel reads K in blocks of 16: other K crash or return garbage (torch 2.13, measured).
INT8PACK_K_MULTIPLE = 16


# Checkpoint names of the weights quantize_model quantizes: every projection of every decoder layer
# (self_attn.q_proj, mlp.down_proj, and a dual-FFN model's audio_mlp.gate_proj alike).
_QUANTIZED_WEIGHT_NAME = re.compile(r"^model\.layers\.\d+\.(?:[a-z_]+\.)+[a-z_]+_proj\.weight$")


def is_quantized_weight_name(name: str) -> bool:
    return _QUANTIZED_WEIGHT_NAME.match(name) is not None


def int8_weight_bytes(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    """Bytes one quantized weight takes: int8 values plus one scale per row in the model dtype."""
    return out_features * in_features + out_features * dtype.itemsize


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype,
                  row_absmax=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) weight -> (int8 weight (out, in), scale (out,) in `scale_dtype`).

    The int8 values are rounded against the scale as stored in `scale_dtype`, so dequantizing
    (q * scale) is within scale / 2 of the original for every element. `row_absmax` (a function of the
    local absmax): the whole row's, when `weight` is one tensor-parallel rank's columns of it.
    """
    w = weight.detach().to(torch.float32)
    absmax = w.abs().amax(dim=1)
    if row_absmax is not None:
        absmax = row_absmax(absmax)
    scale = (absmax / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny).to(scale_dtype)
    q = torch.round(w / scale.to(torch.float32)[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


class Int8LinearMethod(LinearMethod):
    """A Linear whose weight is int8 (out, in) with per-output-channel scales (`weight_scale`, (out,)); computes in
    the input's dtype."""

    name = "int8"

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, layer.in_features)
        out = self._int8pack(layer, x2d) if self._int8pack_applies(layer, x2d) else self._generic(layer, x2d)
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*x.shape[:-1], layer.out_features)

    @staticmethod
    def _int8pack_applies(layer, x2d: torch.Tensor) -> bool:
        return (x2d.device.type == "cpu" and x2d.dtype == torch.bfloat16 == layer.weight_scale.dtype
                and x2d.shape[0] <= INT8PACK_MAX_ROWS and layer.in_features % INT8PACK_K_MULTIPLE == 0)

    @staticmethod
    def _int8pack(layer, x2d: torch.Tensor) -> torch.Tensor:
        """CPU bf16 fast path: the int8 weight is read as is, never widened in memory."""
        return torch._weight_int8pack_mm(x2d.contiguous(), layer.weight, layer.weight_scale)

    @staticmethod
    def _generic(layer, x2d: torch.Tensor) -> torch.Tensor:
        """Any device and dtype: widen the int8 weight (exact in 16 bits), multiply, then scale."""
        return F.linear(x2d, layer.weight.to(x2d.dtype)) * layer.weight_scale.to(x2d.dtype)


INT8 = Int8LinearMethod()


def quantize_linear(layer: Linear, row_absmax=None) -> None:
    """Replace `layer`'s weight by its int8 form and scales, and its method by INT8."""
    q, scale = quantize_int8(layer.weight, layer.weight.dtype, row_absmax)
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale, requires_grad=False)
    layer.method = INT8


def quantize_model(model: nn.Module, method: str) -> int:
    """Quantize every Linear inside the decoder layers to `method` (int8 here; fp8: quant/fp8.py). Returns how
    many. Under tensor parallelism a row-parallel Linear (o_proj, down_proj) holds some columns of each row: its
    ranks agree on the whole row's absmax (one all-reduce), so the scales are those of one device."""
    from pagedllm.distributed.parallel_state import tp_group
    from pagedllm.distributed.sharding import ROW_PARALLEL
    from pagedllm.model_executor.quant.fp8 import quantize_linear_fp8

    if method not in QUANTIZE_AT_LOAD:
        raise ValueError(f"quantization at load must be one of {', '.join(QUANTIZE_AT_LOAD)} or None; got {method!r}.")
    quantize = quantize_linear if method == "int8" else quantize_linear_fp8
    tp = tp_group()
    count = 0
    for layer in model.decoder_layers():
        for name, child in layer.named_modules():
            if isinstance(child, Linear):
                shared = tp.max_over_ranks if name.rsplit(".", 1)[-1] in ROW_PARALLEL and tp.size > 1 else None
                quantize(child, shared)
                count += 1
    return count
