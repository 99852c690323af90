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
