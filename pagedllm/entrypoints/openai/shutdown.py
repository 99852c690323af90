"""A shutdown that always ends, for the server and for the data-parallel router alike: on the first SIGTERM/SIGINT
new requests get 503 and running ones have `timeout` seconds to finish; then (or at a second signal) the ones
left are ended (`end_requests`: an error event in each stream), bodies still arriving get 503, open
connections get CLOSE_GRACE_S, and the process exits: status 0 after a clean drain, 1 after a forced one. A
watchdog ends the process FORCE_EXIT_S after that whatever it is doing (a thread stuck in C++ included)."""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable

from pagedllm.entrypoints.openai.guard import ServerGuard

logger = logging.getLogger("pagedllm.server")

CLOSE_GRACE_S = 2  # after the drain: for error events to be written and connections to close
FORCE_EXIT_S = 10.0  # past the drain and that grace, a process still up exits (os._exit)


class DrainingServer:
    """uvicorn's server with the shutdown above. `on_drain` runs at the first signal (the router passes the
    signal on to its replicas), `end_requests` when the drain is forced; `forced` says which way it ended."""

    def __init__(self, config, guard: ServerGuard, timeout: float, end_requests: Callable[[], None],
                 on_drain: Callable[[], None] | None = None) -> None:
        import uvicorn

        outer = self

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:  # a signal handler: hand the work to the event loop
                outer.loop.call_soon_threadsafe(outer._on_signal, sig)

        self.server = _Server(config)
        self.guard, self.timeout = guard, timeout
        self.end_requests, self.on_drain = end_requests, on_drain
        self.forced = False
        self._drain: asyncio.Task | None = None
        self._now: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def run(self) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve()

        asyncio.run(serve())

    def stop(self) -> None:
        """End serving now (on the event loop)."""
        self.server.should_exit = True

    def _on_signal(self, sig: int) -> None:
        if self._drain is None:
            logger.info("signal %d: draining (new requests get 503); running requests have %.0f s to finish",
                        sig, self.timeout)
            self.guard.draining = True
            if self.on_drain is not None:
                self.on_drain()
            self._now = asyncio.Event()
            self._drain = self.loop.create_task(self._shutdown())
            _watchdog(self.timeout + CLOSE_GRACE_S + FORCE_EXIT_S)
        else:
            logger.info("signal %d again: ending the running requests now", sig)
            self._now.set()
            _watchdog(CLOSE_GRACE_S + FORCE_EXIT_S)

    async def _shutdown(self) -> None:
        waited = asyncio.ensure_future(self.guard.wait_idle(self.timeout))
        now = asyncio.ensure_future(self._now.wait())
        await asyncio.wait([waited, now], return_when=asyncio.FIRST_COMPLETED)
        now.cancel()
        if self.guard.in_flight:
            self.forced = True
            logger.warning("ending %d request(s) still running", self.guard.in_flight)
            self.end_requests()
            self.guard.stop_reading()
            await self.guard.wait_idle(CLOSE_GRACE_S)  # their error events are written
        self.server.should_exit = True


def _watchdog(seconds: float) -> None:
    """End the process `seconds` from now if it has not ended (a daemon thread: it never keeps it alive)."""

    def expire() -> None:
        time.sleep(seconds)
        logger.error("shutdown did not end within %.0f s: exiting now", seconds)
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=expire, daemon=True, name="pagedllm-shutdown-watchdog").start()
