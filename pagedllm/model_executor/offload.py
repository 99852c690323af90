"""`--cpu-offload-gb`: whole decoder layers' weights kept in host memory and brought to the device
just before the layer runs, the copy dropped right after (vLLM's flag; the last layers go first).

The device then holds the other layers' weights plus one layer's transient copy. The mechanism is
device-agnostic (host and device may both be the CPU, which is how it is tested without a GPU);
only pinning the host copies, which makes the copies asynchronous, needs CUDA.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def num_offloaded_layers(offload_bytes: int, layer_bytes: int, num_layers: int) -> int:
    """Whole layers that fit in the offload budget (the planner and the loader share this rule)."""
    if offload_bytes <= 0 or layer_bytes <= 0:
        return 0
    return min(num_layers, offload_bytes // layer_bytes)


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class LayerOffload:
    """One layer's weights in host memory, with forward hooks that copy them to `device` for the
    layer's forward and point the parameters back at the host copies after it."""

    def __init__(self, layer: nn.Module, device: torch.device) -> None:
        self.device = device
        self.host: list[tuple[nn.Parameter, torch.Tensor]] = []
        for p in layer.parameters():
            p.data = _host_copy(p.data, device)
            self.host.append((p, p.data))
        self.num_bytes = param_bytes(layer)
        layer.register_forward_pre_hook(self.fetch)
        layer.register_forward_hook(self.release)

    def fetch(self, module: nn.Module, args) -> None:
        for p, host in self.host:
            # copy=True: a fresh device tensor even where host and device are the same (CPU tests).
            p.data = host.to(self.device, non_blocking=True, copy=True)

    def release(self, module: nn.Module, args, output) -> None:
        for p, host in self.host:
            p.data = host  # the device copy is freed (on CUDA: after the queued kernels that read it)


def _host_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    host = t.to("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        host = host.pin_memory()  # page-locked: the host-to-device copy runs asynchronously
    return host


def offload_layers(layers: Sequence[nn.Module], offload_bytes: int, device: torch.device) -> list[LayerOffload]:
    """Keep the last layers (as many as fit in `offload_bytes`) in host memory; returns their offloads."""
    if not layers:
        return []
    n = num_offloaded_layers(offload_bytes, param_bytes(layers[0]), len(layers))
    return [LayerOffload(layer, device) for layer in layers[len(layers) - n:]]
