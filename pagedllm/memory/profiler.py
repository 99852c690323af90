"""Measuring what the engine itself uses: peak memory of a callable, and the runtime's overhead.

CUDA: the caching allocator's peak of reserved memory (what it takes from the device, segments and
rounding included, not only the tensors' bytes), from an emptied cache. CPU: the process's
resident-set high-water mark, reset just before the measurement through /proc/self/clear_refs
(Linux >= 4.0).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from pagedllm.memory.device import DeviceMemory, held_since


def _status_bytes(key: str) -> int | None:
    try:
        m = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def rss_bytes() -> int | None:
    return _status_bytes("VmRSS")


def measure_peak_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Peak memory `fn` adds above what was in use when it started; None when it can't be measured."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_reserved(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_reserved(device) - before)
    _release_free_heap()  # so the run's allocations show up as new resident pages
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    except OSError:
        return None
    before = rss_bytes()
    fn()
    peak = _status_bytes("VmHWM")
    if before is None or peak is None:
        return None
    return max(0, peak - before)


def _release_free_heap() -> None:
    """Give memory glibc holds free back to the OS (memory reused from it would go uncounted)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def runtime_overhead_bytes(device: torch.device, weight_bytes: int, at_start: DeviceMemory) -> int:
    """Memory the engine holds besides its weights (`weight_bytes`: those in the device's memory). On a
    GPU: all it holds on the device less the weights, measured after the profile run with the allocator's
    cache emptied: the CUDA context, the kernels PyTorch and cuBLAS loaded, their workspaces, the
    allocator's rounding (on unified memory also the process's own memory). On a CPU: the resident
    set less the weights (interpreter, libraries)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return max(0, held_since(str(device), at_start) - weight_bytes)
