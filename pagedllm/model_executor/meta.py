"""Modules built with shapes and no storage (the meta device), for a loader that fills them or a plan that
only counts their bytes."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


class _SkipInitialisers(TorchFunctionMode):
    """torch.nn.init's initialisers return their tensor untouched; everything else runs as it would."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta_device() -> Iterator[None]:
    """Modules made inside are on the meta device, their parameters left uninitialised. On meta tensors
    `normal_` / `uniform_` run PyTorch's Python reference ops, whose first call imports torch._dynamo: ~1 s of
    every process that loads a model (a server, each tensor-parallel worker), for values no one reads."""
    with torch.device("meta"), _SkipInitialisers():
        yield
