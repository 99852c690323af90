"""Persistent device buffers for a step's small inputs, filled from page-locked host twins."""
from __future__ import annotations

import torch


class StepBuffers:
    """Named 1-D device tensors, each with a page-locked host twin it is filled from by one asynchronous
    copy: no allocation and no host-blocking copy per step, and fixed addresses (what CUDA graphs replay
    over). Before the host twins are rewritten, the previous step's copies out of them are waited for (an
    event; a step that samples nothing does not otherwise wait)."""

    def __init__(self, shapes: dict[str, tuple[int, torch.dtype]], device: torch.device) -> None:
        self.cuda = pin = device.type == "cuda"
        self.host = {k: torch.zeros(n, dtype=dt, pin_memory=pin) for k, (n, dt) in shapes.items()}
        self.device = {k: torch.zeros(n, dtype=dt, device=device) for k, (n, dt) in shapes.items()}
        self.copied: torch.cuda.Event | None = None

    def capacity(self, name: str) -> int:
        return self.device[name].numel()

    def load_all(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each host tensor into the buffer of its name; returns the device views (leading parts, same shapes)."""
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copies have left the host twins
        out = {name: self._load(name, value) for name, value in values.items()}
        if self.cuda:
            self.copied = torch.cuda.current_stream().record_event()
        return out

    def _load(self, name: str, value: torch.Tensor) -> torch.Tensor:
        n = value.numel()
        host, dev = self.host[name][:n].view(value.shape), self.device[name][:n].view(value.shape)  # contiguous
        host.copy_(value)
        dev.copy_(host, non_blocking=True)
        return dev
