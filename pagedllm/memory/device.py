"""What memory the device has: a discrete CUDA GPU, a unified-memory one (GB10, GH200, Jetson), or
the host and its cgroup limit.

Three rules keep the readings honest:
- The page cache is not "used": the kernel hands it back under pressure. Wherever the device's memory
  is the host's RAM (CPU, unified memory), free memory comes from MemAvailable (or, in a cgroup with
  a limit, the limit less what the cgroup holds besides its file pages), and the reclaimable page
  cache is reported on its own. cudaMemGetInfo on an integrated GPU is close to MemFree and would
  blame other processes for a checkpoint the kernel merely cached.
- This process's own memory is the engine's, not "other processes'": its resident set (host RAM),
  PyTorch's reserved device memory and the CUDA context the first reading creates. The context is
  measured by reading free memory just before and just after it is created (through NVML on a
  discrete GPU, which needs no context; through MemAvailable on unified memory).
- What the engine holds later is the device's used memory less what others held at the start.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from pagedllm.memory import nvml

logger = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
CGROUP_V2, CGROUP_V1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")
# A CUDA context plus PyTorch's start-up allocations are a few hundred MiB; a larger difference between
# the readings around its creation is another process's doing, not ours.
MAX_CONTEXT_BYTES = 4 << 30


@dataclass(frozen=True)
class DeviceMemory:
    device: str  # "cpu" or "cuda"
    total_bytes: int  # all memory the engine's device has (cgroup limit on CPU where lower)
    used_by_others_bytes: int  # really held by others (not this process, not reclaimable page cache)
    unified: bool  # device memory shared with the CPU and the OS (Grace/DGX Spark, integrated GPUs)
    name: str = ""
    # Reclaimable page cache in the same memory (CPU, unified memory): counted as available.
    page_cache_bytes: int = 0

    @property
    def available_bytes(self) -> int:
        return self.total_bytes - self.used_by_others_bytes


@dataclass(frozen=True)
class SystemMemory:
    """Host RAM as the kernel sees it (cgroup-aware): total, really held, reclaimable page cache."""

    total_bytes: int
    held_bytes: int  # not reclaimable: processes, kernel, shared memory
    page_cache_bytes: int  # reclaimable file pages, counted as available

    @property
    def available_bytes(self) -> int:
        return self.total_bytes - self.held_bytes


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo() -> dict[str, int]:
    info = {}
    try:
        for line in MEMINFO.read_text().splitlines():
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return info


def _cgroup_stat(path: Path) -> dict[str, int]:
    stat = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                stat[key] = int(value)
    except OSError:
        pass
    return stat


def _cgroup_memory() -> tuple[int, int, int] | None:
    """(limit, usage, reclaimable file pages) of this process's memory cgroup, where a limit is set."""
    for limit_file, usage_file, stat_file, prefix in (
            (CGROUP_V2 / "memory.max", CGROUP_V2 / "memory.current", CGROUP_V2 / "memory.stat", ""),
            (CGROUP_V1 / "memory.limit_in_bytes", CGROUP_V1 / "memory.usage_in_bytes", CGROUP_V1 / "memory.stat",
             "total_")):
        limit = _read_int(limit_file)
        if limit is None or limit >= (1 << 60):
            continue
        usage = _read_int(usage_file) or 0
        stat = _cgroup_stat(stat_file)
        files = stat.get(f"{prefix}active_file", 0) + stat.get(f"{prefix}inactive_file", 0)
        return limit, usage, min(files, usage)
    return None


def system_memory() -> SystemMemory:
    """The host's RAM: MemTotal less what MemAvailable says is not reclaimable; in a cgroup with a lower
    limit, that limit less what the cgroup holds besides its (reclaimable) file pages."""
    info = _meminfo()
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = min(info.get("MemAvailable", total), total)
    page_cache = max(0, available - info.get("MemFree", available))
    held = total - available
    cgroup = _cgroup_memory()
    if cgroup is not None and cgroup[0] < total:
        limit, usage, files = cgroup
        total, held, page_cache = limit, min(max(0, usage - files), limit), files
    return SystemMemory(total, held, page_cache)


def _own_rss() -> int:
    try:
        fields = Path("/proc/self/statm").read_text().split()
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def host_memory() -> DeviceMemory:
    """Host RAM for a CPU engine (and the host beside a discrete GPU): others' use excludes this
    process's resident set and the reclaimable page cache."""
    mem = system_memory()
    return DeviceMemory("cpu", mem.total_bytes, max(0, mem.held_bytes - _own_rss()), unified=False,
                        name="host memory", page_cache_bytes=mem.page_cache_bytes)


# Bytes of this process's CUDA context per device, measured once when the first reading created it.
_context_bytes: dict[int, int] = {}


def _remember_context(index: int, size: int | None) -> int:
    """The context's size, from readings just before and just after this process's first CUDA call,
    kept for the process's later readings; 0 (it is then counted with others) where it existed already
    or the readings could not tell."""
    if index not in _context_bytes:
        _context_bytes[index] = size if size is not None and 0 <= size <= MAX_CONTEXT_BYTES else 0
        logger.debug("CUDA context on device %d: %d bytes", index, _context_bytes[index])
    return _context_bytes[index]


def _cuda_index(index: int | None) -> int:
    import torch

    if index is not None:
        return index
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


def cuda_memory(index: int | None = None) -> DeviceMemory:
    """A CUDA device's memory. The first reading in a process comes before any CUDA call of its own, so
    the context that call creates is measured as this process's and not counted with others."""
    import torch

    index = _cuda_index(index)
    first = index not in _context_bytes
    nvml_before = nvml.free_bytes(index) if first else None
    # Unified memory: what others and this process's resident set held before its first CUDA call.
    others_before = system_memory().held_bytes - _own_rss() if first else None
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    reserved = torch.cuda.memory_reserved(index)
    if getattr(props, "is_integrated", False):
        return _unified_cuda_memory(index, props.name, total, reserved, others_before)
    nvml_after = nvml.free_bytes(index) if first else None
    context = _remember_context(index, None if nvml_before is None or nvml_after is None
                                else nvml_before - nvml_after - reserved)
    return DeviceMemory("cuda", total, max(0, total - free - reserved - context), unified=False, name=props.name)


def _unified_cuda_memory(index: int, name: str, device_total: int, reserved: int,
                         others_before: int | None) -> DeviceMemory:
    """An integrated GPU: total from the device (within the cgroup's limit); what others hold and the
    page cache from the kernel's accounting, not from cudaMemGetInfo's free (about MemFree)."""
    mem = system_memory()
    others_and_context = mem.held_bytes - _own_rss() - reserved
    # The context's size is what others seem to have gained across this process's first CUDA call.
    context = _remember_context(index, None if others_before is None else others_and_context - others_before)
    total = min(device_total, mem.total_bytes)
    others = min(total, others_and_context - context)
    return DeviceMemory("cuda", total, max(0, others), unified=True, name=name,
                        page_cache_bytes=min(mem.page_cache_bytes, total))


def device_memory(device: str) -> DeviceMemory:
    if device.startswith("cuda"):
        return cuda_memory(int(device.split(":")[1]) if ":" in device else None)
    return host_memory()


def held_since(device: str, at_start: DeviceMemory) -> int:
    """What this process holds on `device` now: the device's used memory less what others held at
    `at_start` (weights, caches, the CUDA context and libraries, everything)."""
    if device.startswith("cuda"):
        import torch

        index = _cuda_index(int(device.split(":")[1]) if ":" in device else None)
        if at_start.unified:
            used = system_memory().held_bytes
        else:
            free, total = torch.cuda.mem_get_info(index)
            used = total - free
        return max(0, used - at_start.used_by_others_bytes)
    return _own_rss()


def host_to_device_bytes_per_s(index: int | None = None, size: int = 128 << 20, repeats: int = 3) -> float | None:
    """Pinned host -> device copy bandwidth (the best of `repeats` copies of `size` bytes, ~10 ms in all);
    None without CUDA or where it fails. What each --cpu-offload-gb layer costs per forward."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        device = torch.device("cuda", _cuda_index(index))
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(size, dtype=torch.uint8, device=device)
        dev.copy_(host, non_blocking=True)  # warm-up
        torch.cuda.synchronize(device)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t)
        del host, dev
        torch.cuda.empty_cache()  # nothing of this stays with the engine's allocators
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()
        return size / best
    except RuntimeError as e:
        logger.warning("could not measure the host-to-device bandwidth: %s", e)
        return None
