"""NVFP4 weights: FP4 E2M1 values, two per byte (the low nibble first), an FP8 e4m3 scale per 16 values and a float32
scale per tensor. ModelOpt (`nvidia/*-FP4`: `weight`, `weight_scale`, `weight_scale_2`, weight = value *
weight_scale * weight_scale_2) and compressed-tensors' `nvfp4-pack-quantized` (`weight_packed`, `weight_scale`,
`weight_global_scale`, weight = value * (weight_scale / weight_global_scale)) store the same bytes.

A Linear holds `weight` (out, in / 2) uint8, `weight_scale` (out, in / 16) float8_e4m3fn and `weight_global` (out,)
float32, the tensor's scale repeated over its rows (fused q/k/v keep their own): multiplied by (ModelOpt) or
divided into (compressed-tensors) each block scale, in float32, as each library does. Activations stay in the
model's dtype (weight-only); a checkpoint's input scales are read and not used.
"""
from __future__ import annotations

import torch

from pagedllm.model_executor.linear import Linear
from pagedllm.model_executor.quant.base import LinearFormat, ParamSpec
from pagedllm.model_executor.quant.fp8 import FP8_DTYPE
from pagedllm.model_executor.quant.packing import fp4_e2m1_pairs

NVFP4_BLOCK = 16


class Nvfp4Format(LinearFormat):
    """`layout`: "modelopt" or "compressed-tensors" (which name the tensors and use the global scale differently);
    `input_scales`: the checkpoint's input scale tensors (read, not used)."""

    def __init__(self, layout: str, input_scales: tuple[str, ...] = ()) -> None:
        if layout not in ("modelopt", "compressed-tensors"):
            raise ValueError(f"NVFP4 layout must be modelopt or compressed-tensors, got {layout!r}")
        self.layout, self.input_scales = layout, input_scales
        self.divides = layout == "compressed-tensors"
        self.name = "nvfp4"

    def describe(self) -> str:
        return f"nvfp4 weights ({self.layout}), fp8 scales per {NVFP4_BLOCK}"

    def _names(self) -> tuple[str, str, str]:
        if self.layout == "modelopt":
            return "weight", "weight_scale", "weight_scale_2"
        return "weight_packed", "weight_scale", "weight_global_scale"

    def verify_shape(self, out_features: int, in_features: int) -> None:
        if in_features % NVFP4_BLOCK:
            raise ValueError(f"an NVFP4 Linear needs in_features ({in_features}) in whole blocks of {NVFP4_BLOCK}")

    def params(self, out_features: int, in_features: int, dtype: torch.dtype) -> dict[str, ParamSpec]:
        return {"weight": ParamSpec((out_features, in_features // 2), torch.uint8),
                "weight_scale": ParamSpec((out_features, in_features // NVFP4_BLOCK), FP8_DTYPE),
                "weight_global": ParamSpec((out_features,), torch.float32)}

    def checkpoint_tensors(self) -> frozenset[str]:
        return frozenset(self._names()) | frozenset(self.input_scales)

    def checkpoint_shape(self, shapes: dict[str, list[int]]) -> tuple[int, int]:
        out, half = shapes[self._names()[0]]
        return out, half * 2

    def convert(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        values, scale, global_scale = (tensors[n] for n in self._names())
        if values.dtype != torch.uint8 or scale.dtype != FP8_DTYPE:
            raise ValueError(f"NVFP4 values must be uint8 and scales float8_e4m3fn, got {values.dtype} and "
                             f"{scale.dtype}")
        rows = values.shape[0]
        return {"weight": values, "weight_scale": scale,
                "weight_global": global_scale.to(torch.float32).reshape(-1).expand(rows).contiguous()}

    def dequantize(self, layer: Linear, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        rows = end - start
        values = fp4_e2m1_pairs(torch.float32, layer.weight.device)[layer.weight[start:end].long()]
        scale, g = layer.weight_scale[start:end].to(torch.float32), layer.weight_global[start:end, None]
        scale = scale / g if self.divides else scale * g
        return (values.view(rows, -1, NVFP4_BLOCK) * scale[..., None]).view(rows, -1).to(dtype)

    def init_dummy(self, layer: Linear, gen: torch.Generator) -> None:
        # Uniform E2M1 codes have std ~2.9: block scales of 0.02 / 2.9 give ~N(0, 0.02)-sized weights.
        layer.weight.random_(0, 256, generator=gen)
        layer.weight_scale.copy_(torch.full(layer.weight_scale.shape, 0.02 / 2.9).to(FP8_DTYPE))
        layer.weight_global.fill_(1.0)
