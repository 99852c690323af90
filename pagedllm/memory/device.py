"""What memory the device has: CUDA (incl. unified-memory parts), or the host and its cgroup limit."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DeviceMemory:
    device: str  # "cpu" or "cuda"
    total_bytes: int  # all memory the engine's device has (cgroup limit on CPU where lower)
    used_by_others_bytes: int  # already taken before the engine loaded anything
    unified: bool  # device memory shared with the CPU and the OS (Grace/DGX Spark, integrated GPUs)
    name: str = ""


def _cgroup_limit() -> int | None:
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(f).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            return int(text)
    return None


def _cgroup_usage() -> int | None:
    for f in ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"):
        try:
            return int(Path(f).read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def _meminfo() -> dict[str, int]:
    info = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return info


def host_memory() -> DeviceMemory:
    """Host RAM: the smaller of physical memory and the cgroup limit; others' use from MemAvailable."""
    info = _meminfo()
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = info.get("MemAvailable", total)
    used = total - available
    limit = _cgroup_limit()
    if limit is not None and limit < total:
        total = limit
        used = min(_cgroup_usage() or used, total)
    own_rss = _own_rss()
    return DeviceMemory("cpu", total, max(0, used - own_rss), unified=False, name="host memory")


def _own_rss() -> int:
    try:
        fields = Path("/proc/self/statm").read_text().split()
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def cuda_memory(index: int = 0) -> DeviceMemory:
    import torch

    free, total = torch.cuda.mem_get_info(index)
    props = torch.cuda.get_device_properties(index)
    unified = bool(getattr(props, "is_integrated", False))
    ours = torch.cuda.memory_reserved(index)
    return DeviceMemory("cuda", total, max(0, total - free - ours), unified=unified, name=props.name)


def device_memory(device: str) -> DeviceMemory:
    return cuda_memory() if device.startswith("cuda") else host_memory()
