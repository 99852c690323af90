"""Rank 0 of a tensor-parallel engine: the engine's ModelRunner, seen by the engine as one runner. Each
call that runs the model or touches the KV cache is sent to the workers first, then run here; the
collectives inside pair the ranks up. Rank 0 samples; the tokens go to the workers with the next step."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from pagedllm.engine.step_input import StepInput
from pagedllm.errors import WorkerError
from pagedllm.executor.worker import StepCommand
from pagedllm.memory.device import DeviceMemory
from pagedllm.model_executor.model_runner import ModelRunner, PendingOutput

logger = logging.getLogger(__name__)


class TensorParallelRunner:
    """Rank 0's ModelRunner plus the workers of ranks 1 .. N-1 (multiproc.MultiprocWorkers or the Ray
    ones): what the engine calls a runner."""

    def __init__(self, config: EngineConfig, workers) -> None:
        self.workers = workers
        self.size = config.parallel.tensor_parallel_size
        self.timeout_s = config.parallel.worker_timeout_s
        self.failed = False  # a WorkerError was raised: shutdown does not wait for the workers
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
                    config.parallel.distributed_executor_backend,
                    ", ".join(str(i.pid) for i in self.worker_infos))

    def __getattr__(self, name: str):
        """Everything else (device, graphs, model, requests, grammars, ...) is rank 0's."""
        if name == "driver":
            raise AttributeError(name)
        return getattr(self.driver, name)

    @property
    def config(self) -> EngineConfig:
        return self.driver.config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self.workers.send("set_config", (config,), reply=True)
        self.workers.collect()
        self.driver.config = config

    @property
    def weight_bytes(self) -> int:
        """The largest rank's weights (the plan holds for every rank)."""
        return max([self.driver.weight_bytes] + [i.weight_bytes for i in self.worker_infos])

    def tightest_device_memory(self, mine: DeviceMemory) -> DeviceMemory:
        """Of rank 0's device and each worker's (as measured before loading), the one with the least
        available memory: the plan made for it holds on every rank."""
        readings = [mine] + [i.device_memory for i in self.worker_infos if i.device_memory is not None]
        return min(readings, key=lambda m: m.available_bytes)

    def on_every_rank(self, method: str, *args) -> list:
        """Run a ModelRunner method on every rank; the results by rank."""
        self.workers.send(method, args, reply=True)
        with self._collectives():
            mine = getattr(self.driver, method)(*args)
        return [mine, *self.workers.collect()]

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
            self.workers.check_alive()
            raise WorkerError(f"a collective with the tensor-parallel ranks failed (a rank exited, or did not "
                              f"answer within {self.timeout_s:.0f} s: PAGEDLLM_WORKER_TIMEOUT_S): {e}") from e

    def profile_run(self, num_tokens: int, max_num_seqs: int, max_model_len: int) -> int | None:
        """The largest rank's activation peak."""
        peaks = self.on_every_rank("profile_run", num_tokens, max_num_seqs, max_model_len)
        return None if any(p is None for p in peaks) else max(peaks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.on_every_rank("allocate_kv_cache", num_blocks)

    def release_kv_cache(self) -> None:
        self.on_every_rank("release_kv_cache")

    def capture_graphs(self) -> None:
        self.on_every_rank("capture_graphs")

    def allocate_swap_space(self, num_blocks: int) -> None:
        self.on_every_rank("allocate_swap_space", num_blocks)

    def execute(self, step: StepInput):
        return self.execute_async(step).result()

    def execute_async(self, step: StepInput) -> PendingOutput:
        self.workers.send("execute", (StepCommand(step, self._sampled),))
        with self._collectives():
            pending = self.driver.execute_async(step)
        sampled = self._sampled = {}
        original = pending.result

        def result():
            with self._collectives():
                out = original()
            sampled.update((rid, (row.token_id, row.frame)) for rid, row in out.sampled.items())
            return out

        pending.result = result
        return pending

    def shutdown(self) -> None:
        self.workers.shutdown(wait_s=0 if self.failed else 10)
        destroy_tensor_parallel()

