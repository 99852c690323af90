"""Work that one request can make unbounded (compiling its grammar, rendering its own chat template) runs in a
worker process that can be stopped: a call past its deadline, or whose client left, ends by killing the worker
(a thread in the middle of xgrammar's C++ or of a jinja loop cannot be stopped), and the worker's address space
is capped, so one request can neither hold the server nor take its memory.

A worker is a fresh `python -c ... HANDLER FD MEMORY` calling main() (not multiprocessing's spawn, which
would import the server's main module and with it torch), talking over a socket pair. HANDLER names a factory
`module:function` that gets the first message sent (e.g. the tokenizer's vocabulary) and returns the function
that answers each call. The worker dies with its parent (PR_SET_PDEATHSIG)."""
from __future__ import annotations

import importlib
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

# Resident memory of a started worker before its first call (CPython and its handler's imports), what the memory
# plan counts for each beside what its cap lets one call take. Measured (x86-64, CPython 3.11): the grammar
# worker 312 MiB with a 128k-token vocabulary (xgrammar, the vocabulary's tables), the template worker 240 MiB
# (transformers' sandboxed jinja); rounded up.
GRAMMAR_WORKER_START_BYTES = 384 << 20
TEMPLATE_WORKER_START_BYTES = 288 << 20
TEMPLATE_WORKER_MEMORY_BYTES = 1 << 30  # a request template's render may take this beyond the start

_POLL_S = 0.02  # how often a waiting call looks at its deadline and its cancel event
_START_TIMEOUT_S = 120.0
# `python -m` would warn: the package's __init__ has imported this module already.
_WORKER_ENTRY = "import sys; from pagedllm.isolated_worker import main; main(sys.argv[1:])"


class WorkerTimeout(Exception):
    """The call did not finish within its deadline (the worker was killed)."""


class WorkerCancelled(Exception):
    """The call was cancelled (its client left, or the server is stopping; the worker was killed)."""


class WorkerOutOfMemory(Exception):
    """The call needed more memory than the worker's cap (or the worker died)."""


class IsolatedWorker:
    """call(request, timeout_s, cancel) -> the handler's answer, one call at a time; started at the first call
    and again after each kill. A handler's ValueError comes back as a ValueError with its message."""

    def __init__(self, handler: str, init: Any, memory_bytes: int) -> None:
        self.handler, self.init, self.memory_bytes = handler, init, memory_bytes
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self.restarts = 0  # workers killed (deadline, cancel, memory)
        self._closed = False  # shut down: no restart in the background

    def call(self, request: Any, timeout_s: float, cancel: threading.Event | None = None) -> Any:
        with self._lock:
            if cancel is not None and cancel.is_set():  # cancelled while it waited for the worker
                raise WorkerCancelled()
            self._closed = False
            conn = self._ensure_started()
            conn.send(request)
            deadline = time.monotonic() + timeout_s
            while not conn.poll(_POLL_S):
                if cancel is not None and cancel.is_set():
                    self._kill("cancelled")
                    raise WorkerCancelled()
                alive = self._process.poll() is None
                if alive and time.monotonic() <= deadline:
                    continue
                self._kill("past its deadline" if alive else "the worker died")
                raise WorkerTimeout() if alive else WorkerOutOfMemory()
            try:
                status, payload = conn.recv()
            except (EOFError, OSError):  # it died while answering
                self._kill("the worker died")
                raise WorkerOutOfMemory() from None
        if status == "ok":
            return payload
        if status == "memory":
            raise WorkerOutOfMemory()
        raise ValueError(payload)

    def start(self) -> int:
        """Start the worker now rather than at the first call; its process id."""
        with self._lock:
            self._closed = False
            self._ensure_started()
            return self._process.pid

    def _ensure_started(self) -> Connection:
        if self._process is None or self._process.poll() is not None:
            parent, child = socket.socketpair()
            process = _spawn([sys.executable, "-c", _WORKER_ENTRY, self.handler, str(child.fileno()),
                              str(self.memory_bytes)], pass_fds=(child.fileno(),))
            child.close()
            conn = Connection(parent.detach())
            conn.send(self.init)
            # Start-up (imports, the handler's set-up) is not counted in a call's deadline.
            if not conn.poll(_START_TIMEOUT_S) or conn.recv() != "ready":
                process.kill()
                process.wait()
                conn.close()
                raise RuntimeError(f"the {self.handler} worker did not start within {_START_TIMEOUT_S:.0f} s")
            self._process, self._conn = process, conn
        return self._conn

    def _kill(self, why: str) -> None:
        """Stop the worker (called holding the lock) and start its successor in the background, so that the
        next call does not wait for its start-up."""
        logger.warning("%s stopped (%s): its worker process is restarted", self.handler.split(":")[-1], why)
        self.restarts += 1
        self._stop_process()
        threading.Thread(target=self._restart, daemon=True, name="pagedllm-worker-restart").start()

    def _restart(self) -> None:
        with self._lock:
            if not self._closed:
                try:
                    self._ensure_started()
                except RuntimeError as e:  # the next call tries again, and reports it
                    logger.warning("%s", e)

    def shutdown(self) -> None:
        """Stop the worker for good (a later call starts one again)."""
        self._closed = True
        self._stop_process()

    def _stop_process(self) -> None:
        process, conn, self._process, self._conn = self._process, self._conn, None, None
        if process is not None:
            process.kill()
            process.wait(5)
            conn.close()


_spawn_requests: queue.SimpleQueue = queue.SimpleQueue()
_spawner_lock = threading.Lock()
_spawner: threading.Thread | None = None


def _spawn(args: list[str], pass_fds: tuple[int, ...]) -> subprocess.Popen:
    """Popen on one long-lived thread: the kernel's parent-death signal fires when the *thread* that started a
    process exits, so a worker started from a passing thread (a restart, a request's) would be killed with it."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_spawn_forever, daemon=True, name="pagedllm-worker-spawner")
            _spawner.start()
    answer: queue.SimpleQueue = queue.SimpleQueue()
    _spawn_requests.put((args, pass_fds, answer))
    result = answer.get()
    if isinstance(result, BaseException):
        raise result
    return result


def _spawn_forever() -> None:
    while True:
        args, pass_fds, answer = _spawn_requests.get()
        try:
            answer.put(subprocess.Popen(args, pass_fds=pass_fds))
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            answer.put(e)


def _cap_address_space(extra_bytes: int) -> None:
    """RLIMIT_AS: what the worker maps now plus extra_bytes (Linux; elsewhere no cap)."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = mapped + extra_bytes
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, ValueError):
        pass


def _worker_main(handler: str, fd: int, memory_bytes: int) -> None:
    from pagedllm.utils import die_with_parent

    die_with_parent()
    conn = Connection(fd)
    module, function = handler.split(":")
    answer = getattr(importlib.import_module(module), function)(conn.recv())
    _cap_address_space(memory_bytes)
    conn.send("ready")
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", answer(request)))
        except MemoryError:
            conn.send(("memory", ""))
        except Exception as e:  # noqa: BLE001 - the reason goes back to the caller
            # C++ extensions (xgrammar) report an allocation past the cap as std::bad_alloc, not MemoryError.
            conn.send(("memory", "") if "bad_alloc" in str(e) else ("error", str(e)))


def main(argv: list[str]) -> None:
    """The worker process: argv is HANDLER FD MEMORY_BYTES."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _worker_main(argv[0], int(argv[1]), int(argv[2]))
