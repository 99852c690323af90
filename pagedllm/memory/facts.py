"""The inputs of a memory plan: read from files for a dry run, or measured by a running engine."""
from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

from pagedllm.config import graph_batch_sizes
from pagedllm.memory.device import DeviceMemory, host_to_device_bytes_per_s
from pagedllm.memory.model_size import (
    estimate_activation_bytes,
    estimate_graph_pool_bytes,
    kv_bytes_per_token,
    layer_weight_bytes_from_config,
    layer_weight_bytes_from_headers,
    weight_bytes_from_config,
    weight_bytes_from_headers,
)
from pagedllm.memory.plan import MiB, DeviceFacts, MemoryPlan, ModelFacts, PlanSettings
from pagedllm.kv_layout import KVCacheLayout
from pagedllm.model_executor.moe import experts_summary
from pagedllm.model_executor.quant import checkpoint_quant

# Runtime overhead a dry run assumes: on a GPU the CUDA context, the kernels PyTorch and cuBLAS load
# and their workspaces; the Python interpreter, torch and tokenizer on a CPU. The engine measures its
# own. Measured on an H200 (torch 2.11, CUDA 13, Llama-3.1-8B shape, docs/history/benchmarks-diary.md): 855-876 MiB.
ESTIMATED_OVERHEAD = {"cuda": 896 * MiB, "cpu": 512 * MiB}
# Page-locked host memory is mapped into the GPU's address space: --cpu-offload-gb's host buffers add
# to the device-side overhead (H200: +80 MiB for 11.78 GiB offloaded, ~0.7%).
CUDA_OFFLOAD_MAPPING_SHARE = 0.008
# The caching allocator takes device memory in segments: its reserved peak over a profile step is
# above the live tensors that estimate_activation_bytes models (H200, Llama-3.1-8B, 2048 tokens and
# 256 sampled rows: 1580 MiB reserved for 1355 MiB estimated, 1.17x).
CUDA_ALLOCATOR_SHARE = 1.2


def estimated_overhead_bytes(device: str, cpu_offload_bytes: int = 0) -> int:
    base = ESTIMATED_OVERHEAD.get(device, 512 * MiB)
    return base + offload_mapping_bytes(device, cpu_offload_bytes)


def offload_mapping_bytes(device: str, cpu_offload_bytes: int) -> int:
    """Device memory the mapping of --cpu-offload-gb's page-locked host buffers takes."""
    return int(cpu_offload_bytes * CUDA_OFFLOAD_MAPPING_SHARE) if device.startswith("cuda") else 0


def device_facts(mem: DeviceMemory, source: str = "measured", host: DeviceMemory | None = None,
                 h2d_bytes_per_s: float | None = None) -> DeviceFacts:
    """`host`: the host's memory, where the swap space of a discrete GPU goes (None on CPU: the device)."""
    host_total, host_used = (host.total_bytes, host.used_by_others_bytes) if host is not None else (None, None)
    return DeviceFacts(mem.device, mem.total_bytes, mem.used_by_others_bytes, mem.unified, mem.name, source,
                       host_total, host_used, mem.page_cache_bytes, h2d_bytes_per_s)


def _stored_format(hf_config) -> str:
    stored = checkpoint_quant(hf_config)
    return "" if stored is None else stored.describe()


def dry_run_model_facts(hf_config, weight_files: list[Path], model_max_len: int, device: str) -> ModelFacts:
    """Weights from safetensors headers (exact) or config shapes; activations and overhead estimated."""
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    if weight_files:
        stored = checkpoint_quant(hf_config)
        all_bytes = cache(lambda dtype, quant: weight_bytes_from_headers(weight_files, dtype, tied, quant,
                                                                         stored=stored))
        layer_bytes = cache(lambda dtype, quant: layer_weight_bytes_from_headers(weight_files, dtype, quant, stored))
        weights_source = "safetensors headers"
    else:
        all_bytes = cache(lambda dtype, quant: weight_bytes_from_config(hf_config, dtype, quant))
        layer_bytes = cache(lambda dtype, quant: layer_weight_bytes_from_config(hf_config, dtype, quant))
        weights_source = "config shapes"
    head_copy = cache(lambda dtype: _cpu_head_copy_bytes(hf_config, dtype) if device == "cpu" else 0)
    return ModelFacts(
        model_max_len=model_max_len,
        weight_bytes=lambda s: (all_bytes(s.dtype, s.quantization) + head_copy(s.dtype)) // s.tensor_parallel_size,
        layer_weight_bytes=lambda s: layer_bytes(s.dtype, s.quantization) // s.tensor_parallel_size,
        num_layers=hf_config.num_hidden_layers,
        vocab_size=hf_config.vocab_size,
        activation_bytes=lambda s: int(estimate_activation_bytes(hf_config, s.dtype, s.max_num_batched_tokens,
                                                                 s.max_num_seqs, s.tensor_parallel_size)
                                       * (CUDA_ALLOCATOR_SHARE if device.startswith("cuda") else 1)),
        overhead_bytes=lambda s: estimated_overhead_bytes(device, s.cpu_offload_bytes),
        kv_bytes_per_token=lambda s: kv_bytes_per_token(hf_config, s.kv_dtype, s.tensor_parallel_size),
        weights_source=weights_source,
        experts=experts_summary(hf_config),
        stored_format=_stored_format(hf_config),
        kv_layout=KVCacheLayout.of_config(hf_config),
        graph_pool_bytes=lambda s: int(_graph_pool_estimate(hf_config, s) * CUDA_ALLOCATOR_SHARE),
        head_copy_bytes=lambda s: head_copy(s.dtype) // s.tensor_parallel_size,
    )


def _cpu_head_copy_bytes(hf_config, dtype) -> int:
    from pagedllm.model_executor.cpu_ops import tied_head_copy_bytes  # (the engine's packing, not loaded eagerly)

    return tied_head_copy_bytes(hf_config, dtype)


def _graph_pool_estimate(hf_config, s: PlanSettings) -> int:
    if not s.cuda_graph_sizes:
        return 0
    return estimate_graph_pool_bytes(hf_config, s.dtype, s.cuda_graph_sizes[-1], s.tensor_parallel_size)


def measured_model_facts(hf_config, model_max_len: int, measured_at: PlanSettings, weight_bytes: int,
                         activation_bytes: int, overhead_bytes: int, activation_source: str = "measured",
                         device: str = "cpu", graph_pool_bytes: int | None = None) -> ModelFacts:
    """Numbers the engine measured at `measured_at`; other settings (a lever being tried) scale them
    by the ratio of the estimates, so fixes stay consistent with what was measured. graph_pool_bytes:
    the profiled decode step of the largest CUDA graph size (None: not measured, estimated)."""

    def weights(s: PlanSettings) -> int:
        if (s.dtype, s.quantization) == (measured_at.dtype, measured_at.quantization):
            return weight_bytes

        def est(x: PlanSettings) -> int:
            return weight_bytes_from_config(hf_config, x.dtype, x.quantization)
        return weight_bytes * est(s) // est(measured_at)

    def activations(s: PlanSettings) -> int:
        if (s.dtype, s.max_num_batched_tokens, s.max_num_seqs) == (
                measured_at.dtype, measured_at.max_num_batched_tokens, measured_at.max_num_seqs):
            return activation_bytes

        def est(x: PlanSettings) -> int:
            return estimate_activation_bytes(hf_config, x.dtype, x.max_num_batched_tokens, x.max_num_seqs)
        return int(activation_bytes * est(s) / max(est(measured_at), 1))

    def graph_pool(s: PlanSettings) -> int:
        estimate = int(_graph_pool_estimate(hf_config, s) * CUDA_ALLOCATOR_SHARE)
        if graph_pool_bytes is None:
            return estimate
        return int(graph_pool_bytes * _graph_pool_estimate(hf_config, s) / max(_graph_pool_estimate(hf_config, measured_at), 1))

    return ModelFacts(
        model_max_len=model_max_len,
        weight_bytes=weights,
        layer_weight_bytes=lambda s: layer_weight_bytes_from_config(hf_config, s.dtype, s.quantization),
        num_layers=hf_config.num_hidden_layers,
        vocab_size=hf_config.vocab_size,
        activation_bytes=activations,
        overhead_bytes=lambda s: overhead_bytes + offload_mapping_bytes(device, s.cpu_offload_bytes)
        - offload_mapping_bytes(device, measured_at.cpu_offload_bytes),
        kv_bytes_per_token=lambda s: kv_bytes_per_token(hf_config, s.kv_dtype, s.tensor_parallel_size),
        weights_source="measured",
        experts=experts_summary(hf_config),
        stored_format=_stored_format(hf_config),
        kv_layout=KVCacheLayout.of_config(hf_config),
        activation_source=activation_source,
        overhead_source="measured",
        graph_pool_bytes=graph_pool,
        graph_pool_source="estimated" if graph_pool_bytes is None else "measured: decode step of the largest size",
        head_copy_bytes=(lambda s: _cpu_head_copy_bytes(hf_config, s.dtype) // s.tensor_parallel_size)
        if device == "cpu" else None,
    )


def settings_from(engine_config) -> PlanSettings:
    c = engine_config
    return PlanSettings(
        dtype=c.model.dtype, max_model_len=c.model.max_model_len,
        gpu_memory_utilization=c.cache.gpu_memory_utilization, block_size=c.cache.block_size,
        max_num_seqs=c.scheduler.max_num_seqs, max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
        kv_cache_memory_bytes=c.cache.kv_cache_memory_bytes,
        num_gpu_blocks_override=c.cache.num_gpu_blocks_override, kv_cache_dtype=c.cache.cache_dtype,
        quantization=c.model.quantization, cpu_offload_bytes=c.model.cpu_offload_bytes,
        swap_space_bytes=c.cache.swap_space_bytes, cuda_graph_sizes=planned_graph_sizes(c),
        tensor_parallel_size=c.parallel.tensor_parallel_size, worker_processes=planned_workers(c),
        pooling=c.model.pooler is not None,
        num_speculative_tokens=c.speculative.num_speculative_tokens if c.speculative else 0,
        speculative_method=c.speculative.method if c.speculative else "",
        speculative_max_batch=c.speculative.disable_by_batch_size if c.speculative else None,
        **_draft_settings(c),
    )


def _draft_settings(engine_config) -> dict:
    """A draft model's plan settings: its weights from its config's shapes (the engine replaces them with what it
    loaded) and its K/V values per token."""
    draft = engine_config.draft_model
    if draft is None:
        return {}
    m = draft
    return {"draft_model": m.model, "draft_weight_bytes": weight_bytes_from_config(m.hf_config, m.dtype, None),
            "draft_kv_values_per_token": m.num_layers * 2 * m.num_kv_heads * m.head_dim}


def planned_workers(engine_config) -> tuple[tuple[str, int], ...]:
    """The worker processes a server with these flags may start, and the host memory each may hold."""
    from pagedllm.isolated_worker import TEMPLATE_WORKER_MEMORY_BYTES, TEMPLATE_WORKER_START_BYTES

    c, workers = engine_config, []
    if c.structured_outputs.worker_bytes:
        workers.append(("grammar compiles", c.structured_outputs.worker_bytes))
    if c.request_template_worker:
        workers.append(("request templates", TEMPLATE_WORKER_START_BYTES + TEMPLATE_WORKER_MEMORY_BYTES))
    return tuple(workers)


def planned_graph_sizes(engine_config) -> tuple[int, ...]:
    """The decode sizes a CUDA engine with these flags captures (the engine's runner has the last word:
    it also turns graphs off for a model its backend cannot run); () on a CPU and with --enforce-eager."""
    c = engine_config
    if (not c.device.startswith("cuda") or c.enforce_eager or c.attention_backend not in ("auto", "triton")
            or c.model.cpu_offload_bytes):
        return ()
    return graph_batch_sizes(c.scheduler.max_num_seqs, c.cuda_graph_sizes)


def with_measured_offload_cost(plan: MemoryPlan) -> MemoryPlan:
    """On a discrete GPU where offloading is set or may be offered as a fix, the plan with the host-to-device
    bandwidth measured (a few 128 MiB copies), so it prices --cpu-offload-gb in ms per step."""
    d = plan.device
    if d.device != "cuda" or d.unified or d.h2d_bytes_per_s is not None:
        return plan
    if plan.fits and not plan.settings.cpu_offload_bytes:
        return plan
    return replace(plan, device=replace(d, h2d_bytes_per_s=host_to_device_bytes_per_s()))
