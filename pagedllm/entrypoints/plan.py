"""`pagedllm plan`: the memory plan from config.json and safetensors headers, loading no weight."""
from __future__ import annotations

from dataclasses import replace

import torch

from pagedllm.config import PLANNED_CHECKPOINT_FORMATS
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.memory.device import DeviceMemory
from pagedllm.memory.device import device_memory as measure_device_memory
from pagedllm.memory.device import host_memory as host_memory_of_this_machine
from pagedllm.memory.facts import device_facts, dry_run_model_facts, settings_from, with_measured_offload_cost
from pagedllm.memory.plan import MemoryPlan
from pagedllm.model_executor.model_files import resolve_model_path, weight_files
from pagedllm.model_executor.quant import checkpoint_quant
from pagedllm.utils import parse_size


def dry_run_plan(args: EngineArgs, device: str = "auto", device_memory: str | None = None,
                 device_memory_used: str | None = None, unified: bool = False,
                 tensor_parallel_size: int = 1, host_memory: str | None = None,
                 page_cache: str | None = None) -> MemoryPlan:
    """`host_memory`: the host's memory beside a given device (where its swap space goes); unknown when
    not given. A measured device's host is measured too. `page_cache`: reclaimable page cache in a given
    device's memory (unified memory or a CPU), beside the `device_memory_used` that is really held."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}.")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device_memory is not None:
        total = parse_size(device_memory)
        used = parse_size(device_memory_used) if device_memory_used is not None else 0
        cache = _given_page_cache(page_cache, device, unified)
        if total <= 0:
            raise ValueError(f"--device-memory must be > 0, got {device_memory!r}.")
        if not 0 <= used <= total:
            raise ValueError(f"--device-memory-used must be between 0 and --device-memory ({device_memory}), "
                             f"got {device_memory_used!r}.")
        if used + cache > total:
            raise ValueError(f"--device-memory-used ({device_memory_used}) and --page-cache ({page_cache}) add up "
                             f"to more than --device-memory ({device_memory}).")
        facts = device_facts(DeviceMemory(device, total, used, unified, "", page_cache_bytes=cache), source="given",
                             host=_given_host(device, host_memory))
    else:
        if device_memory_used is not None:
            raise ValueError("--device-memory-used needs --device-memory (the total it is part of).")
        if page_cache is not None:
            raise ValueError("--page-cache goes with --device-memory (a machine described); a measured device's "
                             "page cache is measured.")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("there is no CUDA device here to measure: pass --device-memory SIZE "
                             "(and --device-memory-used SIZE) to plan for one.")
        mem = measure_device_memory(device)
        if host_memory is not None:
            raise ValueError("--host-memory goes with --device-memory (a machine described, not measured).")
        facts = device_facts(replace(mem, unified=mem.unified or unified),
                             host=None if device == "cpu" else host_memory_of_this_machine())

    # --quantization int4 / nvfp4: the checkpoint of this model stored so, sized (the engine loads such checkpoints;
    # it does not make them at load).
    planned = args.quantization if args.quantization in PLANNED_CHECKPOINT_FORMATS else None
    args = replace(args, device=device, tensor_parallel_size=tensor_parallel_size,  # refused if it cannot split
                   quantization=None if planned else args.quantization)
    if args.model is not None and resolve_model_path(args.model, args.revision).is_file():
        args.load_format = "dummy"  # a bare config: weights sized from its shapes
    config = args.create_engine_config()
    if planned and checkpoint_quant(config.model.hf_config) is not None:
        raise ValueError(f"--quantization {planned} sizes a 16/32-bit model's checkpoint stored in {planned}; this "
                         f"checkpoint is already quantized.")
    settings = settings_from(config)
    settings = replace(settings, tensor_parallel_size=tensor_parallel_size,
                       quantization=planned or settings.quantization,
                       max_model_len=None if config.model.max_model_len_auto else settings.max_model_len)
    files = weight_files(config.model.path) if config.model.load_format != "dummy" else []
    model = dry_run_model_facts(config.model.hf_config, files, config.model.model_max_len, device)
    plan = MemoryPlan(settings, facts, model)
    return with_measured_offload_cost(plan) if device_memory is None else plan


def _given_page_cache(page_cache: str | None, device: str, unified: bool) -> int:
    if page_cache is None:
        return 0
    if device != "cpu" and not unified:
        raise ValueError("--page-cache is page cache in the device's memory: it goes with --unified-memory "
                         "(or --device cpu); a discrete GPU's memory holds none.")
    return parse_size(page_cache)


def _given_host(device: str, host_memory: str | None) -> DeviceMemory | None:
    if host_memory is None or device == "cpu":  # on CPU the device is the host
        return None
    total = parse_size(host_memory)
    if total <= 0:
        raise ValueError(f"--host-memory must be > 0, got {host_memory!r}.")
    return DeviceMemory("cpu", total, 0, unified=False, name="host memory")
