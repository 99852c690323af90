"""Connections that cannot exhaust the server: a request's head must arrive within a deadline (a socket sending
its headers a byte at a time, or nothing at all, is closed), the connections held at once stay below the
process's open-files limit (past it, accept() fails and every client times out), and a refusal repeated by
thousands of sockets is logged once per interval with a count, not once per socket."""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import time

HEADER_TIMEOUT_S = 10.0
RESERVED_FILES = 256  # kept for model files, pipes, worker processes, logs


def with_header_timeout(base: type[asyncio.Protocol], seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class `base`, closing a connection whose next request's head (request line and
    headers) has not fully arrived `seconds` after the connection opened or the previous response ended and
    bytes came. uvicorn closes idle kept-alive connections itself (timeout_keep_alive), but nothing bounds the
    time a head takes to arrive."""

    class HeaderTimeoutProtocol(base):
        _head_timer: asyncio.TimerHandle | None = None
        _cycle_when_started = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._start_head_timer()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._start_head_timer()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _start_head_timer(self) -> None:
            self._cycle_when_started = self.cycle
            self._head_timer = asyncio.get_running_loop().call_later(seconds, self._head_deadline)

        def _head_deadline(self) -> None:
            self._head_timer = None
            if self.cycle is self._cycle_when_started and not self.transport.is_closing():
                refusals.note("a request's head did not arrive within %.0f s: connection closed", seconds)
                self.transport.close()

    HeaderTimeoutProtocol.__name__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol


def http_protocol(seconds: float = HEADER_TIMEOUT_S, max_connections: int | None = None) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol (h11 where httptools is missing) with the head deadline; past
    `max_connections` (uvicorn's limit_concurrency) the 503 is an OpenAI error with Retry-After."""
    try:
        from uvicorn.protocols.http import httptools_impl as module
        base = module.HttpToolsProtocol
    except ImportError:  # httptools not installed
        from uvicorn.protocols.http import h11_impl as module
        base = module.H11Protocol
    if max_connections is not None:
        # uvicorn answers past its limit with the ASGI app its protocol module names `service_unavailable` (a
        # plain-text body); the module's name is looked up per request, so ours replaces it.
        module.service_unavailable = _over_the_connection_cap(max_connections)
    return with_header_timeout(base, seconds)


def _over_the_connection_cap(max_connections: int):
    from pagedllm.entrypoints.openai.errors import error_body
    from pagedllm.entrypoints.openai.guard import RETRY_AFTER_S

    body = json.dumps(error_body(503, f"The server holds {max_connections} connections, its limit "
                                      f"(--max-connections): retry later.")).encode()

    async def service_unavailable(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return service_unavailable


def open_files_limit() -> int:
    """Raise this process's soft open-files limit to its hard limit; the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def default_max_connections() -> int:
    """Connections served at once (uvicorn's limit_concurrency; more get 503): below the open-files limit."""
    return max(32, open_files_limit() - RESERVED_FILES)


class RefusalLog(logging.Filter):
    """A logging filter: a message (its format string) logged again within `interval_s` is dropped, and counted;
    the next time it passes it says how many were dropped. Put on uvicorn's and asyncio's loggers, where
    one line per refused socket or failed accept() would grow the log by megabytes a second."""

    def __init__(self, interval_s: float = 10.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = f"{record.name}:{record.msg}"
        now = time.monotonic()
        if now - self._last.get(key, -self.interval_s) < self.interval_s:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return False
        self._last[key] = now
        dropped = self._dropped.pop(key, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like this in the last {self.interval_s:.0f} s not logged)"
        if len(self._last) > 1000:  # bounded: messages with values in their format string
            self._last.clear()
        return True

    def note(self, message: str, *args) -> None:
        """Log a refusal of pagedllm's own through the filter."""
        _logger.warning(message, *args)

    def install(self) -> None:
        for name in ("uvicorn.error", "asyncio", _logger.name):
            logging.getLogger(name).addFilter(self)


_logger = logging.getLogger("pagedllm.server.connections")
refusals = RefusalLog()


def uvicorn_config(app, ns, graceful_s: float, access_log: bool):
    """uvicorn serving `app` on ns.host:ns.port with the limits above: a deadline on each request's head
    (--header-timeout), at most --max-connections at once (more get 503), idle kept-alive connections closed
    after 5 s, open connections given `graceful_s` once the server stops, refusals logged once per interval."""
    import uvicorn

    refusals.install()
    max_connections = ns.max_connections or default_max_connections()
    return uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level, access_log=access_log,
                          http=http_protocol(ns.header_timeout, max_connections), limit_concurrency=max_connections,
                          timeout_keep_alive=5, timeout_graceful_shutdown=graceful_s)
