"""The tensor-parallel executor: rank 0's ModelRunner in the engine's process, the other ranks as workers.
Each call that runs the model or touches the KV cache is sent to the workers first, then run here; the
collectives inside pair the ranks up. Rank 0 samples; the tokens go to the workers with the next step."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from pagedllm.step_input import StepInput
from pagedllm.errors import WorkerError
from pagedllm.executor.abstract import Executor
from pagedllm.executor.worker import StepCommand
from pagedllm.memory.device import DeviceMemory
from pagedllm.model_executor.model_runner import ModelRunner, PendingOutput

logger = logging.getLogger(__name__)


class TensorParallelExecutor(Executor):
    """Rank 0's ModelRunner (`driver`) plus the workers of ranks 1 .. N-1 (multiproc.MultiprocWorkers or the
    Ray ones)."""

    def __init__(self, config: EngineConfig, workers) -> None:
        self.workers = workers
        self.size = config.parallel.tensor_parallel_size
        self.timeout_s = config.parallel.worker_timeout_s
        self.backend = config.parallel.distributed_executor_backend
        self.failed = False  # a WorkerError was raised: shutdown does not wait for the workers
        self.closed = False
        self._sampled: dict[str, tuple] = {}  # rank 0's tokens (and frames) of the last step, for the workers
        try:
            workers.start()
            device = workers.driver_device()
            init_tensor_parallel(0, self.size, workers.init_method, torch.device(device),
                                 config.parallel.worker_timeout_s)
            self.driver = ModelRunner(replace(config, device=device))
            self.worker_infos = workers.ready()
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (%s); rank 0 here, the others in processes %s", self.size,
                    self.backend, ", ".join(str(i.pid) for i in self.worker_infos))

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Run a ModelRunner method on every rank; the results by rank."""
        self.workers.send(method, args, reply=True)
        with self._collectives():
            mine = getattr(self.driver, method)(*args)
        return [mine, *self.workers.collect()]

    def plan_device_memory(self, mine: DeviceMemory) -> DeviceMemory:
        """Of rank 0's device and each worker's (as measured before loading), the one with the least
        available memory: the plan made for it holds on every rank."""
        readings = [mine] + [i.device_memory for i in self.worker_infos if i.device_memory is not None]
        return min(readings, key=lambda m: m.available_bytes)

    @contextlib.contextmanager
    def _collectives(self):
        """A collective that fails (a peer gone: gloo/NCCL error, or no answer within the process group's
        timeout) is a WorkerError naming the rank when one has exited."""
        try:
            yield
        except WorkerError:
            self.failed = True
            raise
        except RuntimeError as e:
            self.failed = True
            self.workers.check_alive(grace_s=2.0)  # a peer's death first shows as a broken connection
            raise WorkerError(f"a collective with the tensor-parallel ranks failed (a rank exited, or did not "
                              f"answer within {self.timeout_s:.0f} s: PAGEDLLM_WORKER_TIMEOUT_S): {e}") from e

    def execute_model(self, step: StepInput) -> PendingOutput:
        # The workers sample nothing: the step without its bitmask (rank 0 applies it to the gathered logits).
        worker_step = step if step.grammar_bitmask is None else replace(step, grammar_bitmask=None)
        self.workers.send("execute", (StepCommand(worker_step, self._sampled),))
        with self._collectives():
            pending = self.driver.execute_async(step)
        sampled = self._sampled = {}
        original = pending.result

        def result():
            with self._collectives():
                out = original()
            sampled.update((rid, (row.token_ids, row.frame)) for rid, row in out.sampled.items())
            return out

        pending.result = result
        return pending

    def check_health(self) -> None:
        self.workers.check_alive()

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.workers.shutdown(wait_s=0 if self.failed else 10)
        destroy_tensor_parallel()
