"""`--distributed-executor-backend mp`: the tensor-parallel ranks on this machine. Ranks 1 .. N-1 are
fresh Python processes (`python -m pagedllm.executor.worker`: nothing of the user's script is
re-imported, so no `if __name__ == "__main__"` guard is needed), each dialing back over a local
authenticated connection for its commands; rank 0 is the engine's own process. The collectives run
over torch.distributed (gloo on a CPU, NCCL on CUDA) at a free local TCP port."""
from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener, wait

from pagedllm.config import EngineConfig
from pagedllm.errors import WorkerError
from pagedllm.executor.worker import WorkerInfo, device_for_rank

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 120.0  # a worker process has this long to start Python, import torch and dial back
POLL_S = 0.2  # how often a wait checks that the worker processes are still alive


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(size: int) -> int:
    """The host's cores shared between the ranks (each rank's compute threads)."""
    return max(1, (os.cpu_count() or 1) // size)


class MultiprocWorkers:
    """Ranks 1 .. N-1 as local processes. `start()` launches them; rank 0 then joins the group itself."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.size = config.parallel.tensor_parallel_size
        self.timeout_s = config.parallel.worker_timeout_s
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []

    def start(self) -> None:
        authkey = secrets.token_bytes(16)
        with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
            host, port = listener.address
            env = {**os.environ, "PAGEDLLM_WORKER_AUTHKEY": authkey.hex()}
            self.procs = [subprocess.Popen([sys.executable, "-m", "pagedllm.executor.worker", f"{host}:{port}",
                                            str(rank)], env=env) for rank in range(1, self.size)]
            by_rank = self._accept(listener)
        self.conns = [by_rank[rank] for rank in range(1, self.size)]
        threads = threads_per_rank(self.size)
        for rank, conn in enumerate(self.conns, start=1):
            conn.send((self.config, rank, self.size, self.init_method, self.timeout_s, threads))
        # Each worker says when it has read the config (importing what it names: seconds on a busy machine):
        # only then does rank 0 open the rendezvous, which waits PAGEDLLM_WORKER_TIMEOUT_S for the others.
        for i in range(len(self.conns)):
            self._receive(i, timeout=CONNECT_TIMEOUT_S)

    def _accept(self, listener: Listener) -> dict[int, Connection]:
        """Each worker's connection, by the rank it says; fails as soon as a worker process exits."""
        by_rank: dict[int, Connection] = {}

        def accept() -> None:
            while len(by_rank) < len(self.procs):
                try:
                    conn = listener.accept()
                except OSError:  # the listener closed: start() gave up
                    return
                by_rank[conn.recv()] = conn

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while thread.is_alive():
            thread.join(POLL_S)
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None and rank not in by_rank:
                    raise WorkerError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                                      f"{proc.returncode} before it started")
            if time.monotonic() > deadline:
                raise WorkerError(f"tensor-parallel workers did not start within {CONNECT_TIMEOUT_S:.0f} s")
        return by_rank

    def driver_device(self) -> str:
        """Rank 0's device: cuda:0 (rank r uses cuda:r), or the CPU."""
        return device_for_rank(self.config, 0)

    def ready(self) -> list[WorkerInfo]:
        """Each worker's report once it has loaded its shard (waits as long as loading takes)."""
        return [self._receive(i, timeout=None) for i in range(len(self.conns))]

    def send(self, method: str, args: tuple = (), reply: bool = False) -> None:
        for i, conn in enumerate(self.conns):
            try:
                conn.send((method, args, reply))
            except (BrokenPipeError, OSError):
                raise self._failure(i) from None

    def collect(self) -> list:
        return [self._receive(i, timeout=self.timeout_s) for i in range(len(self.conns))]

    def _receive(self, i: int, timeout: float | None):
        """Worker i's answer; a WorkerError when it reports a failure, exits, or is silent `timeout` seconds."""
        conn, proc = self.conns[i], self.procs[i]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not wait([conn], POLL_S):
            if proc.poll() is not None:
                raise self._failure(i)
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerError(f"tensor-parallel rank {i + 1} (pid {proc.pid}) did not answer within "
                                  f"{timeout:.0f} s")
        try:
            status, payload = conn.recv()
        except (EOFError, OSError):
            raise self._failure(i) from None
        if status == "error":
            raise WorkerError(f"tensor-parallel rank {i + 1} failed:\n{payload}")
        return payload

    def _failure(self, i: int) -> WorkerError:
        proc = self.procs[i]
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        return WorkerError(f"tensor-parallel rank {i + 1} (pid {proc.pid}) exited with code {proc.returncode}")

    def check_alive(self, grace_s: float = 0.0) -> None:
        """A WorkerError for a worker process that has exited. `grace_s`: how long to look for one (a collective
        that failed because its peer died can fail before the kernel has reaped that peer)."""
        deadline = time.monotonic() + grace_s
        while True:
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    raise self._failure(i)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def shutdown(self, wait_s: float = 10) -> None:
        """Ask each worker to stop, wait up to `wait_s` (0: a worker known lost), then kill what is left: none
        outlives the engine."""
        for conn in self.conns:
            try:
                conn.send(("shutdown", (), False))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
