"""The OpenMP runtime's worker pools, when the engine moves from the thread that built it to another.

GNU OpenMP (the libgomp that PyTorch's CPU wheel ships) keeps one pool of worker threads per thread that
has run a parallel region. The server builds its engine on the main thread (loading, the profile run, the
warm-up) and then steps it on its own thread, which starts a second pool: with two pools of `cores - 1`
workers on `cores` cores, libgomp shortens its spin-waits and every decode step got ~25% slower (measured
on 2 cores, Qwen2.5-0.5B bf16, batch 1: 31.8 ms on the engine thread against 26.4 ms on the main thread;
23.5 ms once the main thread's pool was released). `omp_pause_resource_all(omp_pause_hard)`, called on a
thread, frees that thread's pool (libgomp's `gomp_pause_host`); its next parallel region, if any, starts a
fresh one.
"""
from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: omp_pause_hard frees threads and all other OpenMP state


def _loaded_openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (libgomp, or Intel's/LLVM's when preloaded), if any."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if name.startswith(("libgomp", "libiomp", "libomp")):
            try:
                runtime = ctypes.CDLL(path)
            except OSError:
                continue
            if hasattr(runtime, "omp_pause_resource_all"):
                return runtime
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker pool, so that only the thread that computes next holds one.
    Call it outside any parallel region (between building the engine and starting its thread).
    Returns whether a runtime was found and released its pools."""
    runtime = _loaded_openmp_runtime()
    if runtime is None:
        return False
    runtime.omp_pause_resource_all.restype = ctypes.c_int
    released = runtime.omp_pause_resource_all(ctypes.c_int(OMP_PAUSE_HARD)) == 0
    if not released:
        logger.debug("the OpenMP runtime refused to release its thread pools")
    return released
