"""Decode steps replayed from CUDA graphs instead of launched kernel by kernel.

A decode step (one new token per sequence) costs a GPU hundreds of small launches from Python; captured
once per batch size, the same step is one replay. A step of n sequences runs the graph of the smallest
captured size >= n; the rows past n are padding (token 0 at position 0 of a sequence whose only block is
the runner's null block, never handed out), so their K/V writes land there and nowhere else. Graphs are
captured over persistent inputs (the runner's token ids, the attention backend's metadata buffers) that
each step fills before the replay.

`GraphCapture` is how a step is recorded: `CudaGraphCapture` on a GPU, and `EagerReplay`, its CPU twin,
which "replays" by running the captured function again over the same buffers and metadata (the same
Python values too), so the logic around the graphs (buckets, padding, the null block, persistent
inputs) is tested where there is no GPU.
"""
from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class CapturedStep:
    batch_size: int
    replay: Callable[[], None]  # runs the step again over the persistent inputs
    output: torch.Tensor  # the step's output, refilled by each replay (a fixed address)


class GraphCapture(ABC):
    lazy: bool  # capture each size when first needed (the twin), not all at start

    @abstractmethod
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Record `fn` (which reads only persistent inputs and returns a tensor): (replay, output)."""


class CudaGraphCapture(GraphCapture):
    """torch.cuda.CUDAGraph, every size in one memory pool (captured largest first, the smaller ones
    reuse its blocks), each warmed up first so Triton compiles and cuBLAS picks its kernels outside
    the capture."""

    lazy = False

    def __init__(self, device: torch.device) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def capture(self, fn):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            output = fn()
        return graph.replay, output


class EagerReplay(GraphCapture):
    """The CPU twin: capture runs `fn` once; a replay runs it again and writes its result into the
    output tensor the capture returned, as a graph's replay refills its output in place."""

    lazy = True

    def capture(self, fn):
        output = fn()

        def replay() -> None:
            output.copy_(fn())

        return replay, output


class DecodeGraphs:
    """The captured decode steps of one model runner, by batch size."""

    def __init__(self, sizes: tuple[int, ...], capture: GraphCapture,
                 make_step: Callable[[int], Callable[[], torch.Tensor]], prepare: Callable[[int], None]) -> None:
        """make_step(batch_size): the function a graph of that size records; prepare(batch_size): fill the
        persistent inputs with an all-padding step (before a capture, whose warm-up writes K/V)."""
        self.sizes, self.capturer = sizes, capture
        self.make_step, self.prepare = make_step, prepare
        self.steps: dict[int, CapturedStep] = {}
        self.pool_bytes: int | None = None  # device memory the capture took (CUDA; measured by capture_all)
        self.capture_seconds = 0.0

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def batch_size_for(self, num_seqs: int) -> int | None:
        """The smallest size >= num_seqs (None: larger than every size, the step runs eagerly)."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    def get(self, batch_size: int) -> CapturedStep:
        step = self.steps.get(batch_size)
        if step is None:
            step = self._capture(batch_size)
        return step

    def _capture(self, batch_size: int) -> CapturedStep:
        start = time.perf_counter()
        self.prepare(batch_size)
        replay, output = self.capturer.capture(self.make_step(batch_size))
        self.steps[batch_size] = step = CapturedStep(batch_size, replay, output)
        self.capture_seconds += time.perf_counter() - start
        return step

    def capture_all(self, device: torch.device) -> None:
        """Every size now, largest first (smaller graphs reuse the largest one's pool); measures the time
        and, on a GPU, the device memory taken."""
        before = _device_free_bytes(device)
        for size in sorted(self.sizes, reverse=True):
            if size not in self.steps:
                self._capture(size)
        after = _device_free_bytes(device)
        if before is not None and after is not None:
            self.pool_bytes = max(0, before - after)


def _device_free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]
