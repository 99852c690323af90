"""Native CPU kernels, compiled from C++ on first use with the machine's compiler (PyTorch's JIT
extension builder) and cached on disk, so later processes load them in well under a second.

They do what PyTorch's ops can only do in several passes: decode attention read straight from the
paged KV cache (no gathered copy of K/V, one parallel loop instead of ~10 small kernels per layer)
and the step's K/V rows written into it,
the decoder's elementwise steps fused (residual add + RMSNorm, SiLU * up, rotary embedding), bf16
Linear layers over a weight packed once for AMX tiles and AVX512-BF16 dot products, or for fp32 FMAs
on AVX2 CPUs with no bf16 arithmetic (packed_linear.cpp; on AVX-512 CPUs without AMX / AVX512-BF16,
oneDNN's packed layout is used), a GEMV that streams a plain bf16 weight, and
greedy sampling's argmax over rows of logits.
Every kernel has a PyTorch twin that is used when the kernels cannot be built (no C++ compiler, a GPU
device) or are turned off with PAGEDLLM_CPU_KERNELS=0; tests check one against the other.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_HEADER = "common.h"
_SOURCES = ("decode_attention.cpp", "prefill_attention.cpp", "elementwise.cpp", "gemv.cpp", "greedy.cpp", "packed_linear.cpp", "quant_gemv.cpp")
_BINDINGS = "bindings.cpp"  # the Python module: its own unit, compiled beside the kernels' one
# -O3 with the reassociation that lets the compiler vectorise dot products (no -ffast-math: its
# assumptions about infinities and NaN are not ours to make).
_CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
           "-fno-signed-zeros", "-fopenmp"]


def _cpu_signature(source: str = "") -> str:
    """A short hash of what the compiled code depends on: the CPU's instruction set (-march=native) and the
    machine, so a cache directory shared between hosts never hands one host another's binary; the torch
    build it links (version and install path), so two venvs each keep their own build instead of rebuilding
    it at every switch; and the source, so two checkouts of different versions (or a server of one beside
    the tests of another) each keep theirs (PyTorch's builder would rebuild one name at every switch)."""
    import torch

    build = f"{torch.__version__} {Path(torch.__file__).resolve().parent}"
    flags = cpu_flags_line()
    return hashlib.sha256(f"{platform.machine()} {flags} {build} {source}".encode()).hexdigest()[:12]


def cpu_flags_line() -> str:
    """/proc/cpuinfo's `flags` line (what -march=native compiles for); "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.rstrip("\n") for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _ensure_ninja_on_path() -> None:
    """PyTorch's builder runs `ninja` from PATH. The pip package's binary goes first whatever PATH says: two
    ninja versions (the system's 1.11 and pip's 1.13, one found from an activated venv, the other not) cannot
    read each other's build log, and each would compile the kernels again (~40 s) after the other."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if not path.startswith(ninja.BIN_DIR + os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


# PyTorch's builder holds a lock file in the build directory while it compiles, and waits for as long
# as it exists: a build killed midway (Ctrl-C on the first start) would leave every later start
# waiting forever. The build takes ~40 s here; a lock this old is a leftover.
_STALE_LOCK_SECONDS = 15 * 60


def _remove_stale_build_lock(name: str) -> None:
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return  # no lock: no build running or interrupted
    if age > _STALE_LOCK_SECONDS:
        logger.warning("removing %s, left %.0f min ago by an interrupted kernel build", lock, age / 60)
        lock.unlink(missing_ok=True)


def kernel_source() -> str:
    """The kernels as one translation unit (ATen's headers take ~10 s to compile, once per unit): the shared
    header, then every source with its include of it removed."""
    here = Path(__file__).parent
    include = f'#include "{_HEADER}"'
    return "\n".join([(here / _HEADER).read_text()]
                     + [(here / name).read_text().replace(include, "") for name in _SOURCES])


def _bindings_source() -> str:
    return (Path(__file__).parent / _BINDINGS).read_text()


def build_name(source: str | None = None) -> str:
    """The extension's name in PyTorch's cache (its build directory): keyed by _cpu_signature."""
    source = kernel_source() + _bindings_source() if source is None else source
    return f"pagedllm_cpu_{_cpu_signature(source)}"


def _built_path(name: str) -> Path | None:
    """The extension PyTorch's builder built under `name`, or None (not built, or being built)."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    built = build_dir / f"{name}.so"
    return built if built.is_file() and not (build_dir / "lock").exists() else None


def kernels_built() -> bool:
    """Whether this machine (and venv, and source) has its kernels built: loading them costs no compile."""
    return _built_path(build_name()) is not None


def _load_built(name: str) -> ModuleType | None:
    """The extension PyTorch's builder already built under `name`, loaded without running the builder, or None.
    The name holds the hash of everything the binary depends on (_cpu_signature), so a built one is the one
    wanted; the builder would run ninja, which rebuilds everything (~40 s) when the build log was written
    by another ninja version (the system's, or pip's, whichever a process finds first on PATH)."""
    from torch.utils.cpp_extension import _import_module_from_library

    built = _built_path(name)
    if built is None:
        return None
    try:
        return _import_module_from_library(name, str(built.parent), True)
    except (ImportError, OSError):
        return None


def _build(name: str, kernels: str, bindings: str) -> ModuleType:
    """PyTorch's builder on two units (the kernels, the bindings), which ninja compiles at once on two cores:
    ~30 s where PyTorch's whole C++ API in one unit took ~60 s."""
    from torch.utils.cpp_extension import _get_build_directory, load

    build_dir = Path(_get_build_directory(name, verbose=False))
    sources = []
    for file, text in (("kernels.cpp", kernels), ("bindings.cpp", bindings)):
        path = build_dir / file
        if not path.is_file() or path.read_text() != text:  # unchanged files keep ninja's timestamps
            path.write_text(text)
        sources.append(str(path))
    return load(name, sources, extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)


@functools.lru_cache(maxsize=1)
def load_cpu_kernels() -> ModuleType | None:
    """The compiled kernels whatever PAGEDLLM_CPU_ISA says (cpu_isa.py reads what they can do), or None
    (with the reason logged once) when they cannot be had."""
    if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") == "0":
        return None
    try:
        _ensure_ninja_on_path()
        kernels, bindings = kernel_source(), _bindings_source()
        name = build_name(kernels + bindings)
        _remove_stale_build_lock(name)
        start = time.perf_counter()
        logger.info("loading native CPU kernels %s (the first start on a machine or venv compiles them: ~40 s on 2 cores)", name)
        module = _load_built(name)
        if module is None:
            module = _build(name, kernels, bindings)
        logger.info("CPU kernels ready (%s, %.1f s: compiled once, then loaded from PyTorch's extension cache)",
                    name, time.perf_counter() - start)
        return module
    except Exception as exc:  # any build failure: the PyTorch twins run instead
        logger.warning("native CPU kernels unavailable, using PyTorch ops instead (slower decode attention): %s",
                       str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
        return None
