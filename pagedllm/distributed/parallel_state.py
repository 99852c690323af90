"""The tensor-parallel group this process is a rank of, and the collectives the model calls
(torch.distributed: gloo on a CPU, NCCL on CUDA). One group per process, as vLLM has it: the model
code asks `tp_group()` instead of threading a handle through every layer. Size 1 (the default, and
what a process that never joined a group sees) makes every collective a no-op."""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CollectiveTime:
    """Wall time this process spent in collectives (with what it waited for slower ranks): what
    `bench throughput` reports as the all-reduce share of a tensor-parallel run."""

    seconds: float = 0.0
    calls: int = 0


collective_time = CollectiveTime()


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: the engine's own process, which samples and returns the outputs."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (a row-parallel Linear's partial products)."""
        if self.size > 1:
            start = time.perf_counter()
            dist.all_reduce(x)
            collective_time.seconds += time.perf_counter() - start
            collective_time.calls += 1
        return x

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise max over ranks (a new tensor on x's device; NCCL reduces it on this rank's GPU)."""
        if self.size == 1:
            return x
        on = x.to(torch.cuda.current_device()) if dist.get_backend() == "nccl" else x.clone()
        dist.all_reduce(on, op=dist.ReduceOp.MAX)
        return on.to(x.device)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's `x` concatenated along the last dimension (vocab shards of the logits);
        other ranks: None. Equal shapes on every rank (padded vocab shards)."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        dist.gather(x, parts, dst=0)
        collective_time.seconds += time.perf_counter() - start
        collective_time.calls += 1
        return torch.cat(parts, dim=-1) if self.is_driver else None


_GROUP = TensorParallelGroup()


def tp_group() -> TensorParallelGroup:
    return _GROUP


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         timeout_s: float) -> TensorParallelGroup:
    """Join the group: NCCL for CUDA tensors, gloo for CPU ones. `timeout_s`: how long a collective may
    wait for a rank that does not answer before it fails (a dead or hung worker)."""
    global _GROUP
    if dist.is_initialized():
        raise RuntimeError("this process already is a rank of a tensor-parallel group (another engine's): shut that "
                           "engine down first (LLM.shutdown()).")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except BaseException:
        # torch names the default group by a process-wide count it raises before the rendezvous: after one that
        # failed, this process's next group would be "1" while a fresh worker's is "0", and their rendezvous
        # keys would never meet (every later engine here hung for the timeout, then failed).
        if not dist.is_initialized():
            from torch.distributed import distributed_c10d

            distributed_c10d._world.group_count = 0
        raise
    _GROUP = TensorParallelGroup(rank, size)
    return _GROUP


def destroy_tensor_parallel() -> None:
    global _GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = TensorParallelGroup()
