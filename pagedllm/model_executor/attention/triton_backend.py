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


class StepBuffers:
    """A step's metadata in persistent device tensors, filled from page-locked host twins by one
    asynchronous copy each: no allocation and no host-blocking copy per step, and fixed addresses
    (what CUDA graphs will replay over). Before the host twins are rewritten, the previous step's
    copies out of them are waited for (an event; a step that samples nothing does not otherwise wait)."""

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks: int, device: torch.device) -> None:
        self.cuda = pin = device.type == "cuda"
        shapes = {"positions": ((max_num_tokens,), torch.long), "slot_mapping": ((max_num_tokens,), torch.long),
                  "query_start": ((max_num_seqs + 1,), torch.int32), "seq_lens": ((max_num_seqs,), torch.int32),
                  "block_table": ((max_num_seqs * max_blocks,), torch.int32)}  # (requests, width) views
        self.host = {k: torch.zeros(shape, dtype=dt, pin_memory=pin) for k, (shape, dt) in shapes.items()}
        self.device = {k: torch.zeros(shape, dtype=dt, device=device) for k, (shape, dt) in shapes.items()}
        self.max_num_tokens, self.max_num_seqs, self.max_blocks = max_num_tokens, max_num_seqs, max_blocks
        self.copied: torch.cuda.Event | None = None

    def load_all(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copies have left the host twins
        out = {name: self.load(name, value) for name, value in values.items()}
        if self.cuda:
            self.copied = torch.cuda.current_stream().record_event()
        return out

    def fits(self, num_tokens: int, num_seqs: int, num_blocks: int) -> bool:
        return num_tokens <= self.max_num_tokens and num_seqs <= self.max_num_seqs and num_blocks <= self.max_blocks

    def load(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """`value` (host) into the buffer `name`, returned as the device view of its leading part."""
        n = value.numel()
        host, dev = self.host[name][:n].view(value.shape), self.device[name][:n].view(value.shape)  # contiguous
        host.copy_(value)
        dev.copy_(host, non_blocking=True)
        return dev


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, device: torch.device) -> None:
        from pagedllm.model_executor.attention import triton_kernels  # imports triton

        self.kernels = triton_kernels
        # Decode steps with fewer programs (requests x KV heads) than twice the SMs split their keys.
        self.split_below = 2 * torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 0
        self.buffers: StepBuffers | None = None

    def allocate_buffers(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                         device: torch.device) -> None:
        self.buffers = StepBuffers(max_num_tokens, max_num_seqs, max_blocks_per_seq, device)

    def build_metadata(self, starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int,
                       device: torch.device) -> TritonMetadata:
        table = padded_block_table(block_tables, torch.int32)
        positions, slot_mapping, start, lens, _ = flat_positions(starts, lengths, table, block_size)
        query_start = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=query_start[1:])
        seq_lens = (start + lens).to(torch.int32)
        host = {"positions": positions, "slot_mapping": slot_mapping, "query_start": query_start,
                "seq_lens": seq_lens, "block_table": table}
        buffers = self.buffers
        if buffers is not None and buffers.fits(len(positions), len(lengths), table.shape[1]):
            dev = buffers.load_all(host)
        else:  # a step larger than the buffers were made for: fresh tensors
            dev = {name: value.to(device) for name, value in host.items()}
        return TritonMetadata(
            positions=dev["positions"], slot_mapping=dev["slot_mapping"], block_size=block_size, backend=self,
            query_start=dev["query_start"], seq_lens=dev["seq_lens"], block_table=dev["block_table"],
            max_query_len=max(lengths), max_seq_len=int(seq_lens.max()))

    def forward(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TritonMetadata) -> torch.Tensor:
        k, v, q = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v, q))
        self.kernels.write_kv(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, layer.k_scale, layer.v_scale)
        return self.kernels.paged_attention(
            q, layer.k_cache, layer.v_cache, meta.block_table, meta.query_start, meta.seq_lens, meta.max_query_len,
            meta.max_seq_len, meta.block_size, layer.scale, layer.k_scale, layer.v_scale,
            split_below=self.split_below)
