"""Batch-invariant mode (`--batch-invariant`, or vLLM's VLLM_BATCH_INVARIANT=1): a request's logits do not
depend on the other requests in its step, so a seeded request draws the same tokens (or audio frames)
alone or in any batch, and with its prompt chunked any way.

Two things make logits depend on the batch otherwise, both float rounding:
- A matrix product's rounding depends on its row count: BLAS picks the kernel and the blocking by shape
  (one row a GEMV, a few rows one blocking, many another; up to 5e-5 apart in fp32 at K = 896). Here every
  Linear multiplies in tiles of exactly TILE_ROWS rows, the last one padded: one shape, so one order of
  sums for every row wherever it sits.
- Attention's sums over keys may depend on the batch (the torch backend pads keys to the group's longest
  request; Triton splits a long decode's keys when few sequences run). The cpu backend then attends every
  query, prefill ones too, with its decode kernel: one (query, KV head) at a time over exactly its own
  keys. Triton never splits. The torch backend cannot, and is refused.
Norms, rotary embeddings, activations, embeddings and the samplers already work row by row.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.model_executor.linear import Linear, LinearMethod

TILE_ROWS = 16  # every Linear multiplies this many rows at a time in batch-invariant mode
ENV_VAR = "VLLM_BATCH_INVARIANT"  # vLLM's switch for the same mode; "1" turns it on by default


def tiled(forward, tile_rows: int = TILE_ROWS):
    """`forward` (rows, in) -> (rows, out) applied to tiles of exactly `tile_rows` rows (the last one padded
    with zeros): each row's result is the same whatever the other rows are and however many."""

    def forward_in_tiles(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        pad = -rows % tile_rows
        if pad:
            flat = torch.cat((flat, flat.new_zeros(pad, flat.shape[1])))
        out = torch.cat([forward(flat[i:i + tile_rows]) for i in range(0, flat.shape[0], tile_rows)])
        return out[:rows].view(*x.shape[:-1], out.shape[-1])

    return forward_in_tiles


class TiledLinearMethod(LinearMethod):
    """A layer's method (packed, quantized or plain) run on fixed tiles of rows; an MLP's fused SiLU-and-multiply
    too, and an LM head in its one orientation (the other, for many rows, would be a second shape)."""

    def __init__(self, inner: LinearMethod, tile_rows: int = TILE_ROWS) -> None:
        self.inner, self.tile_rows = inner, tile_rows
        self.name = f"tiled({inner.name})"

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return tiled(lambda t: self.inner.apply(layer, t), self.tile_rows)(x)

    def apply_and_act(self, layer, x: torch.Tensor) -> torch.Tensor:
        return tiled(lambda t: self.inner.apply_and_act(layer, t), self.tile_rows)(x)

    def apply_logits(self, layer, x: torch.Tensor, vocab_major: bool) -> torch.Tensor:
        return self.apply(layer, x)


def make_linears_batch_invariant(model: nn.Module, tile_rows: int = TILE_ROWS) -> int:
    """Every Linear's method (as chosen at load) run in fixed tiles. Returns how many layers."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and not isinstance(module.method, TiledLinearMethod):
            module.method = TiledLinearMethod(module.method, tile_rows)
            count += 1
    return count
