"""What every attention backend provides: the metadata of a step and the forward of one layer.

A backend is chosen once when the model runner starts (`--attention-backend`); the model files know
none of them. The runner builds each step's metadata with its backend; the metadata carries the
backend, so a layer's PagedAttention just hands it q, k, v.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.model_executor.attention.layer import PagedAttention


@dataclass
class AttentionMetadata:
    """What every backend needs of a step; backends add their own fields."""

    positions: torch.Tensor  # (num_tokens,) position of each token in its sequence
    slot_mapping: torch.Tensor  # (num_tokens,) cache slot where each new token's K/V goes
    block_size: int
    backend: AttentionBackend


class AttentionBackend(ABC):
    name: str
    # Whether a decode step's attention can be captured in a CUDA graph: nothing read on the host per
    # step, inputs in persistent buffers (graph_metadata).
    supports_graphs = False

    @abstractmethod
    def build_metadata(self, starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int,
                       device: torch.device) -> AttentionMetadata:
        """Describe one step: request i computes tokens [starts[i], starts[i] + lengths[i]), its K/V in the
        blocks of block_tables[i]; tokens are laid out flat, request after request."""

    def allocate_buffers(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                         device: torch.device) -> None:
        """Persistent buffers for steps of up to these sizes (the runner calls this once at start); a
        backend that builds fresh tensors each step ignores it."""

    def graph_metadata(self, num_seqs: int, block_size: int) -> AttentionMetadata:
        """Metadata over the persistent buffers for a graph of `num_seqs` one-token sequences; build_metadata
        refills those buffers before each replay. Only for backends that support graphs."""
        raise NotImplementedError(f"the {self.name} attention backend does not run under CUDA graphs")

    @abstractmethod
    def forward(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Write this step's k, v (tokens, kv_heads, dim) into the layer's cache, then return the attention
        of q (tokens, heads, dim) over each request's keys, causal, as (tokens, heads, dim)."""


def flat_positions(starts: list[int], lengths: list[int], table: torch.Tensor, block_size: int):
    """Per-token (positions, slot mapping) of a step, on the CPU, with the per-request tensors they came
    from: (positions, slot_mapping, start, lens, offsets). `table`: (requests, max_blocks) block ids."""
    lens = torch.tensor(lengths, dtype=torch.long)
    start = torch.tensor(starts, dtype=torch.long)
    offsets = torch.cumsum(lens, 0) - lens  # flat index of each request's first token
    req_of_token = torch.repeat_interleave(torch.arange(len(starts)), lens)
    positions = torch.arange(int(lens.sum())) - offsets[req_of_token] + start[req_of_token]
    slot_mapping = table[req_of_token, positions // block_size] * block_size + positions % block_size
    return positions, slot_mapping, start, lens, offsets


def per_query_inputs(starts: list[int], lengths: list[int], block_tables: list[list[int]]):
    """The step as one one-token request per query (batch-invariant mode): the token at position p of a
    request attends to that request's keys 0..p (its K/V are written before attention) through a
    decode kernel, so what its sums run over depends only on its own request, never on the batch or on
    how its prompt was chunked. Returns (starts, lengths, block_tables) for build_metadata."""
    per_token_starts, per_token_tables = [], []
    for start, length, table in zip(starts, lengths, block_tables):
        per_token_starts.extend(range(start, start + length))
        per_token_tables.extend([table] * length)
    return per_token_starts, [1] * len(per_token_starts), per_token_tables


def padded_block_table(block_tables: list[list[int]], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """(requests, longest table) with short tables padded by block 0 (never read past a request's keys).
    One tensor from padded lists (64 tables: ~0.1 ms; a row assignment per request took ~0.8 ms)."""
    width = max(len(t) for t in block_tables)
    return torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=dtype)


_metadata: list[AttentionMetadata] | None = None  # one per KV group (kv_layout.py)
_forward_count = 0  # forwards entered so far: names the current one


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata | list[AttentionMetadata]):
    """Make this step's attention metadata visible to every attention layer during one forward: one, or one
    per KV group (each layer reads its group's: kv_layout.py)."""
    global _metadata, _forward_count
    prev, _metadata = _metadata, [metadata] if isinstance(metadata, AttentionMetadata) else list(metadata)
    _forward_count += 1
    try:
        yield
    finally:
        _metadata = prev


def current_metadata(group: int = 0) -> AttentionMetadata | None:
    return None if _metadata is None else _metadata[group]


def current_forward_id() -> int:
    """A number that changes with every forward: what per-forward caches are keyed on (a graph's twin
    replays the same tensors, so their identity does not tell one forward from the next)."""
    return _forward_count
