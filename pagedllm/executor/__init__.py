"""What runs the model for an engine: its own ModelRunner on one device, or a tensor-parallel group of
ranks (rank 0 in the engine's process, the others as local processes or Ray actors)."""
from __future__ import annotations

from pagedllm.config import EngineConfig


def make_runner(config: EngineConfig):
    """A ModelRunner, or for --tensor-parallel-size > 1 a TensorParallelRunner with the same calls."""
    from pagedllm.model_executor.model_runner import ModelRunner

    if config.parallel.tensor_parallel_size == 1:
        return ModelRunner(config)
    from pagedllm.executor.tensor_parallel import TensorParallelRunner

    if config.parallel.distributed_executor_backend == "ray":
        from pagedllm.executor.ray_workers import RayWorkers

        return TensorParallelRunner(config, RayWorkers(config))
    from pagedllm.executor.multiproc import MultiprocWorkers

    return TensorParallelRunner(config, MultiprocWorkers(config))
