"""AsyncLLMEngine: the server's engine. One background thread owns the LLMEngine and steps it;
requests arrive from the event loop at any time and join the running batch; each gets a stream.

All engine state is touched only by that thread (commands reach it through a queue), so the
engine itself needs no locks, and torch work never blocks the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.executor.openmp import release_thread_pool
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error; the server answers 503."""


class RequestAbortedError(RuntimeError):
    """The server ended the request before it finished (a shutdown whose drain time ran out)."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, step_listener=None, abort_listener=None, failure_listener=None) -> None:
        self.engine = engine
        self.step_listener = step_listener  # called on the engine thread after every step
        self.abort_listener = abort_listener  # called on the engine thread with the engine and an aborted request id
        self.failure_listener = failure_listener  # called on the engine thread with the error that stopped it
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stopped = threading.Event()
        self.errored: BaseException | None = None
        # Requests submitted and not yet scheduled: adds still in the command queue plus the scheduler's
        # waiting queue. Each counter is written by one thread only (back-pressure reads them).
        self._adds_submitted = 0  # event loop
        self._adds_handled = 0  # engine thread
        self._scheduler_waiting = 0  # engine thread
        self._counts = threading.Lock()  # `handled` and the scheduler's count change together
        # The engine was built on this thread and is stepped on its own from now on: free this thread's
        # OpenMP pool, or two pools share the cores and every step slows (executor/openmp.py).
        release_thread_pool()
        self._thread = threading.Thread(target=self._loop, name="pagedllm-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.errored is None

    @property
    def num_waiting(self) -> int:
        """Requests accepted and not yet scheduled (read from any thread): each request once, whether its add
        is still in the command queue or it waits in the scheduler's."""
        with self._counts:
            return self._adds_submitted - self._adds_handled + self._scheduler_waiting

    def _set_scheduler_waiting(self, handled_one: bool = False) -> None:
        with self._counts:
            self._scheduler_waiting = len(self.engine.scheduler.waiting)
            self._adds_handled += handled_one

    # -- called from the event loop ----------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          strict_length: bool = False, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Submit a request and return the stream of its outputs (cumulative, one per step).

        Invalid input raises here, before anything is queued. Leaving the stream early (a client
        disconnect) aborts the request; its blocks are freed before the next step. A stream that is
        never iterated must be aborted by the caller.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        stream = _Stream(asyncio.get_running_loop())
        future: Future = Future()
        self._adds_submitted += 1
        self._commands.put(("add", request_id, prompt, params, strict_length, priority, stream, future))
        await asyncio.wrap_future(future)  # raises the validation error, if any
        return self._outputs(request_id, stream)

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abort_all(self, message: str) -> None:
        """End every request now: each stream gets a RequestAbortedError(message), each request is aborted."""
        self._commands.put(("abort_all", message))

    def call(self, fn):
        """Run fn(engine) on the engine thread; returns a future of its result (for consistent reads)."""
        future: Future = Future()
        self._commands.put(("call", fn, future))
        return asyncio.wrap_future(future)

    def shutdown(self) -> None:
        """Stop the engine thread, then the engine's workers (tensor parallelism)."""
        self._stopped.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=30)
        self.engine.shutdown()

    # -- the engine thread -------------------------------------------------------------------
    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, request_id, prompt, params, strict_length, priority, stream, future = cmd
            try:
                self.engine.add_request(request_id, prompt, params, stream=True, strict_length=strict_length,
                                        priority=priority)
            except Exception as e:  # bad input: back to the caller, the engine is untouched
                with self._counts:
                    self._adds_handled += 1
                future.set_exception(e)
                return
            self._set_scheduler_waiting(handled_one=True)
            self._streams[request_id] = stream
            future.set_result(None)
        elif kind == "abort":
            self.engine.abort_request(cmd[1])
            self._streams.pop(cmd[1], None)
            if self.abort_listener is not None:
                self.abort_listener(self.engine, cmd[1])
        elif kind == "abort_all":
            for request_id, stream in list(self._streams.items()):
                stream.put(RequestAbortedError(cmd[1]))
                self._handle(("abort", request_id))
        elif kind == "call":
            _, fn, future = cmd
            try:
                future.set_result(fn(self.engine))
            except Exception as e:
                future.set_exception(e)

    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                block = not self.engine.has_unfinished_requests()
                cmd = self._commands.get(block=block, timeout=None) if block else self._commands.get_nowait()
                self._handle(cmd)
                while True:  # everything that arrived before this step joins it
                    self._handle(self._commands.get_nowait())
            except queue.Empty:
                pass
            self._set_scheduler_waiting()
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
                if not self.engine.has_unfinished_requests():
                    self.engine.check_integrity()  # idle: every block must be back in the pool
            except Exception as e:  # a bug, not bad input: fail what is running, stop serving
                logger.exception("engine step failed")
                self.errored = e
                for stream in self._streams.values():
                    stream.put(EngineDeadError(f"engine step failed: {e}"))
                self._streams.clear()
                if self.failure_listener is not None:
                    self.failure_listener(e)
                return
            self._set_scheduler_waiting()
            now = time.monotonic()
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            if self.step_listener is not None:
                self.step_listener(self.engine, outputs, now)
