"""`--cpu-offload-gb`: whole decoder layers' weights kept in host memory and brought to the device
for each forward (vLLM's flag; the last layers go first).

Each offloaded layer's parameters are views into one flat host buffer, page-locked on CUDA, so
bringing a layer over is one contiguous copy. The device holds two layer-sized slots: while layer i
computes from one, layer i+1's copy runs into the other on a side stream, so the host-to-device
transfer overlaps compute; the first offloaded layer's copy starts when the forward does. A slot is
overwritten only after the kernels that read it have run (an event recorded after its layer).
The device thus holds the resident layers plus two layers' slots (one slot when one layer is
offloaded).

The mechanism is device-agnostic: with host and device both the CPU (how it is tested without a
GPU) the copies are plain synchronous ones.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

DEVICE_SLOTS = 2  # layer-sized device buffers: one computing, one being filled
_ALIGN = 256  # bytes: each parameter's view starts aligned in the flat buffer


def num_offloaded_layers(offload_bytes: int, layer_bytes: int, num_layers: int) -> int:
    """Whole layers that fit in the offload budget (the planner and the loader share this rule)."""
    if offload_bytes <= 0 or layer_bytes <= 0:
        return 0
    return min(num_layers, offload_bytes // layer_bytes)


def device_slots(num_offloaded: int) -> int:
    """Layer-sized device buffers the offloaded layers pass through (what the plan counts)."""
    return min(DEVICE_SLOTS, num_offloaded)


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class HostLayer:
    """One layer's parameters as views into one flat host buffer."""

    host: list[tuple[nn.Parameter, torch.Tensor]]  # (parameter, its host view)
    offsets: list[int]  # byte offset of each view in the buffer
    buffer: torch.Tensor  # uint8
    num_bytes: int  # the parameters' bytes (without alignment padding)

    @classmethod
    def build(cls, layer: nn.Module, copy_values: bool = True) -> HostLayer:
        """Move `layer`'s parameters (on any device) into a new flat host buffer, with their values
        unless `copy_values` is False (storage still to be filled)."""
        params = list(layer.parameters())
        offsets, end = [], 0
        for p in params:
            offsets.append(end)
            end = _aligned(end + p.numel() * p.element_size())
        buffer = torch.empty(max(end, 1), dtype=torch.uint8)
        host = []
        with torch.no_grad():
            for p, offset in zip(params, offsets):
                view = _typed_view(buffer, offset, p)
                if copy_values:
                    view.copy_(p.data)
                p.data = view
                host.append((p, view))
        return cls(host, offsets, buffer, param_bytes(layer))

    def point_at(self, flat: torch.Tensor) -> None:
        """Point the parameters at their places in `flat` (a slot, or the host buffer itself)."""
        for (p, host), offset in zip(self.host, self.offsets):
            p.data = host if flat is self.buffer else _typed_view(flat, offset, host)


def _typed_view(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    return flat[offset:offset + nbytes].view(like.dtype).view(like.shape)


class _PinnedRegistration:
    """A host buffer page-locked in place (cudaHostRegister: no copy, no power-of-two rounding as
    pin_memory() has), unregistered when dropped."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.ptr = buffer, buffer.data_ptr()
        err = int(torch.cuda.cudart().cudaHostRegister(self.ptr, buffer.numel(), 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister failed with CUDA error {err}")

    def __del__(self) -> None:
        try:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
        except Exception:  # interpreter shutdown
            pass


class LayerOffloader:
    """Runs the offloaded layers from their host buffers through DEVICE_SLOTS device slots, each
    layer's copy issued while the layer before it computes."""

    def __init__(self, layers: Sequence[nn.Module], hosts: list[HostLayer], first_layer: nn.Module,
                 device: torch.device) -> None:
        self.hosts, self.device = hosts, device
        self.cuda = device.type == "cuda"
        self.pinned = [_pin(h.buffer) for h in hosts] if self.cuda else []
        slot_bytes = max(h.buffer.numel() for h in hosts)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device)
                      for _ in range(device_slots(len(hosts)))]
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.copied: dict[int, torch.cuda.Event | None] = {}  # layer -> its copy's event, issued not yet used
        self.slot_free: list[torch.cuda.Event | None] = [None] * len(self.slots)
        self.on_slot: set[int] = set()  # layers whose parameters point at a slot (their forward is running)
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda module, args, i=i: self._before(i))
            layer.register_forward_hook(lambda module, args, output, i=i: self._after(i))
        if first_layer is not layers[0]:  # the first copy overlaps the resident layers
            first_layer.register_forward_pre_hook(lambda module, args: self._start())

    @property
    def slot_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def _slot(self, i: int) -> torch.Tensor:
        return self.slots[i % len(self.slots)]

    def _start(self) -> None:
        """A forward begins: undo what one that failed midway left (a copy not used, a layer on its slot)."""
        self.copied.clear()
        for i in list(self.on_slot):
            self._after(i)
        self._copy(0)

    def _copy(self, i: int) -> None:
        """Issue layer i's host-to-device copy into its slot, after the slot's last reader."""
        host, slot = self.hosts[i].buffer, self._slot(i)
        if not self.cuda:
            slot[:host.numel()].copy_(host)
            self.copied[i] = None
            return
        with torch.cuda.stream(self.stream):
            free = self.slot_free[i % len(self.slots)]
            if free is not None:
                self.stream.wait_event(free)
            slot[:host.numel()].copy_(host, non_blocking=True)
            self.copied[i] = self.stream.record_event()

    def _before(self, i: int) -> None:
        if i == 0 and self.on_slot:
            self._start()  # the first layer is offloaded too: no resident layer's hook started this forward
        if i not in self.copied:
            self._copy(i)
        event = self.copied.pop(i)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        self.hosts[i].point_at(self._slot(i))
        self.on_slot.add(i)
        if i + 1 < len(self.hosts):
            self._copy(i + 1)

    def _after(self, i: int) -> None:
        self.hosts[i].point_at(self.hosts[i].buffer)
        self.on_slot.discard(i)
        if self.cuda:
            self.slot_free[i % len(self.slots)] = torch.cuda.current_stream(self.device).record_event()


def _pin(buffer: torch.Tensor) -> _PinnedRegistration | None:
    try:
        return _PinnedRegistration(buffer)
    except (RuntimeError, AttributeError) as e:  # pageable memory still works, with synchronous copies
        logger.warning("could not page-lock an offloaded layer's host memory (%s): its copies will not overlap", e)
        return None


def offloaded_layer_indices(layers: Sequence[nn.Module], offload_bytes: int) -> range:
    """The last layers, as many as fit in `offload_bytes` (sized by the first layer)."""
    n = num_offloaded_layers(offload_bytes, param_bytes(layers[0]), len(layers)) if layers else 0
    return range(len(layers) - n, len(layers))


def offload_layers(layers: Sequence[nn.Module], offload_bytes: int, device: torch.device,
                   hosts: dict[int, HostLayer] | None = None) -> LayerOffloader | None:
    """Keep the last layers (as many as fit in `offload_bytes`) in host memory. `hosts`: host buffers
    the loader already filled, by layer index; the others are built from the layers' current weights."""
    indices = offloaded_layer_indices(layers, offload_bytes)
    if not indices:
        return None
    hosts = hosts or {}
    built = [hosts.get(i) or HostLayer.build(layers[i]) for i in indices]
    return LayerOffloader([layers[i] for i in indices], built, layers[0], device)
