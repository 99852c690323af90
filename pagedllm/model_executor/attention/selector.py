"""Choosing the attention backend once, at start (`--attention-backend`): a backend that cannot run the
model on this device is refused with the reason and the backends that can; `auto` takes the first
that can of triton, torch (CUDA) or cpu, torch (CPU). Never a silent fallback inside a step."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from pagedllm.model_executor.attention.base import AttentionBackend

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
TRITON_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttentionShape:
    """What a backend must support: the model's attention and where it runs."""

    device: torch.device
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's (queries)
    kv_dtype: torch.dtype  # the KV cache's


def unsupported_reason(name: str, shape: AttentionShape) -> str | None:
    """Why backend `name` cannot run `shape`; None when it can."""
    if name == "torch":
        return None
    if name == "cpu":
        from pagedllm.model_executor.attention.cpu_backend import DECODE_KERNEL_HEAD_DIMS
        from pagedllm.model_executor.cpu_isa import cpu_kernels

        if shape.device.type != "cpu":
            return "it runs on the CPU only"
        if shape.dtype not in (torch.float32, torch.bfloat16):
            return f"its kernels compute in float32 or bfloat16, not {_name(shape.dtype)}"
        if shape.kv_dtype != shape.dtype:
            return f"its kernels read a KV cache in the model dtype ({_name(shape.dtype)}), not {_name(shape.kv_dtype)}"
        if shape.head_dim not in DECODE_KERNEL_HEAD_DIMS:
            return (f"its decode kernel is built for head sizes {', '.join(map(str, DECODE_KERNEL_HEAD_DIMS))}, "
                    f"not {shape.head_dim}")
        if cpu_kernels() is None:
            if os.environ.get("PAGEDLLM_CPU_ISA", "").strip().lower() == "none":
                return "PAGEDLLM_CPU_ISA=none turns the native CPU kernels off"
            return "the native CPU kernels could not be built here (see the warning above)"
        return None
    if name == "triton":
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if shape.device.type != "cuda" and not (shape.device.type == "cpu" and interpreted):
            return "it runs on CUDA GPUs (on the CPU only under TRITON_INTERPRET=1, for tests)"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed (it comes with PyTorch's CUDA builds; `pip install triton`)"
        if shape.head_dim > TRITON_MAX_HEAD_DIM:
            return f"its kernels take head sizes up to {TRITON_MAX_HEAD_DIM}, not {shape.head_dim}"
        if shape.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"its kernels compute in float32, bfloat16 or float16, not {_name(shape.dtype)}"
        return None
    raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}.")


def select_attention_backend(name: str, shape: AttentionShape, batch_invariant: bool = False) -> AttentionBackend:
    """`batch_invariant`: the backend must attend each query over its own keys in an order that does not
    depend on the batch (batch_invariant.py): the cpu and triton backends can, the torch one cannot."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}.")
    reasons = {b: unsupported_reason(b, shape) for b in ATTENTION_BACKENDS[1:]}
    if batch_invariant:
        reasons["torch"] = ("in batch-invariant mode: its sums over keys depend on the batch (keys padded to the "
                            "longest request's)")
    if name == "auto":
        order = ("triton", "torch") if shape.device.type == "cuda" else ("cpu", "torch")
        name = next((b for b in order if reasons[b] is None), None)
        if name is None:  # only in batch-invariant mode: torch always can otherwise
            raise ValueError("--batch-invariant needs an attention backend that attends each query over its own "
                             "keys: " + "; ".join(f"{b} cannot ({reasons[b]})" for b in order)
                             + ". Drop --batch-invariant (seeded requests then stay reproducible run to run, "
                             "not across batches).")
        skipped = [f"{b} ({reasons[b]})" for b in order[:order.index(name)]]
        logger.info("attention backend: %s%s", name, f" (not {'; '.join(skipped)})" if skipped else "")
    elif reasons[name] is not None:
        able = [b for b, why in reasons.items() if why is None]
        raise ValueError(f"--attention-backend {name} cannot run this model here: {reasons[name]}. Backends that "
                         f"can: {', '.join(able)} (or auto).")
    return _make(name, shape.device, batch_invariant)


def select_attention_backends(name: str, shape: AttentionShape, batch_invariant: bool, count: int
                              ) -> list[AttentionBackend]:
    """`count` instances of the backend select_attention_backend chooses: one per KV group, each with its own
    step metadata and persistent buffers (kv_layout.py)."""
    first = select_attention_backend(name, shape, batch_invariant)
    return [first] + [_make(first.name, shape.device, batch_invariant) for _ in range(count - 1)]


def _make(name: str, device: torch.device, batch_invariant: bool = False) -> AttentionBackend:
    if name == "torch":
        from pagedllm.model_executor.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        from pagedllm.model_executor.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(batch_invariant)
    from pagedllm.model_executor.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(device, batch_invariant)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
