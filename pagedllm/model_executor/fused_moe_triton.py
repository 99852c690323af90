"""The mixture-of-experts layer on CUDA: a fused-MoE Triton kernel (as vLLM's fused_moe). The step's (token,
expert) pairs are sorted by expert and each expert's run padded to whole tiles of BLOCK_M rows; one launch then
multiplies every tile by its expert's [gate | up] weights (a grouped GEMM over the stacked weights, the tokens'
rows gathered as they are read), the activation runs on the product, and a second launch multiplies by each
expert's down weights with the routing weight applied in the kernel; a token's top-k rows are summed last.
Nothing is read back to the host, so a step can be captured in a CUDA graph. Under TRITON_INTERPRET=1 the same
kernels run on the CPU (how CI tests them against the reference)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedllm.model_executor.moe import FusedMoE, MoEMethod
from pagedllm.model_executor.quant.triton_gemm import accumulate_dot

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # (16-bit tl.dot is wrong there: fp32 products)
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr,
    num_slots, n_out, k_in, a_rows_per_slot,
    stride_am, stride_be, stride_bn, stride_bias_e, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """C[slot] = A[slot // a_rows_per_slot] @ B[expert]^T (+ bias[expert]) (* weight[slot]) for the BLOCK_M
    sorted slots of this program's tile, all of one expert (padding slots: >= num_slots, skipped)."""
    tile = tl.program_id(0)
    col_tile = tl.program_id(1)
    expert = tl.load(block_expert_ptr + tile)
    if expert < 0:  # past the padded total
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ids_ptr + rows)
    slot_ok = slot < num_slots
    a_row = tl.where(slot_ok, slot // a_rows_per_slot, 0).to(tl.int64)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    for k0 in range(0, k_in, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_in
        a = tl.load(a_ptr + a_row[:, None] * stride_am + kk[None, :], mask=slot_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(b_base + cols[None, :] * stride_bn + kk[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        acc = accumulate_dot(acc, a, b, IEEE, DOT_FP32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_e + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(c_ptr.dtype.element_ty)
    if MUL_WEIGHT:  # as the reference: the expert's output in the model dtype, times its routing weight
        w = tl.load(weights_ptr + slot, mask=slot_ok, other=0.0)
        out = (out.to(tl.float32) * w.to(tl.float32)[:, None]).to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + slot.to(tl.int64)[:, None] * stride_cm + cols[None, :], out,
             mask=slot_ok[:, None] & col_ok[None, :])


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's flat slots (token * top_k + j) sorted by expert, each expert's run padded to whole tiles of
    `block_m` (padding: num_slots); and each tile's expert (-1 past the last). Tensor ops only (no host sync):
    the sizes are the largest the step can need."""
    num_slots = ids.numel()
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # (bincount would read its maximum back to size its output)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    dest = padded_start[sorted_experts] + torch.arange(num_slots, device=ids.device) - start[sorted_experts]
    capacity = num_slots + num_experts * (block_m - 1)
    capacity = (capacity + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((capacity,), num_slots, dtype=torch.int32, device=ids.device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_starts = torch.arange(0, capacity, block_m, device=ids.device)
    tile_expert = torch.searchsorted(padded_end, tile_starts, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return sorted_ids, tile_expert


def _grouped_gemm(a, b, bias, weights, sorted_ids, tile_expert, num_slots, a_rows_per_slot, out_dtype):
    """(num_slots, n_out) products of each slot's A row with its expert's B (experts, n_out, k_in)."""
    n_out, k_in = b.shape[1], b.shape[2]
    c = torch.zeros(num_slots, n_out, dtype=out_dtype, device=a.device)
    grid = (tile_expert.numel(), triton.cdiv(n_out, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, b, c if bias is None else bias, c, c if weights is None else weights, sorted_ids, tile_expert,
        num_slots, n_out, k_in, a_rows_per_slot,
        a.stride(0), b.stride(0), b.stride(1), 0 if bias is None else bias.stride(0), c.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, HAS_BIAS=bias is not None,
        MUL_WEIGHT=weights is not None, IEEE=a.dtype == torch.float32,
        DOT_FP32=INTERPRETED and a.dtype != torch.float32,
    )
    return c


def fused_moe(layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum over each token's top-k experts of weight * expert(x), x (tokens, hidden)."""
    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    sorted_ids, tile_expert = align_by_expert(ids, layer.num_experts)
    num_slots = tokens * top_k
    gate_up = _grouped_gemm(x, layer.w13_weight, layer.w13_bias, None, sorted_ids, tile_expert, num_slots, top_k,
                            x.dtype)
    h = layer.act_and_mul(gate_up).contiguous()
    out = _grouped_gemm(h, layer.w2_weight, layer.w2_bias, weights.flatten().contiguous(), sorted_ids, tile_expert,
                        num_slots, 1, x.dtype)
    return out.view(tokens, top_k, -1).sum(dim=1)


class TritonFusedMoE(MoEMethod):
    """The experts through fused_moe (a CUDA engine's, chosen at load)."""

    name = "triton-fused"

    def apply(self, layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused_moe(layer, x, weights, ids)


TRITON_FUSED = TritonFusedMoE()
