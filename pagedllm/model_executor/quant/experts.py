"""A mixture of experts' weights in a LinearFormat (the experts of FP8, int4 and NVFP4 checkpoints, as
Qwen3-30B-A3B-FP8 or a Mixtral GPTQ ships them): each of FusedMoE's stacked projections holds the format's
parameters with a leading expert dimension (`w13_weight`, `w13_weight_scale`, ... for [gate | up]; `w2_*` for down),
loaded expert by expert from the checkpoint's per-expert modules. An expert's projection is a view of one slice,
multiplied as a quantized Linear is (DequantLinearMethod: its format's gemv or dequantized tiles)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from pagedllm.model_executor.moe import FusedMoE, MoEMethod
from pagedllm.model_executor.quant.base import DequantLinearMethod, LinearFormat


def _shapes(moe: FusedMoE) -> dict[str, tuple[int, int]]:
    """(out, in) of each stacked projection of one expert."""
    return {"w13": (2 * moe.width, moe.hidden_size), "w2": (moe.hidden_size, moe.width)}


def make_quantized_experts(moe: FusedMoE, fmt: LinearFormat) -> None:
    """Give `moe` (still on the meta device) the format's parameters for every expert, and its method."""
    dtype = moe.w13_weight.dtype
    moe.row_blocks = {}
    for stacked, (out, inp) in _shapes(moe).items():
        fmt.verify_shape(out, inp)
        for name, spec in fmt.params(out, inp, dtype).items():
            param = torch.empty((moe.num_experts, *spec.shape), dtype=spec.dtype, device="meta")
            setattr(moe, f"{stacked}_{name}", nn.Parameter(param, requires_grad=False))
            moe.row_blocks[name] = spec.row_block
    if fmt.params(2 * moe.width, moe.hidden_size, dtype).get("weight_scale") is not None:
        block = moe.row_blocks.get("weight_scale", 1)
        if block and moe.width % block:
            raise ValueError(f"expert width {moe.width} is not in whole blocks of {block} rows: the gate and up "
                             f"projections' block scales cannot be told apart")
    moe.quant_format = fmt
    moe.method = DequantMoEMethod(fmt)


def expert_view(moe: FusedMoE, stacked: str, expert: int) -> SimpleNamespace:
    """One expert's projection (`stacked`: "w13" or "w2") as a quantized Linear's attributes: views of its slices."""
    out, inp = _shapes(moe)[stacked]
    params = {name[len(stacked) + 1:]: p[expert] for name, p in moe.named_parameters(recurse=False)
              if name.startswith(stacked + "_") and not name.endswith("_bias")}
    return SimpleNamespace(in_features=inp, out_features=out, bias=None, quant_format=moe.quant_format, **params)


class DequantMoEMethod(MoEMethod):
    """The reference grouped experts (MoEMethod.apply), each chosen expert's projections multiplied as quantized
    Linears."""

    name = "quantized-experts"

    def __init__(self, fmt: LinearFormat) -> None:
        self.format = fmt
        self.linear = DequantLinearMethod(fmt)

    def expert_forward(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
        h = self.linear.apply(expert_view(layer, "w13", expert), x)
        if layer.w13_bias is not None:
            h = h + layer.w13_bias[expert]
        y = self.linear.apply(expert_view(layer, "w2", expert), layer.act_and_mul(h))
        return y if layer.w2_bias is None else y + layer.w2_bias[expert]


def init_dummy_experts(moe: FusedMoE, gen: torch.Generator) -> None:
    """Each expert's projections drawn as the format draws a dummy Linear's."""
    for expert in range(moe.num_experts):
        for stacked in ("w13", "w2"):
            moe.quant_format.init_dummy(expert_view(moe, stacked, expert), gen)
