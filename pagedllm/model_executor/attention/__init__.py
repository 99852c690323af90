"""Paged attention: a PagedAttention module per layer (its views of the KV cache), and the backends
that compute it, one chosen at start: `torch` (PyTorch ops, any device: the reference), `cpu` (the
native kernels of cpu_kernels) and `triton` (CUDA kernels that read the cache in place)."""
from pagedllm.model_executor.attention.base import AttentionBackend, AttentionMetadata, forward_context
from pagedllm.model_executor.attention.layer import PagedAttention, bind_kv_cache, kv_cache_shape
from pagedllm.model_executor.attention.selector import (
    ATTENTION_BACKENDS,
    AttentionShape,
    select_attention_backend,
    select_attention_backends,
    unsupported_reason,
)
from pagedllm.model_executor.attention.torch_backend import AttentionGroup, TorchAttentionBackend

__all__ = [
    "ATTENTION_BACKENDS", "AttentionBackend", "AttentionGroup", "AttentionMetadata", "AttentionShape",
    "PagedAttention", "TorchAttentionBackend", "bind_kv_cache", "build_attention_metadata", "forward_context",
    "kv_cache_shape", "select_attention_backend", "select_attention_backends", "unsupported_reason",
]


def build_attention_metadata(starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int,
                             device, backend: AttentionBackend | None = None) -> AttentionMetadata:
    """A step's metadata for `backend` (the torch backend when None): for tests and harnesses that drive
    a model without a model runner."""
    return (backend or TorchAttentionBackend()).build_metadata(starts, lengths, block_tables, block_size, device)
