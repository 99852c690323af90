"""A tensor-parallel worker: ranks 1 .. N-1 of the group, one process each (rank 0 is the engine's own
process). It builds its ModelRunner (its shard of the weights, its part of the KV cache) and then does
what rank 0 does, step by step, as told over its command channel: every collective in the forward
pairs with rank 0's. It samples nothing: rank 0 sends the tokens it sampled with the next step."""
from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.step_input import StepInput
from pagedllm.memory.device import DeviceMemory, device_memory
from pagedllm.model_executor.audio_sampling import commit_frame
from pagedllm.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class StepCommand:
    """One step for the workers: what rank 0 sampled in the step before (request id -> (its token ids: one, or
    the kept drafts and the sampled token; the audio frame of an audio model or None)), then the step itself."""

    step: StepInput
    sampled: dict[str, tuple[list[int], list[int] | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker reports once loaded: its share of the memory plan's measured numbers."""

    rank: int
    pid: int
    weight_bytes: int
    device_memory: DeviceMemory | None  # its GPU before it loaded anything (None on a CPU: rank 0's host)


def device_for_rank(config: EngineConfig, local_rank: int) -> str:
    """Each rank's own GPU on a CUDA machine (`cuda:<local rank>`); on a CPU every rank uses the host."""
    return f"cuda:{local_rank}" if config.device.startswith("cuda") else "cpu"


class Worker:
    """The model runner of one rank, driven by commands (method name, arguments)."""

    def __init__(self, config: EngineConfig, rank: int, local_rank: int) -> None:
        self.rank = rank
        device = device_for_rank(config, local_rank)
        self.at_start = device_memory(device) if device.startswith("cuda") else None
        self.runner = ModelRunner(replace(config, device=device))

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.rank, os.getpid(), self.runner.weight_bytes, self.at_start)

    @torch.inference_mode()
    def execute(self, command: StepCommand) -> None:
        for request_id, (token_ids, frame) in command.sampled.items():
            req = self.runner.requests.get(request_id)
            if req is None:
                continue
            if frame is not None:
                commit_frame(req.audio_state, frame)
            for token_id in token_ids:  # (speculative decoding: the kept drafts, then the sampled token)
                req.append_token(token_id)
        self.runner.execute(command.step)  # its result holds no samples: rank 0's come with the next step

    def run(self, method: str, args: tuple) -> Any:
        if method == "execute":
            return self.execute(*args)
        return getattr(self.runner, method)(*args)


def worker_main(config: EngineConfig, rank: int, local_rank: int, world_size: int, init_method: str,
                timeout_s: float, conn) -> None:
    """A worker process's life: join the group, load, report, then answer commands until told to stop or
    until rank 0's end of the pipe closes (the engine is gone: never outlive it)."""
    from pagedllm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    try:
        init_tensor_parallel(rank, world_size, init_method, torch.device(device_for_rank(config, local_rank)),
                             timeout_s)
        worker = Worker(config, rank, local_rank)
        conn.send(("ready", worker.info()))
        while True:
            try:
                method, args, reply = conn.recv()
            except EOFError:
                return
            if method == "shutdown":
                return
            result = worker.run(method, args)
            if reply:
                conn.send(("ok", result))
    except Exception:  # reported to rank 0, which fails the engine with it
        try:
            conn.send(("error", traceback.format_exc()))
        except (BrokenPipeError, OSError):
            pass
        os._exit(1)
    finally:
        destroy_tensor_parallel()


def main() -> None:
    """`python -m pagedllm.executor.worker HOST:PORT RANK`: a local worker process (multiproc.py). It dials
    the engine back (authkey from PAGEDLLM_WORKER_AUTHKEY), says its rank, receives the engine config and
    how to join the group, then serves commands. A fresh interpreter: nothing of the user's script runs."""
    import sys
    from multiprocessing.connection import Client

    host, port = sys.argv[1].rsplit(":", 1)
    rank = int(sys.argv[2])
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["PAGEDLLM_WORKER_AUTHKEY"]))
    conn.send(rank)
    config, local_rank, world_size, init_method, timeout_s, threads = conn.recv()
    conn.send(("joining", None))  # the config is read: rank 0 may open the rendezvous
    torch.set_num_threads(threads)
    worker_main(config, rank, local_rank, world_size, init_method, timeout_s, conn)
    # The group is left and nothing is buffered: skip the interpreter's teardown of torch (a second of CPU
    # per worker, which the engine's shutdown would wait for).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":  # run from the module's importable copy: pickles then name pagedllm.executor.worker
    from pagedllm.executor.worker import main as _main

    _main()
