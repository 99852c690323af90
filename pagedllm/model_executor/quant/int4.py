"""int4 weight-only (W4A16) with a scale, and a zero point unless symmetric, per group of input columns: GPTQ
(AutoGPTQ / GPTQModel), AWQ (AutoAWQ's GEMM layout) and compressed-tensors' `pack-quantized`. weight = (q - zero)
* scale, q and zero unsigned 4-bit (a symmetric format's zero is 8).

The three store the same numbers in different words; at load they become one layout (the same bytes, repacked):
`weight` (out, in / 2) uint8, column 2j in the low nibble of byte j; `weight_scale` (out, groups) in the model's
dtype; `weight_zero` (out, ceil(groups / 2)) uint8 nibbles when asymmetric; and with act-order (GPTQ's desc_act,
compressed-tensors' actorder) `input_perm` (in,): the weight's columns sorted by group, the activations gathered
in that order.

- GPTQ: `qweight` int32 (in / 8, out), eight input rows per word; `qzeros` int32 (groups, out / 8) storing
  zero - 1 (checkpoint_format "gptq"; "gptq_v2" stores the zero); `scales` (groups, out); `g_idx` (in,).
- AWQ: `qweight` int32 (in, out / 8) and `qzeros` int32 (groups, out / 8), eight output columns per word in the
  order 0 2 4 6 1 3 5 7; `scales` (groups, out).
- compressed-tensors: `weight_packed` int32 (out, in / 8), q + 8 stored for signed q; `weight_scale` (out, groups);
  `weight_zero_point` int32 (out / 8, groups), packed along rows; `weight_shape`; `weight_g_idx` with actorder.
"""
from __future__ import annotations

import torch

from pagedllm.model_executor.linear import Linear
from pagedllm.model_executor.quant.base import LinearFormat, ParamSpec
from pagedllm.model_executor.quant.packing import pack_nibbles, unpack_int32_nibbles, unpack_nibbles
from pagedllm.utils import cdiv

LAYOUTS = ("gptq", "gptq_v2", "awq", "compressed-tensors")
_AWQ_COLUMN_OF_NIBBLE = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p of an AWQ word holds column 8c + this[p]
_SYMMETRIC_ZERO = 8


class Int4Format(LinearFormat):
    """`group_size`: input columns per scale (-1 or None: the whole row); `act_order`: a group index per column
    that the loader sorts (the checkpoint's g_idx is not arange(in) // group_size)."""

    def __init__(self, layout: str, group_size: int | None, symmetric: bool, act_order: bool = False) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"int4 layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout, self.symmetric, self.act_order = layout, symmetric, act_order
        self.group_size = None if group_size in (None, -1, 0) else int(group_size)
        self.name = {"gptq_v2": "gptq"}.get(layout, layout) + "-int4"

    def describe(self) -> str:
        group = f"groups of {self.group_size}" if self.group_size else "one group per row"
        return (f"int4 weights ({self.layout}), {group}, {'symmetric' if self.symmetric else 'with zero points'}"
                f"{', act-order' if self.act_order else ''}")

    def _group(self, in_features: int) -> int:
        return self.group_size or in_features

    def verify_shape(self, out_features: int, in_features: int) -> None:
        if in_features % self._group(in_features) or in_features % 8 or out_features % 8:
            raise ValueError(f"an int4 Linear of shape ({out_features}, {in_features}) is not in whole groups of "
                             f"{self._group(in_features)} columns and words of 8 values")

    def params(self, out_features: int, in_features: int, dtype: torch.dtype) -> dict[str, ParamSpec]:
        groups = in_features // self._group(in_features)
        specs = {"weight": ParamSpec((out_features, in_features // 2), torch.uint8),
                 "weight_scale": ParamSpec((out_features, groups), dtype)}
        if not self.symmetric:
            specs["weight_zero"] = ParamSpec((out_features, cdiv(groups, 2)), torch.uint8)
        if self.act_order:
            specs["input_perm"] = ParamSpec((in_features,), torch.int32, row_block=None)
        return specs

    def checkpoint_tensors(self) -> frozenset[str]:
        if self.layout in ("gptq", "gptq_v2"):
            return frozenset({"qweight", "qzeros", "scales", "g_idx"})
        if self.layout == "awq":
            return frozenset({"qweight", "qzeros", "scales"})
        return frozenset({"weight_packed", "weight_scale", "weight_shape"}
                         | (set() if self.symmetric else {"weight_zero_point"})
                         | ({"weight_g_idx"} if self.act_order else set()))

    def checkpoint_shape(self, shapes: dict[str, list[int]]) -> tuple[int, int]:
        if self.layout in ("gptq", "gptq_v2"):
            words, out = shapes["qweight"]
            return out, words * 8
        if self.layout == "awq":
            inp, words = shapes["qweight"]
            return words * 8, inp
        out, words = shapes["weight_packed"]
        return out, words * 8

    # -- checkpoint layouts -> (q (out, in) uint8, scale (out, groups), zero (out, groups) uint8 | None, g_idx) ----
    def _unpack(self, t: dict[str, torch.Tensor]):
        if self.layout in ("gptq", "gptq_v2"):
            q = unpack_int32_nibbles(t["qweight"], 0).T
            zero = unpack_int32_nibbles(t["qzeros"], 1).T
            if self.layout == "gptq":
                zero = (zero + 1) & 0xF  # v1 stores zero - 1
            return q, t["scales"].T, zero, t["g_idx"]
        if self.layout == "awq":
            order = torch.tensor(_AWQ_COLUMN_OF_NIBBLE).argsort()

            def columns(words):  # (rows, out / 8) -> (rows, out)
                nibbles = unpack_int32_nibbles(words, 1)
                return nibbles.view(words.shape[0], -1, 8)[..., order].reshape(words.shape[0], -1)

            return columns(t["qweight"]).T, t["scales"].T, columns(t["qzeros"]).T, None
        out, inp = (int(d) for d in t["weight_shape"].tolist())
        q = unpack_int32_nibbles(t["weight_packed"], 1)[:, :inp]
        zero = None if self.symmetric else unpack_int32_nibbles(t["weight_zero_point"], 0)[:out]
        return q, t["weight_scale"], zero, t.get("weight_g_idx")

    def convert(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        q, scale, zero, g_idx = self._unpack(tensors)
        out, inp = q.shape
        group = self._group(inp)
        if scale.shape != (out, inp // group):
            raise ValueError(f"int4 scales of shape {tuple(scale.shape)} for a ({out}, {inp}) weight in groups of "
                             f"{group}: expected {(out, inp // group)}")
        params = {"weight_scale": scale.to(dtype).contiguous()}
        if self.act_order:
            perm = torch.argsort(g_idx.to(torch.int64), stable=True)
            if not torch.equal(g_idx.to(torch.int64)[perm], torch.arange(inp) // group):
                raise ValueError(f"an act-order g_idx must give every group exactly {group} columns")
            q = q[:, perm]
            params["input_perm"] = perm.to(torch.int32)
        elif g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(inp) // group):
            raise ValueError("this checkpoint's g_idx reorders columns (act-order) but its config says desc_act "
                             "false")
        params["weight"] = pack_nibbles(q)
        if not self.symmetric:
            groups = zero.shape[1]
            if groups % 2:
                zero = torch.cat((zero, zero.new_zeros(out, 1)), dim=1)
            params["weight_zero"] = pack_nibbles(zero)
        elif zero is not None and not bool((zero == _SYMMETRIC_ZERO).all()):
            raise ValueError("a symmetric int4 checkpoint must have every zero point at 8")
        return params

    def _kernel_applies(self, layer: Linear, dtype: torch.dtype) -> bool:
        """quant_gemv.cpp takes bf16 on a CPU, in groups of 32 columns or more."""
        return (self.kernels is not None and dtype == torch.bfloat16 == layer.weight_scale.dtype
                and layer.weight.device.type == "cpu" and self._group(layer.in_features) % 32 == 0)

    def gemv(self, layer: Linear, x2d: torch.Tensor) -> torch.Tensor | None:
        if not self._kernel_applies(layer, x2d.dtype):
            return None
        return self.kernels.int4_gemv(x2d, layer.weight, layer.weight_scale, getattr(layer, "weight_zero", None))

    def dequantize(self, layer: Linear, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        if self._kernel_applies(layer, dtype):
            return self.kernels.int4_dequantize(layer.weight, layer.weight_scale, getattr(layer, "weight_zero", None),
                                                start, end)
        scale = layer.weight_scale[start:end].to(dtype)
        rows, groups = scale.shape
        q = unpack_nibbles(layer.weight[start:end]).view(rows, groups, -1).to(dtype)
        if self.symmetric:
            q = q - _SYMMETRIC_ZERO
        else:
            q = q - unpack_nibbles(layer.weight_zero[start:end])[:, :groups, None].to(dtype)
        return (q * scale[:, :, None]).view(rows, -1)

    def init_dummy(self, layer: Linear, gen: torch.Generator) -> None:
        # Uniform codes have std ~4.6 around 8: a scale of 0.02 / 4.6 gives ~N(0, 0.02)-sized weights.
        layer.weight.random_(0, 256, generator=gen)
        layer.weight_scale.fill_(0.02 / 4.6)
        if not self.symmetric:
            layer.weight_zero.fill_(_SYMMETRIC_ZERO | _SYMMETRIC_ZERO << 4)
        if self.act_order:
            layer.input_perm.copy_(torch.arange(layer.in_features, dtype=torch.int32))
