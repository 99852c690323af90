"""What runs the model for an engine (abstract.Executor): its own ModelRunner on one device, or a
tensor-parallel group of ranks (rank 0 in the engine's process, the others as local processes or Ray
actors)."""
from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import Executor, ProfiledPeaks, UniProcExecutor

__all__ = ["Executor", "ProfiledPeaks", "UniProcExecutor", "make_executor"]


def make_executor(config: EngineConfig) -> Executor:
    """UniProcExecutor, or for --tensor-parallel-size > 1 a TensorParallelExecutor over local processes (mp)
    or Ray actors (ray)."""
    from pagedllm.model_executor.model_runner import ModelRunner

    if config.parallel.tensor_parallel_size == 1:
        return UniProcExecutor(ModelRunner(config))
    from pagedllm.executor.tensor_parallel import TensorParallelExecutor

    if config.parallel.distributed_executor_backend == "ray":
        from pagedllm.executor.ray_workers import RayWorkers

        return TensorParallelExecutor(config, RayWorkers(config))
    from pagedllm.executor.multiproc import MultiprocWorkers

    return TensorParallelExecutor(config, MultiprocWorkers(config))
