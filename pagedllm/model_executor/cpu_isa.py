"""Which CPU path a bf16 engine's Linears take, and PAGEDLLM_CPU_ISA to force a lower one.

The paths, best first (each machine runs the best it has):
- `amx`: AMX tiles and AVX512-BF16 dot products (Intel Sapphire Rapids and later): cpu_kernels' own
  packed layout, a tied LM head packed once for the head and the embedding, the MLP's SiLU fused
  into the gate / up product, AMX decode attention.
- `avx512_bf16`: oneDNN's bf16 kernels (AVX-512 without AMX, e.g. AMD Zen 4/5): oneDNN's blocked
  layout; a tied head keeps its plain weight.
- `avx2`: no bf16 arithmetic (AVX2 + FMA, e.g. Zen 3): cpu_kernels' packed layout read by FMAs in fp32.
- `none`: no native kernels at all: PyTorch's ops, bf16 Linears of many rows multiplied in fp32.

PAGEDLLM_CPU_ISA=amx|avx512_bf16|avx2|none forces a path at or below the machine's (a higher one is
refused, naming what the machine has), so one machine runs, and its tests check, every path below its
own: the test suite is the same on every kind of x86 server.
"""
from __future__ import annotations

import functools
import os
from types import ModuleType

from pagedllm.model_executor.cpu_kernels import cpu_flags_line, load_cpu_kernels

CPU_ISAS = ("none", "avx2", "avx512_bf16", "amx")  # worst to best
ENV = "PAGEDLLM_CPU_ISA"


class CpuIsaError(ValueError):
    """PAGEDLLM_CPU_ISA names no path, or one this machine does not have."""


def forced_cpu_isa() -> str | None:
    """PAGEDLLM_CPU_ISA, or None when unset (or empty)."""
    forced = os.environ.get(ENV, "").strip().lower()
    if not forced:
        return None
    if forced not in CPU_ISAS:
        raise CpuIsaError(f"{ENV}={forced!r} is not a CPU path: use one of {', '.join(reversed(CPU_ISAS))} "
                          f"(this machine has {machine_cpu_isa()}).")
    return forced


def onednn_bf16() -> bool:
    """PyTorch's oneDNN has bf16 kernels for this CPU (AVX-512 and up)."""
    import torch

    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@functools.lru_cache(maxsize=1)
def machine_cpu_isa() -> str:
    """The best path this machine (and this build of the kernels) has."""
    kernels = load_cpu_kernels()
    if kernels is not None and kernels.amx_available():  # (whatever PAGEDLLM_CPU_ISA has switched off)
        return "amx"
    if onednn_bf16():
        return "avx512_bf16"
    if kernels is not None and kernels.packed_linear_fma_supported():
        return "avx2"
    return "none"


def cpu_isa() -> str:
    """The path in force: PAGEDLLM_CPU_ISA where set (refused above the machine's), else the machine's best.
    Turns the kernels' AMX paths off below `amx`."""
    best = machine_cpu_isa()
    forced = forced_cpu_isa()
    if forced is None:
        chosen = best
    elif CPU_ISAS.index(forced) > CPU_ISAS.index(best):
        raise CpuIsaError(f"{ENV}={forced}: this machine's best CPU path is {best}; it can run "
                          f"{', '.join(reversed(CPU_ISAS[:CPU_ISAS.index(best) + 1]))}.")
    else:
        chosen = forced
    _allow_amx(chosen == "amx" or best != "amx")
    return chosen


_amx_allowed = True  # what the kernels were last told (they start with AMX allowed)


def _allow_amx(allowed: bool) -> None:
    global _amx_allowed
    if allowed != _amx_allowed:
        load_cpu_kernels().set_amx_allowed(allowed)
        _amx_allowed = allowed


def available_cpu_isas() -> list[str]:
    """Every path this machine can run, best first (what the tests force in turn)."""
    return _paths_up_to(machine_cpu_isa())


def expected_cpu_isas() -> list[str]:
    """What available_cpu_isas() says once the kernels are built, read from the CPU's flags (/proc/cpuinfo: what
    -march=native compiles for) without building them: the test suite is parametrized with it at collection, a
    minute before the first test that needs the kernels has them built, and checks it against them then."""
    flags = set(cpu_flags_line().partition(":")[2].split())
    if {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
        return _paths_up_to("amx")
    if onednn_bf16():
        return _paths_up_to("avx512_bf16")
    return _paths_up_to("avx2" if {"avx2", "fma"} <= flags else "none")


def _paths_up_to(best: str) -> list[str]:
    return list(reversed(CPU_ISAS[:CPU_ISAS.index(best) + 1]))


_isa_applied: str | None = None  # the PAGEDLLM_CPU_ISA value the kernels' AMX switch was last set for


def cpu_kernels() -> ModuleType | None:
    """The compiled kernels, or None: when they cannot be had (the reason logged once), with
    PAGEDLLM_CPU_KERNELS=0, or with PAGEDLLM_CPU_ISA=none. Below
    PAGEDLLM_CPU_ISA=amx their AMX paths are off."""
    global _isa_applied
    forced = os.environ.get(ENV, "")
    if forced.strip().lower() == "none":
        return None
    kernels = load_cpu_kernels()
    if kernels is not None and forced != _isa_applied:
        cpu_isa()  # checks the value and sets the AMX switch
        _isa_applied = forced
    return kernels
