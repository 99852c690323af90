"""FP8 (e4m3) weights with float32 scales: one per tensor (ModelOpt's `nvidia/*-FP8`, compressed-tensors' tensor
strategy), one per output channel (compressed-tensors' channel strategy, as llmcompressor's FP8_DYNAMIC writes),
or one per block of rows x columns (`quant_method: fp8` with `weight_block_size`, as Qwen's and DeepSeek's FP8
checkpoints; compressed-tensors' block strategy). weight = fp8 value * scale.

A Linear holds `weight` (out, in) float8_e4m3fn and `weight_scale` float32: (out,) for tensor and channel scales
(a per-tensor scale repeated over its rows, so fused q/k/v keep their own), or (ceil(out / bn), ceil(in / bk))
for blocks. Activations stay in the model's dtype (weight-only); a checkpoint's static `input_scale` is read and
not used.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.model_executor.linear import Linear
from pagedllm.model_executor.quant.base import DequantLinearMethod, LinearFormat, ParamSpec
from pagedllm.utils import cdiv

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


class Fp8Format(LinearFormat):
    """`block`: (rows, columns) of a block scale, None for per-row scales. `scale_name`: the checkpoint's name of the
    scale (`weight_scale`, or `weight_scale_inv` in `quant_method: fp8` block checkpoints); `input_scale`: the
    checkpoint also stores a static activation scale."""

    def __init__(self, block: tuple[int, int] | None = None, scale_name: str = "weight_scale",
                 input_scale: bool = False, per_tensor: bool = False) -> None:
        self.block, self.scale_name, self.input_scale, self.per_tensor = block, scale_name, input_scale, per_tensor
        self.name = "fp8"

    def describe(self) -> str:
        if self.block is not None:
            return f"fp8 e4m3 weights, {self.block[0]}x{self.block[1]} block scales"
        return f"fp8 e4m3 weights, per-{'tensor' if self.per_tensor else 'channel'} scales"

    def params(self, out_features: int, in_features: int, dtype: torch.dtype) -> dict[str, ParamSpec]:
        if self.block is None:
            scale = ParamSpec((out_features,), torch.float32)
        else:
            bn, bk = self.block
            scale = ParamSpec((cdiv(out_features, bn), cdiv(in_features, bk)), torch.float32, row_block=bn)
        return {"weight": ParamSpec((out_features, in_features), FP8_DTYPE), "weight_scale": scale}

    def checkpoint_tensors(self) -> frozenset[str]:
        return frozenset({"weight", self.scale_name} | ({"input_scale"} if self.input_scale else set()))

    def checkpoint_shape(self, shapes: dict[str, list[int]]) -> tuple[int, int]:
        out, inp = shapes["weight"]
        return out, inp

    def convert(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        weight, scale = tensors["weight"], tensors[self.scale_name].to(torch.float32)
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"an fp8 checkpoint's weight must be float8_e4m3fn, got {weight.dtype}")
        if self.block is None:
            scale = scale.reshape(-1)
            scale = scale.expand(weight.shape[0]) if scale.numel() == 1 else scale
        return {"weight": weight, "weight_scale": scale.contiguous()}

    def row_tile(self, in_features: int) -> int:
        tile = super().row_tile(in_features)
        return tile if self.block is None else max(self.block[0], tile // self.block[0] * self.block[0])

    def _kernel_args(self, layer: Linear, dtype: torch.dtype) -> tuple[int, int] | None:
        """(block rows, block columns; 0: per-row scales) for quant_gemv.cpp's fp8 product, which takes bf16 on a
        CPU; None where it does not apply."""
        if self.kernels is None or dtype != torch.bfloat16 or layer.weight.device.type != "cpu":
            return None
        return (1, 0) if self.block is None else self.block

    def gemv(self, layer: Linear, x2d: torch.Tensor) -> torch.Tensor | None:
        args = self._kernel_args(layer, x2d.dtype)
        return None if args is None else self.kernels.fp8_gemv(x2d, layer.weight, layer.weight_scale, *args)

    def dequantize(self, layer: Linear, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        args = self._kernel_args(layer, dtype)
        if args is not None:
            return self.kernels.fp8_dequantize(layer.weight, layer.weight_scale, *args, start, end)
        w = layer.weight[start:end].to(torch.float32)
        if self.block is None:
            return (w * layer.weight_scale[start:end, None]).to(dtype)
        bn, bk = self.block
        scale = layer.weight_scale[start // bn:cdiv(end, bn)]
        scale = scale.repeat_interleave(bn, 0)[:end - start].repeat_interleave(bk, 1)[:, :w.shape[1]]
        return (w * scale).to(dtype)

    def init_dummy(self, layer: Linear, gen: torch.Generator) -> None:
        values = torch.empty(layer.weight.shape, device=layer.weight.device).normal_(0.0, 1.0, generator=gen)
        layer.weight.copy_(values.to(FP8_DTYPE))
        layer.weight_scale.fill_(0.02)


FP8_PER_CHANNEL = Fp8Format()  # --quantization fp8: a 16/32-bit checkpoint's Linears, quantized at load


def quantize_linear_fp8(layer: Linear, row_absmax=None) -> None:
    """Replace `layer`'s weight by fp8 e4m3 values and per-row float32 scales (absmax / 448; `row_absmax`: the
    whole row's absmax when `layer` holds one tensor-parallel rank's columns of it), as vLLM's `--quantization fp8`
    makes them at load (vLLM: one scale per tensor; here per output channel, as compressed-tensors' FP8_DYNAMIC
    checkpoints)."""
    w = layer.weight.detach().to(torch.float32)
    absmax = w.abs().amax(dim=1)
    if row_absmax is not None:
        absmax = row_absmax(absmax)
    scale = (absmax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    values = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    layer.weight = nn.Parameter(values, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale, requires_grad=False)
    layer.row_blocks = {"weight": 1, "weight_scale": 1}
    layer.quant_format = FP8_PER_CHANNEL
    layer.method = DequantLinearMethod(FP8_PER_CHANNEL)
