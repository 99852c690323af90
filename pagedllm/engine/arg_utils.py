"""EngineArgs: the user's settings (vLLM's names) turned into the engine's frozen configs."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields

import torch

from pagedllm.config import (
    LOAD_FORMATS,
    QUANTIZATION_METHODS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    resolve_dtype,
)
from pagedllm.structured_output_limits import StructuredOutputLimits
from pagedllm.errors import UnsupportedModelError
from pagedllm.model_executor.model_files import has_tokenizer, load_hf_config, resolve_model_path
from pagedllm.utils import gib_to_bytes

logger = logging.getLogger(__name__)


def parse_size(value: str | int | float | None) -> int | None:
    """'128GiB', '119.7GB', '512MiB', '4G' or plain bytes -> bytes."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else int(value)
    text = value.strip().replace(" ", "")
    units = {"tib": 1 << 40, "gib": 1 << 30, "mib": 1 << 20, "kib": 1 << 10,
             "tb": 10**12, "gb": 10**9, "mb": 10**6, "kb": 10**3,
             "t": 1 << 40, "g": 1 << 30, "m": 1 << 20, "k": 1 << 10, "b": 1}
    lower = text.lower()
    for suffix, factor in units.items():
        if lower.endswith(suffix):
            number = lower[: -len(suffix)]
            break
    else:
        number, factor = lower, 1
    try:
        size = int(float(number) * factor)
    except (ValueError, OverflowError):
        raise ValueError(f"cannot read {value!r} as a memory size; use e.g. 128GiB, 119.7GB, 512MiB or bytes") from None
    if size < 0:
        raise ValueError(f"a memory size cannot be negative, got {value!r}")
    return size


@dataclass
class EngineArgs:
    model: str | None = None  # None: the built-in demo model
    tokenizer: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | str | None = None  # None: the model's limit; "auto": the largest that fits
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | str | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"  # auto (the model dtype), bfloat16, float16, float32, fp8, fp8_e4m3, fp8_e5m2
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs (vLLM's flag)
    cuda_graph_sizes: list[int] | None = None  # decode batch sizes captured in CUDA graphs; None: 1, 2, 4, 8, 16, ...
    # Make a step's outputs while the next runs on the device; None: on CUDA yes, on a CPU no (nothing to overlap:
    # its steps run on the host). disable_async_output_proc is vLLM's flag for False.
    async_output_proc: bool | None = None
    disable_async_output_proc: bool = False
    attention_backend: str = "auto"  # auto, torch, cpu or triton: how attention is computed (chosen at start)
    # A request's logits independent of the rest of its batch (seeded draws the same in any batch; slower).
    # None: VLLM_BATCH_INVARIANT=1 in the environment (vLLM's switch) turns it on.
    batch_invariant: bool | None = None
    tensor_parallel_size: int = 1  # ranks one model is split across (torch.distributed)
    distributed_executor_backend: str | None = None  # mp (local processes, the default) or ray
    load_format: str = "auto"
    device: str = "auto"
    quantization: str | None = None  # "int8": weight-only int8 decoder Linears, quantized at load
    cpu_offload_gb: float = 0.0  # GiB of whole decoder layers' weights kept in host memory (CUDA only)
    swap_space: float = 0.0  # GiB of host memory for preempted requests' KV blocks (vLLM's default: 4)
    preemption_mode: str | None = None  # "swap" | "recompute"; None: swap when there is swap space and it pays
    scheduling_policy: str = "fcfs"  # "priority": requests' `priority` orders scheduling and preemption
    # Audio models: False turns off repetition-aware sampling (RAS), which the checkpoint's generation_config.json
    # may set (ras_win_len / ras_win_max_num_repeat); RAS redraws repeated codes at random, even for greedy requests.
    repetition_aware_sampling: bool = True
    # What one structured-output constraint may be and cost (structured_output_limits.py); a compile timeout
    # compiles in a worker process killed at the deadline (the server's default: 10 s); None compiles here.
    structured_outputs_max_bytes: int = StructuredOutputLimits.max_spec_bytes
    structured_outputs_max_properties: int = StructuredOutputLimits.max_properties
    structured_outputs_max_alternatives: int = StructuredOutputLimits.max_alternatives
    structured_outputs_max_depth: int = StructuredOutputLimits.max_depth
    structured_outputs_compile_timeout: float | None = None
    structured_outputs_compile_memory: int | str = StructuredOutputLimits.compile_memory_bytes
    # The server renders requests' own chat templates in a worker process (--trust-request-chat-template): its
    # memory is in the plan.
    request_template_worker: bool = False

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        if self.model is None:
            from pagedllm.demo import demo_model_path

            self.model = str(demo_model_path())
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}.")
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda'; got {device!r}.")
        path = resolve_model_path(self.model, self.revision)
        if path.is_file() and self.load_format != "dummy":
            raise ValueError(f"{path} is a config file, not a model folder: pass load_format='dummy' to run "
                             f"its shape with random weights.")
        hf_config = load_hf_config(path)
        self._verify_quantization(hf_config)
        cpu_offload_bytes = self._cpu_offload_bytes(device)
        from pagedllm.model_executor.models.registry import get_model_class

        architecture, model_cls = get_model_class(hf_config)
        parallel = self._parallel_config(hf_config, model_cls)
        checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = getattr(torch, checkpoint_dtype, None)
        dtype = resolve_dtype(self.dtype, checkpoint_dtype, device)
        max_model_len = self._max_model_len(hf_config)
        tokenizer = self.tokenizer or (str(path) if has_tokenizer(path) else None)
        model_config = ModelConfig(
            model=self.model, path=path, hf_config=hf_config, architecture=architecture, dtype=dtype,
            max_model_len=max_model_len, max_model_len_auto=self.max_model_len in ("auto", -1),
            load_format=self.load_format, seed=self.seed,
            tokenizer=tokenizer, quantization=self.quantization, cpu_offload_bytes=cpu_offload_bytes,
            repetition_aware_sampling=self.repetition_aware_sampling,
        )
        cache = CacheConfig(
            block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            kv_cache_memory_bytes=parse_size(self.kv_cache_memory), cache_dtype=self.kv_cache_dtype,
            enable_prefix_caching=self.enable_prefix_caching, swap_space_bytes=self._swap_space_bytes(),
        )
        batched = self.max_num_batched_tokens or 2048
        scheduler = SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched,
                                    max_model_len=max_model_len, preemption_mode=self.preemption_mode,
                                    policy=self.scheduling_policy)
        return EngineConfig(model=model_config, cache=cache, scheduler=scheduler, device=device,
                            enforce_eager=self.enforce_eager, attention_backend=self._attention_backend(),
                            cuda_graph_sizes=None if self.cuda_graph_sizes is None else tuple(self.cuda_graph_sizes),
                            async_output_proc=self._async_output_proc(device),
                            batch_invariant=self._batch_invariant(), parallel=parallel,
                            structured_outputs=self._structured_output_limits(),
                            request_template_worker=self.request_template_worker)

    def _structured_output_limits(self) -> StructuredOutputLimits:
        return StructuredOutputLimits(
            max_spec_bytes=self.structured_outputs_max_bytes, max_properties=self.structured_outputs_max_properties,
            max_alternatives=self.structured_outputs_max_alternatives, max_depth=self.structured_outputs_max_depth,
            compile_timeout_s=self.structured_outputs_compile_timeout,
            compile_memory_bytes=parse_size(self.structured_outputs_compile_memory))

    def _async_output_proc(self, device: str) -> bool:
        if self.disable_async_output_proc:
            if self.async_output_proc:
                raise ValueError("async_output_proc=True and disable_async_output_proc=True contradict each other.")
            return False
        return device.startswith("cuda") if self.async_output_proc is None else bool(self.async_output_proc)

    def _parallel_config(self, hf_config, model_cls) -> ParallelConfig:
        from pagedllm.distributed.sharding import verify_tensor_parallel_size

        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool):
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}.")
        if tp > 1:
            if not getattr(model_cls, "supports_tensor_parallel", False):
                raise UnsupportedModelError(f"--tensor-parallel-size {tp}: {model_cls.__name__} runs on one device "
                                            f"only for now (Llama, Mistral, Qwen2 and Qwen3 can be split).")
            verify_tensor_parallel_size(hf_config, tp)
        timeout = os.environ.get("PAGEDLLM_WORKER_TIMEOUT_S", "120")
        try:
            timeout_s = float(timeout)
        except ValueError:
            raise ValueError(f"PAGEDLLM_WORKER_TIMEOUT_S must be a number of seconds, got {timeout!r}.") from None
        return ParallelConfig(tensor_parallel_size=tp, worker_timeout_s=timeout_s,
                              distributed_executor_backend=self.distributed_executor_backend or "mp")

    def _batch_invariant(self) -> bool:
        if self.batch_invariant is not None:
            return bool(self.batch_invariant)
        from pagedllm.model_executor.batch_invariant import ENV_VAR

        value = os.environ.get(ENV_VAR, "0")
        if value not in ("0", "1"):
            raise ValueError(f"{ENV_VAR} must be 0 or 1, got {value!r}.")
        return value == "1"

    def _attention_backend(self) -> str:
        from pagedllm.model_executor.attention import ATTENTION_BACKENDS

        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                             f"got {self.attention_backend!r}.")
        return self.attention_backend

    def _verify_quantization(self, hf_config) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None (off); "
                             f"got {self.quantization!r}.")
        checkpoint_quant = getattr(hf_config, "quantization_config", None)
        if checkpoint_quant and self.load_format != "dummy":
            method = (checkpoint_quant.get("quant_method") if isinstance(checkpoint_quant, dict)
                      else getattr(checkpoint_quant, "quant_method", None))
            raise UnsupportedModelError(
                f"this checkpoint is already quantized (config.json has a quantization_config, quant_method "
                f"{method!r}); pagedllm loads 16/32-bit checkpoints only. Use the unquantized checkpoint, with "
                f"--quantization int8 for int8 weights.")

    def _cpu_offload_bytes(self, device: str) -> int:
        """--cpu-offload-gb in bytes; refused where there is no accelerator memory to relieve."""
        if not isinstance(self.cpu_offload_gb, (int, float)) or self.cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0, got {self.cpu_offload_gb!r}.")
        if self.cpu_offload_gb and device == "cpu":
            raise ValueError(
                f"--cpu-offload-gb {self.cpu_offload_gb:g} has nothing to do on a CPU-only engine (device cpu): "
                f"offloading moves weights from accelerator memory to host memory, and here the weights already "
                f"live in host memory. Remove --cpu-offload-gb; to make the weights smaller, use "
                f"--quantization int8 (or --dtype bfloat16).")
        return gib_to_bytes(self.cpu_offload_gb)

    def _swap_space_bytes(self) -> int:
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}.")
        return gib_to_bytes(self.swap_space)

    def _max_model_len(self, hf_config) -> int:
        derived = getattr(hf_config, "max_position_embeddings", None)
        if derived is None:
            raise UnsupportedModelError("config.json has no max_position_embeddings; pass max_model_len.")
        if self.max_model_len is None or self.max_model_len in ("auto", -1):
            return derived
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}.")
        if self.max_model_len > derived:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's max_position_embeddings "
                f"({derived}); positions past it were never trained. Use max_model_len <= {derived}."
            )
        return self.max_model_len
