"""The `triton` attention backend (CUDA; the CPU under TRITON_INTERPRET=1, for tests): K/V read in
place through the block tables by one kernel launch per layer for the whole step, whatever mix of
prefill chunks and decodes it holds (triton_kernels.py), and written by slot mapping."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.model_executor.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    flat_positions,
    padded_block_table,
)
from pagedllm.model_executor.attention.layer import PagedAttention


@dataclass
class TritonMetadata(AttentionMetadata):
    query_start: torch.Tensor = None  # (requests + 1,) int32: offset of each request's first token
    seq_lens: torch.Tensor = None  # (requests,) int32: keys in the cache after this step
    block_table: torch.Tensor = None  # (requests, max_blocks) int32
    max_query_len: int = 0
    max_seq_len: int = 0


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, device: torch.device) -> None:
        from pagedllm.model_executor.attention import triton_kernels  # imports triton

        self.kernels = triton_kernels
        # Decode steps with fewer programs (requests x KV heads) than twice the SMs split their keys.
        self.split_below = 2 * torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 0

    def build_metadata(self, starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int,
                       device: torch.device) -> TritonMetadata:
        table = padded_block_table(block_tables)
        positions, slot_mapping, start, lens, _ = flat_positions(starts, lengths, table, block_size)
        query_start = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=query_start[1:])
        seq_lens = start + lens
        return TritonMetadata(
            positions=positions.to(device), slot_mapping=slot_mapping.to(device), block_size=block_size, backend=self,
            query_start=query_start.to(device), seq_lens=seq_lens.to(torch.int32).to(device),
            block_table=table.to(torch.int32).to(device), max_query_len=max(lengths),
            max_seq_len=int(seq_lens.max()))

    def forward(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TritonMetadata) -> torch.Tensor:
        k, v, q = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v, q))
        self.kernels.write_kv(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, layer.k_scale, layer.v_scale)
        return self.kernels.paged_attention(
            q, layer.k_cache, layer.v_cache, meta.block_table, meta.query_start, meta.seq_lens, meta.max_query_len,
            meta.max_seq_len, meta.block_size, layer.scale, layer.k_scale, layer.v_scale,
            split_below=self.split_below)
