"""Engine configuration: frozen dataclasses built once from the user's arguments."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedllm.kv_layout import KVCacheLayout
from pagedllm.pooler_config import PoolerConfig
from pagedllm.speculative_config import SpeculativeConfig
from pagedllm.structured_output_limits import StructuredOutputLimits

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# --quantization. At load, a 16/32-bit checkpoint's decoder Linears become weight-only int8 or fp8 (per-output-channel
# scales). A quantized checkpoint loads as stored: its quant_method may be named (as vLLM accepts it), and
# `pagedllm plan` also sizes checkpoints stored in int4 (GPTQ / AWQ / compressed-tensors W4A16, groups of 128) or
# nvfp4, which pagedllm loads but does not make at load.
QUANTIZE_AT_LOAD = ("int8", "fp8")
PLANNED_CHECKPOINT_FORMATS = ("int4", "nvfp4")
CHECKPOINT_QUANT_METHODS = ("fp8", "gptq", "awq", "compressed-tensors", "modelopt", "mxfp4")
QUANTIZATION_METHODS = tuple(dict.fromkeys(QUANTIZE_AT_LOAD + PLANNED_CHECKPOINT_FORMATS + CHECKPOINT_QUANT_METHODS))
SCHEDULING_POLICIES = ("fcfs", "priority")  # --scheduling-policy (vLLM's names)
# --preemption-mode, vLLM's names. None (the default): swap when there is swap space and it pays.
PREEMPTION_MODES = ("swap", "recompute")
# --kv-cache-dtype, vLLM's names: "auto" is the model dtype, "fp8" is fp8_e4m3.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype | None, device: str) -> torch.dtype:
    """'auto' takes the checkpoint's dtype, except float16 on CPU, where bfloat16 is faster and safer."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        resolved = checkpoint_dtype or torch.float32
        if resolved == torch.float16 and device == "cpu":
            resolved = torch.bfloat16
    elif dtype in DTYPES:
        resolved = DTYPES[dtype]
    else:
        raise ValueError(f"dtype must be one of 'auto', {', '.join(sorted(DTYPES))}; got {dtype!r}.")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {resolved} is not supported; use float32, bfloat16 or float16.")
    return resolved


def resolve_kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the paged K/V tensors are stored in."""
    if cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {cache_dtype!r}.")
    return KV_CACHE_DTYPES[cache_dtype] or model_dtype


# vLLM's default capture sizes: 1, 2, 4, then every multiple of 8 (up to max_num_seqs).
_SMALL_SIZES = (1, 2, 4)
_SIZE_STEP = 8


def graph_batch_sizes(max_num_seqs: int, sizes: list[int] | tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The batch sizes to capture: `sizes` (--cuda-graph-sizes) or 1, 2, 4, 8, 16, 24, ... up to
    max_num_seqs, which is itself a size, so every decode step has a graph. Sizes above max_num_seqs
    are dropped (no step is that large)."""
    if sizes is None:
        chosen = {s for s in _SMALL_SIZES if s <= max_num_seqs}
        chosen |= set(range(_SIZE_STEP, max_num_seqs + 1, _SIZE_STEP)) | {max_num_seqs}
        return tuple(sorted(chosen))
    bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s < 1]
    if bad or not sizes:
        raise ValueError(f"cuda_graph_sizes must be batch sizes >= 1, got {list(sizes)!r}.")
    return tuple(sorted({s for s in sizes if s <= max_num_seqs})) or (min(max_num_seqs, min(sizes)),)


@dataclass(frozen=True)
class ModelConfig:
    """What model runs and how: the resolved folder, its HF config, dtype and context length."""

    model: str  # as the user named it
    path: Path  # resolved folder (or config.json file for dummy weights)
    hf_config: object = field(repr=False)
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    max_model_len_auto: bool = False  # "auto": the engine lowers max_model_len to what fits
    load_format: str = "auto"
    seed: int = 0
    tokenizer: Path | None = None  # None: no tokenizer files (token-id prompts only)
    quantization: str | None = None  # one of QUANTIZE_AT_LOAD: the decoder Linears' weights, quantized at load
    cpu_offload_bytes: int = 0  # whole decoder layers' weights kept in host memory (--cpu-offload-gb)
    # Audio models: repetition-aware sampling as the checkpoint's generation_config.json sets it (True), or off.
    repetition_aware_sampling: bool = True
    max_logprobs: int = 20  # most logprobs a request may ask for (more than the vocabulary would fail a step)
    pooler: PoolerConfig | None = None  # the pooling runner's (embeddings, classifiers); None: the generate runner

    @property
    def model_max_len(self) -> int:
        """The model's own limit (max_position_embeddings)."""
        return self.hf_config.max_position_embeddings

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def kv_layout(self) -> KVCacheLayout:
        """Which layers share a block table (one group unless sliding-window and full layers mix)."""
        return KVCacheLayout.of_config(self.hf_config)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and how much memory it may take."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None  # an explicit KV budget, overriding the utilization
    cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    enable_prefix_caching: bool = True  # full blocks are found again by the hash of their prefix
    swap_space_bytes: int = 0  # --swap-space: host memory for the K/V of swapped-out requests (0: none)

    def __post_init__(self) -> None:
        resolve_kv_cache_dtype(self.cache_dtype, torch.float32)  # refuse unknown names now
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}.")
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}.")
        if not isinstance(self.swap_space_bytes, int) or self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be an integer >= 0, got {self.swap_space_bytes!r}.")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits: how many requests run at once and how many tokens one step computes."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    preemption_mode: str | None = None  # one of PREEMPTION_MODES; None: swap when it pays, else recompute
    # fcfs: every request is equal (a request's `priority` other than 0 is refused); priority: lower values
    # are scheduled first and preempted last. As vLLM: a client's priority counts only when the operator says so.
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; got {self.policy!r}.")
        if self.preemption_mode is not None and self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)} or None (automatic); "
                             f"got {self.preemption_mode!r}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How many devices one engine spans (tensor parallelism) and what starts their workers."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"  # mp: local processes; ray: actors placed on a Ray cluster
    worker_timeout_s: float = 120.0  # a worker silent this long (or a collective stuck this long) is lost

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}.")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}; got {self.distributed_executor_backend!r}.")
        if self.worker_timeout_s <= 0:
            raise ValueError(f"worker_timeout_s must be > 0, got {self.worker_timeout_s}.")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str = "cpu"
    enforce_eager: bool = False  # no CUDA graphs: every step launched kernel by kernel
    attention_backend: str = "auto"  # --attention-backend: auto, torch, cpu, triton (model_executor/attention)
    cuda_graph_sizes: tuple[int, ...] | None = None  # decode batch sizes to capture; None: 1, 2, 4, 8, 16, ...
    # A step's outputs (detokenization, stop strings) made while the next step runs on the device (LLMEngine.step)
    async_output_proc: bool = False
    # Logits that do not depend on the other requests of a step (model_executor/batch_invariant.py)
    batch_invariant: bool = False
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputLimits = field(default_factory=StructuredOutputLimits)
    request_template_worker: bool = False  # the server's worker for requests' own chat templates (planned)
    speculative: SpeculativeConfig | None = None  # --speculative-config; None: no speculative decoding
    draft_model: ModelConfig | None = None  # speculative method draft_model: the draft's model config

    def __post_init__(self) -> None:
        if self.cuda_graph_sizes is not None:
            graph_batch_sizes(self.scheduler.max_num_seqs, self.cuda_graph_sizes)  # refuse bad sizes now
        mode, swap = self.scheduler.preemption_mode, self.cache.swap_space_bytes
        if mode == "swap" and not swap:
            raise ValueError("preemption_mode 'swap' needs swap space: pass --swap-space GiB (host memory for "
                             "the KV blocks of preempted requests).")
        if mode == "recompute" and swap:
            raise ValueError(f"preemption_mode 'recompute' never uses the {swap} bytes of --swap-space: drop "
                             f"--swap-space, or drop --preemption-mode to swap when it pays.")

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return resolve_kv_cache_dtype(self.cache.cache_dtype, self.model.dtype)
