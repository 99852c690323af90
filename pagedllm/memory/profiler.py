"""Measuring what the engine itself uses: peak memory of a callable, and the runtime's overhead.

CUDA: the caching allocator's peak counter. CPU: the process's resident-set high-water mark,
reset just before the measurement through /proc/self/clear_refs (Linux >= 4.0).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch


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
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
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


def runtime_overhead_bytes(device: torch.device, weight_bytes: int, others_at_start: int) -> int:
    """Memory the engine holds besides its tensors' data: interpreter, libraries, CUDA context."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, total - free - others_at_start - torch.cuda.memory_reserved(device))
    rss = rss_bytes()
    return max(0, (rss or 0) - weight_bytes)
