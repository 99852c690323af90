"""What a checkpoint format provides (LinearFormat), and the reference product by its weights: rows of the weight
dequantized a tile at a time into the activations' dtype and multiplied (any device; no full-size dequantized copy
is ever held)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.linear import Linear, LinearMethod

# Elements of weight dequantized at once by the reference product: 4 Mi (16 MiB in fp32), a few tiles of an 8B
# model's MLP.
DEQUANT_TILE_ELEMENTS = 1 << 22
# Rows a format's gemv() reads the stored bytes for (decode); more rows multiply dequantized tiles.
GEMV_MAX_ROWS = 8


@dataclass(frozen=True)
class ParamSpec:
    """One parameter a quantized Linear holds. `row_block`: output rows per entry of dim 0 (1: one per row; 128:
    an FP8 block scale's), so fused q/k/v or gate/up parts land in their rows; None: indexed by input column and
    the same for every fused part (GPTQ's act-order permutation)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    row_block: int | None = 1

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize


class LinearFormat:
    """A quantized weight layout. Subclasses say which parameters a Linear holds (`params`, its `weight` the
    quantized values), which tensors a checkpoint module stores (`checkpoint_tensors`) and how they become the
    parameters (`convert`), and how rows dequantize (`dequantize`). `kernels`: the native CPU kernels, set at
    load on a CPU (None elsewhere), for a format with a faster product there (`gemv`)."""

    name = "quantized"
    kernels = None
    # On CUDA, set at load: (layer, x2d) -> x2d @ W^T by a dequant-GEMM kernel (triton_gemm.py), or None where it
    # does not take the layer.
    device_gemm = None

    def gemv(self, layer: Linear, x2d: torch.Tensor) -> torch.Tensor | None:
        """x2d @ W^T for a few rows (at most GEMV_MAX_ROWS) read from the stored bytes, or None where this format
        has no such kernel here (the tiles of dequantize() serve then)."""
        return None

    def params(self, out_features: int, in_features: int, dtype: torch.dtype) -> dict[str, ParamSpec]:
        raise NotImplementedError

    def checkpoint_tensors(self) -> frozenset[str]:
        """The tensor names (after the module's name) a checkpoint module in this format has, all of them."""
        raise NotImplementedError

    def convert(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """One checkpoint module's tensors (by their names after the module's) -> the Linear's parameters."""
        raise NotImplementedError

    def checkpoint_shape(self, shapes: dict[str, list[int]]) -> tuple[int, int]:
        """(out, in) of the weight a checkpoint module stores, from its tensors' shapes (safetensors headers)."""
        raise NotImplementedError

    def dequantize(self, layer: Linear, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows start:end of the weight, (end - start, in_features), in `dtype`."""
        raise NotImplementedError

    def init_dummy(self, layer: Linear, gen: torch.Generator) -> None:
        """Random values whose dequantized weights are ~N(0, 0.02), as dummy dense weights are."""
        raise NotImplementedError

    def verify_shape(self, out_features: int, in_features: int) -> None:
        """Raise ValueError when a Linear of this shape cannot hold the format (a group that does not divide)."""

    def row_tile(self, in_features: int) -> int:
        """Rows the reference product dequantizes at once."""
        return max(1, DEQUANT_TILE_ELEMENTS // in_features)

    def weight_bytes(self, out_features: int, in_features: int, dtype: torch.dtype) -> int:
        return sum(spec.nbytes for spec in self.params(out_features, in_features, dtype).values())

    def describe(self) -> str:
        return self.name


class DequantLinearMethod(LinearMethod):
    """The reference product by a quantized weight: its rows dequantized a tile at a time, then F.linear."""

    def __init__(self, fmt: LinearFormat) -> None:
        self.format = fmt
        self.name = fmt.name

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, layer.in_features)
        perm = getattr(layer, "input_perm", None)
        if perm is not None:  # the weight's columns are stored in this order (GPTQ act-order)
            x2d = x2d.index_select(1, perm)
        out = self.format.gemv(layer, x2d) if x2d.shape[0] <= GEMV_MAX_ROWS else None
        if out is None and self.format.device_gemm is not None:
            out = self.format.device_gemm(layer, x2d)
        if out is None:
            out = self._tiled(layer, x2d)
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*x.shape[:-1], layer.out_features)

    def _tiled(self, layer: Linear, x2d: torch.Tensor) -> torch.Tensor:
        """x2d @ W^T, W dequantized a tile of rows at a time."""
        rows, n = layer.out_features, self.format.row_tile(layer.in_features)
        if n >= rows:
            return F.linear(x2d, self.format.dequantize(layer, 0, rows, x2d.dtype))
        out = x2d.new_empty(x2d.shape[0], rows)
        for start in range(0, rows, n):
            end = min(start + n, rows)
            out[:, start:end] = F.linear(x2d, self.format.dequantize(layer, start, end, x2d.dtype))
        return out


def make_quantized(layer: Linear, fmt: LinearFormat) -> None:
    """Give `layer` (still on the meta device) the format's parameters in place of its weight, and its method."""
    dtype = layer.weight.dtype
    fmt.verify_shape(layer.out_features, layer.in_features)
    specs = fmt.params(layer.out_features, layer.in_features, dtype)
    del layer.weight
    for name, spec in specs.items():
        layer.register_parameter(name, nn.Parameter(torch.empty(spec.shape, dtype=spec.dtype, device="meta"),
                                                    requires_grad=False))
    layer.row_blocks = {name: spec.row_block for name, spec in specs.items()}
    layer.quant_format = fmt
    layer.method = DequantLinearMethod(fmt)
