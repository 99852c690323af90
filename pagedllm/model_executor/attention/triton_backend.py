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
    per_query_inputs,
)
from pagedllm.model_executor.attention.layer import PagedAttention
from pagedllm.model_executor.step_buffers import StepBuffers


@dataclass
class TritonMetadata(AttentionMetadata):
    query_start: torch.Tensor = None  # (requests + 1,) int32: offset of each request's first token
    seq_lens: torch.Tensor = None  # (requests,) int32: keys in the cache after this step
    block_table: torch.Tensor = None  # (requests, width) int32
    block_table_stride: torch.Tensor = None  # (1,) int32: the width, read by the kernel (fixed under CUDA graphs)
    max_query_len: int = 0
    max_seq_len: int = 0  # sets how many key partitions a split decode launches (graphs: max_model_len)
    partition_tokens: int = 0  # keys per split-K partition: one value per engine, graphs or not


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, device: torch.device, batch_invariant: bool = False) -> None:
        from pagedllm.model_executor.attention import triton_kernels  # imports triton

        self.kernels = triton_kernels
        # Decode steps with fewer programs (requests x KV heads) than twice the SMs split their keys; never
        # in batch-invariant mode (the split would depend on how many requests run), where every query of a
        # step, prefill ones too, runs as a one-token decode (base.per_query_inputs).
        self.split_below = 2 * torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" and not batch_invariant else 0
        self.batch_invariant = batch_invariant
        self.buffers: StepBuffers | None = None
        self.max_blocks = 0

    supports_graphs = True

    def allocate_buffers(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                         device: torch.device) -> None:
        self.buffers = StepBuffers({
            "positions": (max_num_tokens, torch.long), "slot_mapping": (max_num_tokens, torch.long),
            "query_start": (max_num_seqs + 1, torch.int32), "seq_lens": (max_num_seqs, torch.int32),
            "block_table": (max_num_seqs * max_blocks_per_seq, torch.int32), "block_table_stride": (1, torch.int32),
        }, device)
        self.max_blocks = max_blocks_per_seq

    def build_metadata(self, starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int,
                       device: torch.device) -> TritonMetadata:
        if self.batch_invariant:  # every query a decode of its own; a step then outgrows the buffers
            starts, lengths, block_tables = per_query_inputs(starts, lengths, block_tables)
        table = padded_block_table(block_tables, torch.int32)
        positions, slot_mapping, start, lens, _ = flat_positions(starts, lengths, table, block_size)
        query_start = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=query_start[1:])
        seq_lens = (start + lens).to(torch.int32)
        host = {"positions": positions, "slot_mapping": slot_mapping, "query_start": query_start,
                "seq_lens": seq_lens, "block_table": table,
                "block_table_stride": torch.tensor([table.shape[1]], dtype=torch.int32)}
        buffers = self.buffers
        if buffers is not None and all(v.numel() <= buffers.capacity(k) for k, v in host.items()):
            dev = buffers.load_all(host)
        else:  # a step larger than the buffers were made for (or none made): fresh tensors
            dev = {name: value.to(device) for name, value in host.items()}
        return TritonMetadata(
            positions=dev["positions"], slot_mapping=dev["slot_mapping"], block_size=block_size, backend=self,
            query_start=dev["query_start"], seq_lens=dev["seq_lens"], block_table=dev["block_table"],
            block_table_stride=dev["block_table_stride"], max_query_len=max(lengths),
            max_seq_len=int(seq_lens.max()), partition_tokens=self._partition_tokens(block_size))

    def graph_metadata(self, num_seqs: int, block_size: int) -> TritonMetadata:
        """The metadata a CUDA graph of `num_seqs` one-token sequences is captured with: views of the
        persistent buffers that build_metadata fills before each replay (same addresses), and fixed
        Python values (one query per sequence; key partitions as for the longest sequence there can be)."""
        dev = self.buffers.device
        return TritonMetadata(
            positions=dev["positions"][:num_seqs], slot_mapping=dev["slot_mapping"][:num_seqs],
            block_size=block_size, backend=self, query_start=dev["query_start"][:num_seqs + 1],
            seq_lens=dev["seq_lens"][:num_seqs], block_table=dev["block_table"],
            block_table_stride=dev["block_table_stride"], max_query_len=1,
            max_seq_len=self.max_blocks * block_size, partition_tokens=self._partition_tokens(block_size))

    def _partition_tokens(self, block_size: int) -> int:
        """Split-K partition length from the longest possible sequence, not this step's: a decode then
        adds up its keys in the same partitions whether it runs from a graph or eagerly (same floats)."""
        return self.kernels.partition_tokens_for(self.max_blocks * block_size) if self.buffers is not None else 0

    def forward(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TritonMetadata) -> torch.Tensor:
        k, v, q = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v, q))
        self.kernels.write_kv(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, layer.k_scale, layer.v_scale)
        return self.kernels.paged_attention(
            q, layer.k_cache, layer.v_cache, meta.block_table, meta.query_start, meta.seq_lens, meta.max_query_len,
            meta.max_seq_len, meta.block_size, layer.scale, layer.k_scale, layer.v_scale,
            split_below=self.split_below, block_table_stride=meta.block_table_stride,
            partition_tokens=meta.partition_tokens, sliding_window=layer.sliding_window, sinks=layer.sinks)
