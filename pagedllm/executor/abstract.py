"""The executor: everything the engine asks of the model's ranks, as one explicit interface (vLLM v1's
Executor). The engine never reads a runner's attributes or sets one: what a step needs travels in the
step (StepInput: the scheduled tokens, new requests' sampling parameters and audio state, the structured
outputs' bitmask), what the memory plan needs comes back as plain data, and anything else is a
`collective_rpc` that runs a ModelRunner method on every rank.

Implementations: UniProcExecutor (one device, this process) and TensorParallelExecutor (rank 0 here,
ranks 1 .. N-1 as local processes or Ray actors)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.memory.device import DeviceMemory
from pagedllm.model_executor.model_runner import ModelRunner, PendingOutput, RunnerFacts
from pagedllm.step_input import StepInput


@dataclass(frozen=True)
class ProfiledPeaks:
    """The profile run's measurements: the heaviest step's activation peak (the largest rank's; None where it
    cannot be measured) and, on CUDA with graphs, a decode step's peak at the largest graph size."""

    activation_bytes: int | None
    graph_bytes: int | None


class Executor(ABC):
    """Runs the model for one engine. `driver` is rank 0's ModelRunner, in this process: for inspection by
    tests and benchmarks; the engine itself goes through the methods below."""

    driver: ModelRunner

    # -- the interface every executor implements ------------------------------------------------
    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Run ModelRunner.`method`(*args) on every rank; the results by rank (rank 0 first)."""

    @abstractmethod
    def execute_model(self, step: StepInput) -> PendingOutput:
        """Launch one step on every rank; result() waits for rank 0's sampled rows."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise a WorkerError when a rank is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every other rank and leave the process group; idempotent. The executor is unusable after."""

    # -- the memory plan's inputs and the caches, built on collective_rpc ---------------------------
    def runner_facts(self) -> RunnerFacts:
        """Rank 0's facts, with the largest rank's weight bytes (the plan must hold on every rank)."""
        facts = self.collective_rpc("facts")
        return replace(facts[0], weight_bytes=max(f.weight_bytes for f in facts))

    def plan_device_memory(self, mine: DeviceMemory) -> DeviceMemory:
        """The device reading to plan for: this process's on one device; with several ranks, the one whose
        device had the least memory available before loading (a plan made for it holds on every rank)."""
        return mine

    def profile_run(self, num_tokens: int, max_num_seqs: int, max_model_len: int) -> ProfiledPeaks:
        peaks = self.collective_rpc("profile_run", (num_tokens, max_num_seqs, max_model_len))
        activation = None if any(p is None for p in peaks) else max(peaks)
        return ProfiledPeaks(activation, self.driver.profiled_graph_bytes)

    def allocate_kv_cache(self, num_blocks: int, config: EngineConfig) -> None:
        """The planned KV cache on every rank, and the engine's final config (the plan's max_model_len) for
        every runner from now on."""
        self.collective_rpc("allocate_kv_cache", (num_blocks, config))

    def release_kv_cache(self) -> None:
        self.collective_rpc("release_kv_cache")

    def capture_graphs(self) -> int | None:
        """Capture the decode CUDA graphs on every rank; rank 0's graph pool in bytes (None: no pool measured)."""
        self.collective_rpc("capture_graphs")
        graphs = self.driver.graphs
        return None if graphs is None else graphs.pool_bytes

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block on a rank, as allocated (every rank holds the same shape)."""
        return self.driver.kv_block_bytes

    def local_model(self):
        """Rank 0's model, in this process (what `bench roofline` times layer by layer)."""
        return self.driver.model

    def allocate_swap_space(self, num_blocks: int) -> None:
        self.collective_rpc("allocate_swap_space", (num_blocks,))


class UniProcExecutor(Executor):
    """One ModelRunner on one device, in the engine's process."""

    def __init__(self, driver: ModelRunner) -> None:
        self.driver = driver

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return [getattr(self.driver, method)(*args)]

    def execute_model(self, step: StepInput) -> PendingOutput:
        return self.driver.execute_async(step)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
