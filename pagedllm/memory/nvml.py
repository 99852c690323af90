"""Free memory of a CUDA device through NVML (the driver's management library), which needs no CUDA
context: read before the engine's first CUDA call, it tells what other processes hold apart from
the context that call creates. ctypes over libnvidia-ml.so.1, which ships with the NVIDIA driver;
every failure (no driver, an integrated GPU NVML reports no memory for, a MIG slice) is None."""
from __future__ import annotations

import ctypes
import logging
from functools import cache

logger = logging.getLogger(__name__)


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


@cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if lib.nvmlInit_v2() != 0:
        return None
    return lib


def _nvml_index(cuda_index: int) -> int:
    """NVML counts every GPU of the machine; CUDA only the visible ones (CUDA_VISIBLE_DEVICES)."""
    import torch

    try:
        return torch.cuda._get_nvml_device_index(cuda_index)
    except Exception:  # a private helper: where it fails, assume no remapping
        return cuda_index


def free_bytes(cuda_index: int) -> int | None:
    lib = _library()
    if lib is None:
        return None
    try:
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(_nvml_index(cuda_index)), ctypes.byref(handle)) != 0:
            return None
        memory = _Memory()
        if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0:
            return None
    except (AttributeError, OSError) as e:
        logger.debug("NVML memory reading failed: %s", e)
        return None
    return int(memory.free)
