"""Small helpers shared across the package."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size b hold a items."""
    return -(-a // b)


def gib_to_bytes(gib: float) -> int:
    """A size given in GiB (vLLM's --cpu-offload-gb, --swap-space) in bytes."""
    return int(gib * (1 << 30))


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
