"""What stands in front of the API routes: the API key, the request-body size limit, draining at shutdown, and
the count of requests in flight (what a graceful shutdown waits for).

A plain ASGI middleware, so that a body over the limit is refused before it is read (from its
Content-Length, or as soon as the bytes received pass the limit) and a draining server answers 503 before
any route runs."""
from __future__ import annotations

import asyncio
import hmac
import json
from urllib.parse import parse_qs

from pagedllm.entrypoints.openai.messages_api import MESSAGES_PATHS, anthropic_error_body
from pagedllm.entrypoints.openai.errors import error_body

# Routes that are served while draining and need no key: probes, metrics, the API's own description, the web
# page (its files hold nothing of the server's: the page asks for the key before it calls the API).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/docs", "/redoc",
                        "/docs/oauth2-redirect", "/"})
OPEN_PREFIXES = ("/web/",)
RETRY_AFTER_S = 5


def open_paths(metrics_need_key: bool = False) -> frozenset[str]:
    """OPEN_PATHS, less /metrics where the operator asked for it to need the key."""
    return OPEN_PATHS - {"/metrics"} if metrics_need_key else OPEN_PATHS

# Bodies over this are looked at off the event loop before a route parses them: a prompt of more token ids than
# the model's context is refused there (1.2M ids took pydantic 1.6 s of the event loop to refuse).
LARGE_BODY_BYTES = 1 << 20


def default_max_body_bytes(max_model_len: int) -> int:
    """A limit that comfortably fits max_model_len tokens of text (a token is rarely over 16 bytes of
    JSON-escaped text) and never under 8 MiB (chat turns, reference audio for speech)."""
    return max(8 << 20, 64 * max_model_len)


class _ClientGone(Exception):
    pass


class _BodyStalled(Exception):
    pass


class _StoppedReading(Exception):
    pass


class ServerGuard:
    """ASGI middleware. Every route but `open_paths` needs the key (when one is set), checked before the body is
    read; `draining` and `wait_idle` are the shutdown sequence's."""

    def __init__(self, app, max_body_bytes: int, api_key: str | None = None, body_timeout_s: float = 30.0,
                 max_prompt_tokens: int | None = None, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.open_paths = open_paths
        self.max_prompt_tokens = max_prompt_tokens
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.api_key = api_key
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stop_reading = asyncio.Event()  # a forced shutdown: bodies still arriving get 503 at once

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":  # (the API key and draining hold for a WebSocket's handshake too)
            await self._guard_websocket(scope, receive, send)
            return
        if scope["type"] != "http" or scope["path"] in self.open_paths or scope["path"].startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and not self._authorized(scope):
            await _send_error(scope, send, 401, "Invalid or missing API key: send 'Authorization: Bearer <key>' (or "
                                                "'x-api-key: <key>').",
                              {"www-authenticate": "Bearer"})
            return
        if self.draining:
            await _send_error(scope, send, 503, "The server is shutting down: it accepts no new requests.",
                              {"retry-after": str(RETRY_AFTER_S)})
            return
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            await _send_error(scope, send, 413, self._too_large(f"{length} bytes"))
            return
        self.in_flight += 1
        self._idle.clear()
        try:
            body = await self._read_body(receive)
            if body is None:
                await _send_error(scope, send, 413, self._too_large(f"more than {self.max_body_bytes} bytes"))
                return
            if self.max_prompt_tokens is not None and len(body) > LARGE_BODY_BYTES:
                refusal = await asyncio.to_thread(overlong_token_prompt, body, self.max_prompt_tokens)
                if refusal is not None:
                    await _send_error(scope, send, 400, refusal, param="prompt")
                    return
            await self.app(scope, _replay(body, receive), send)
        except _ClientGone:
            pass
        except _BodyStalled:
            await _send_error(scope, send, 408, f"The request body stalled: no bytes came for {self.body_timeout_s:g} s "
                                         f"(--body-timeout).", {"connection": "close"})
        except _StoppedReading:
            await _send_error(scope, send, 503, "The server is shutting down: this request's body was still arriving.",
                              {"connection": "close", "retry-after": str(RETRY_AFTER_S)})
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def _read_body(self, receive) -> bytes | None:
        """The whole body, or None as soon as it passes the limit (the rest is never read). A body that sends
        nothing for body_timeout_s raises _BodyStalled; stop_reading() ends every read at once."""
        chunks, size = [], 0
        stopping = asyncio.ensure_future(self._stop_reading.wait())
        try:
            while True:
                receiving = asyncio.ensure_future(receive())
                done, _ = await asyncio.wait({receiving, stopping}, timeout=self.body_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if receiving not in done:
                    receiving.cancel()
                    raise _StoppedReading() if stopping in done else _BodyStalled()
                message = receiving.result()
                if message["type"] != "http.request":  # the client left while sending: nothing to answer
                    raise _ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    return None
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        finally:
            stopping.cancel()

    def stop_reading(self) -> None:
        """A forced shutdown: requests whose bodies are still arriving are answered 503 now."""
        self._stop_reading.set()

    async def _guard_websocket(self, scope, receive, send) -> None:
        """A WebSocket is refused at its handshake (closed, code 1008 for the key, 1013 while draining) or passed
        on. The key: the Authorization or x-api-key header, or (browsers cannot set headers there) ?api_key=."""
        refused = None
        query_key = (self._query_key(scope) or "").encode()
        if self.api_key is not None and not (self._authorized(scope)
                                             or hmac.compare_digest(query_key, self.api_key.encode())):
            refused = (1008, "Invalid or missing API key: send 'Authorization: Bearer <key>' or ?api_key=<key>")
        elif self.draining:
            refused = (1013, "The server is shutting down: it accepts no new requests.")
        if refused is None:
            await self.app(scope, receive, send)
            return
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": refused[0], "reason": refused[1]})

    @staticmethod
    def _query_key(scope) -> str | None:
        values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key")
        return values[0] if values else None

    def _authorized(self, scope) -> bool:
        """A bearer token (OpenAI's clients) or an x-api-key header (Anthropic's) holding the key."""
        header = _header(scope, b"authorization") or b""
        token = header[7:] if header[:7].lower() == b"bearer " else (_header(scope, b"x-api-key") or b"")
        return hmac.compare_digest(token, self.api_key.encode())

    def _too_large(self, size: str) -> str:
        return (f"The request body ({size}) is over this server's limit of {self.max_body_bytes} bytes "
                f"(--max-request-body-bytes).")

    async def wait_idle(self, timeout: float | None) -> bool:
        """Until no request is in flight (True) or `timeout` seconds pass (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False


def _replay(body: bytes, receive):
    """A receive that gives the body read already, then what the client sends next (its disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def _content_length(scope) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def overlong_token_prompt(body: bytes, max_tokens: int) -> str | None:
    """Why a body's `prompt` of token ids (one list, or a list of lists) cannot fit `max_tokens`, or None."""
    try:
        prompt = json.loads(body).get("prompt")
    except (ValueError, AttributeError):  # not a JSON object: the route answers what is wrong with it
        return None
    if not isinstance(prompt, list) or not prompt:
        return None
    lengths = [len(p) for p in prompt if isinstance(p, list)] if isinstance(prompt[0], list) else [len(prompt)]
    longest = max(lengths, default=0)
    if longest <= max_tokens:
        return None
    return (f"This model's maximum context length is {max_tokens} tokens; the prompt has {longest} token ids "
            f"(refused before parsing the rest of the request).")


async def _send_error(scope, send, status: int, message: str, headers: dict[str, str] | None = None,
                      param: str | None = None) -> None:
    """An error in the shape of the API the path belongs to (Anthropic's on the Messages API's, else OpenAI's)."""
    shaped = anthropic_error_body(status, message) if scope.get("path") in MESSAGES_PATHS else \
        error_body(status, message, param)
    body = json.dumps(shaped).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
