"""Small helpers shared across the package."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size b hold a items."""
    return -(-a // b)


def gib_to_bytes(gib: float) -> int:
    """A size given in GiB (vLLM's --cpu-offload-gb, --swap-space) in bytes."""
    return int(gib * (1 << 30))


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


def phase(name: str):
    """A labelled span of an engine step for torch.profiler (`pagedllm bench host` adds them up); a few
    microseconds when no profiler runs."""
    import torch

    return torch.profiler.record_function(f"pagedllm.{name}")


def die_with_parent(sig: int = 9) -> None:
    """Have the kernel send this process `sig` when its parent exits (Linux prctl PR_SET_PDEATHSIG), so a
    helper process (a grammar worker, a data-parallel replica) never outlives a server killed with SIGKILL.
    Elsewhere, nothing."""
    import ctypes
    import os
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent was already gone before the signal was set up
        os.kill(os.getpid(), sig)
