"""Running the server in production: oversize bodies, back-pressure, graceful shutdown. Each test starts its
own server (flags differ, and shutdown ends it)."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.server.conftest import AUTH, _start_server, _stop_server, kv_idle, metric, sse_events, wait_until

API_KEY = AUTH["Authorization"].removeprefix("Bearer ")
LONG = 100  # tokens of a stream that must outlive a few requests (max_model_len 128)


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory) -> Path:
    """The tiny Llama with room for streams that outlive a drain (16k positions)."""
    from tests.helpers import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("long") / "llama", "llama", max_position_embeddings=16384)


@pytest.fixture
def start(long_llama, tmp_path):
    """start(*flags) -> (proc, url, stderr path); every server is stopped at the end of the test."""
    procs = []

    def run(*flags: str, max_model_len: int | None = None):
        extra = ["--api-key", API_KEY, *flags]
        if max_model_len is not None:
            extra += ["--max-model-len", str(max_model_len)]  # (argparse: the last one wins)
        proc, url, log = _start_server(long_llama, tmp_path, extra)
        procs.append(proc)
        return proc, url, log

    yield run
    for proc in procs:
        if proc.poll() is None:
            _stop_server(proc)


@pytest.fixture(scope="module")
def plain_server(long_llama, tmp_path_factory):
    """A server with the defaults (and the key), shared by the tests that only send to it: its URL."""
    proc, url, _ = _start_server(long_llama, tmp_path_factory.mktemp("plain"), ["--api-key", API_KEY])
    yield url
    _stop_server(proc)


class StreamWatcher(threading.Thread):
    """One streaming completion on its own thread: the times its chunks arrived and its events."""

    def __init__(self, url: str, max_tokens: int = LONG, prompt: str = "hello world") -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.prompt = url, max_tokens, prompt
        self.times: list[float] = []
        self.events: list = []
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True,
                "temperature": 0}
        try:
            with httpx.Client(base_url=self.url, headers=AUTH, timeout=120) as c:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.times.append(time.monotonic())
                            self.events.extend(sse_events([line]))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    @property
    def max_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:])), default=0.0)

    @property
    def tokens(self) -> int:
        return sum(1 for e in self.events if isinstance(e, dict) and e.get("choices"))


def _raw_request(url: str, head: str, body_parts, read_timeout: float = 10.0) -> tuple[bytes, float]:
    """Send a request over a plain socket (headers, then body parts while the server keeps reading) and
    return the response's first bytes and the seconds it took to come."""
    u = urlparse(url)
    start = time.monotonic()
    with socket.create_connection((u.hostname, u.port), timeout=read_timeout) as s:
        s.sendall(head.encode())
        for part in body_parts:
            try:
                s.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed: read what it said
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        took = time.monotonic() - start
        head_part, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head_part.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += s.recv(65536)
    return head_part + b"\r\n\r\n" + body, took


def _head(path: str, extra: str, key: bool = True) -> str:
    auth = f"Authorization: Bearer {API_KEY}\r\n" if key else ""
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}{extra}\r\n"


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


# -- one request cannot stall the others --------------------------------------------------------

def test_oversize_bodies_get_413_at_once_while_other_streams_keep_producing(plain_server):
    url = plain_server
    streams = [StreamWatcher(url) for _ in range(8)]
    for s in streams:
        s.start()
    wait_until(lambda: all(s.times for s in streams), "all 8 streams to start")
    # 50 MB announced: refused from the headers, before any of it is read.
    resp, took = _raw_request(url, _head("/v1/completions", "Content-Length: 52428800\r\n"), [b"{" + b" " * 65536])
    assert _status(resp) == 413 and took < 1.0, (resp[:300], took)
    assert b"--max-request-body-bytes" in resp
    # No length announced (chunked): refused once the bytes read pass the limit (8 MiB here).
    chunk = b" " * (1 << 20)
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(12)]
    resp, took = _raw_request(url, _head("/v1/completions", "Transfer-Encoding: chunked\r\n"), parts)
    assert _status(resp) == 413 and took < 5.0, (resp[:300], took)
    # A prompt that fits the body limit but never the model: refused from a prefix, not tokenized whole.
    t = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "hello world " * 300_000, "max_tokens": 1},
                   timeout=30)
    assert r.status_code == 400 and time.monotonic() - t < 2.0, (r.text[:300], time.monotonic() - t)
    assert "maximum context length is 128" in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"
    for s in streams:
        s.join(timeout=120)
        assert s.error is None and s.tokens == LONG
        assert s.max_gap < 1.0, f"a stream waited {s.max_gap:.2f} s between two chunks"
    with httpx.Client(base_url=url, headers=AUTH) as c:
        wait_until(lambda: kv_idle(c), "an idle engine")


def test_a_large_tokenize_without_the_key_gets_401_before_its_body_is_read(plain_server):
    url = plain_server
    resp, took = _raw_request(url, _head("/tokenize", "Content-Length: 10485760\r\n", key=False),
                              [b"{" + b" " * 65536])
    assert _status(resp) == 401 and took < 1.0, (resp[:300], took)
    assert b"www-authenticate: Bearer" in resp.lower().replace(b"bearer", b"Bearer")


# -- back-pressure --------------------------------------------------------------------------------

def test_beyond_max_waiting_requests_a_request_gets_503_and_a_gone_client_is_never_computed(start):
    _, url, _ = start("--max-num-seqs", "1", "--max-waiting-requests", "1", max_model_len=1024)
    http = httpx.Client(base_url=url, headers=AUTH, timeout=60)
    running = StreamWatcher(url, max_tokens=900)
    running.start()
    wait_until(lambda: running.times, "the first stream to run")
    # A second request waits (one sequence at a time); it is then given up by its client.
    waiting_client = httpx.Client(base_url=url, headers=AUTH, timeout=60)
    waiting = waiting_client.stream("POST", "/v1/completions", json={"prompt": "a b c", "max_tokens": 5,
                                                                     "stream": True})
    waiting_response = waiting.__enter__()
    wait_until(lambda: http.get("/v1/memory").json()["num_waiting"] == 1, "the second request to wait")
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
    assert "--max-waiting-requests" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 503
    waiting.__exit__(None, None, None)  # the client leaves before its request was scheduled
    waiting_client.close()
    del waiting_response
    mem = wait_until(lambda: (lambda m: m if m["num_waiting"] == 0 else None)(http.get("/v1/memory").json()),
                     "the abandoned request to leave the queue")
    assert len(mem["requests"]) == 1  # the first one, still running
    running.join(timeout=120)
    assert running.error is None and running.tokens == 900
    assert metric(url, "pagedllm:generation_tokens_total") == 900  # none for the abandoned request
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    http.close()


def test_a_burst_past_max_waiting_requests_gets_exactly_the_overflow_refused(start):
    """12 completions sent at once against one running sequence and a queue of 2: a request counts against
    --max-waiting-requests from its admission, before its prompt is tokenized, so the ones past the queue get 503
    with Retry-After (all passed the check before any was queued when it read only the engine's queue)."""
    import asyncio

    _, url, _ = start("--max-num-seqs", "1", "--max-waiting-requests", "2")

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as client:
            body = {"prompt": "hello world " * 5, "max_tokens": 64, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(12)))

    for _ in range(2):  # every time
        responses = asyncio.run(burst())
        statuses = [r.status_code for r in responses]
        assert 400 not in statuses, responses[statuses.index(400)].text
        refused = [r for r in responses if r.status_code == 503]
        assert set(statuses) <= {200, 503} and statuses.count(200) >= 2 and refused, statuses
        assert all(int(r.headers["retry-after"]) > 0 and "--max-waiting-requests" in r.text for r in refused)
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200  # nothing left counted once the burst is over


# -- graceful shutdown ----------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_sigterm_lets_running_streams_finish_refuses_new_requests_and_exits_0(start):
    proc, url, log = start(max_model_len=1024)
    children = _children(proc.pid)
    streams = [StreamWatcher(url, max_tokens=600) for _ in range(16)]
    for s in streams:
        s.start()
    wait_until(lambda: all(s.times for s in streams), "all 16 streams to start")
    proc.send_signal(signal.SIGTERM)
    r = wait_until(lambda: (lambda r: r if r.status_code == 503 else None)(
        httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 1}, timeout=10)),
        "a request during the drain to be refused")
    assert "shutting down" in r.json()["error"]["message"] and "retry-after" in r.headers
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 503 and "draining" in health.text
    for s in streams:
        s.join(timeout=120)
        assert s.error is None and s.tokens == 600 and s.events[-1] == "[DONE]"
    assert proc.wait(timeout=60) == 0
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize("how", ["timeout", "second-signal"])
def test_streams_still_running_when_the_drain_ends_get_an_error_event(start, how):
    flags = ("--shutdown-timeout", "2") if how == "timeout" else ("--shutdown-timeout", "600")
    # 64 MiB of KV cache holds the four streams' 16k tokens (by default: max_num_seqs x 16k, 2 GiB to allocate)
    proc, url, log = start(*flags, "--kv-cache-memory", "64MiB", max_model_len=16384)
    streams = [StreamWatcher(url, max_tokens=16000) for _ in range(4)]
    for s in streams:
        s.start()
    wait_until(lambda: all(s.times for s in streams), "the streams to start")
    t = time.monotonic()
    proc.send_signal(signal.SIGINT)
    if how == "second-signal":
        wait_until(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 503, "draining")
        proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 1  # a forced drain: not a clean exit
    assert time.monotonic() - t < (30 if how == "second-signal" else 15)
    for s in streams:
        s.join(timeout=30)
        assert s.error is None, s.error
        errors = [e for e in s.events if isinstance(e, dict) and "error" in e]
        assert s.tokens < 16000 and len(errors) == 1 and s.events[-1] == "[DONE]", s.events[-3:]
        assert errors[0]["error"]["code"] == 503 and "shutting down" in errors[0]["error"]["message"]
    assert "Traceback" not in log.read_text()


# -- the soak benchmark ---------------------------------------------------------------------------

def test_bench_soak_reports_each_window_and_an_idle_engine_at_the_end(server_url, tmp_path):
    from pagedllm.bench.soak import main as soak_main

    out = tmp_path / "soak.json"
    rc = soak_main(["--base-url", server_url, "--api-key", API_KEY, "--minutes", "2", "--window-seconds", "3",
                    "--concurrency", "4", "--oversize-fraction", "0.1", "--malformed-fraction", "0.2",
                    "--abort-fraction", "0.3", "--max-tokens", "8", "--abusive-fraction", "0.3",
                    "--abusive-kinds", "template,schema,stop-list,wide-n,dropped", "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, report["total"]
    assert [r["minute"] for r in report["minutes"]] == [1, 2]
    assert report["total"]["server_errors"] == 0 and report["total"]["kv_when_idle"]["blocks_used"] == 0
    kinds = report["total"]["by_kind"]
    assert kinds.get("oversize", 0) > 0 and kinds.get("malformed", 0) > 0 and kinds.get("abort", 0) > 0
    assert sum(kinds.get(k, 0) for k in ("template", "schema", "stop-list", "wide-n", "dropped")) > 0
    assert all(r["errors"] == {} and r["served"] == r["requests"] > 0 for r in report["minutes"])
    assert all(r["rss_bytes"] and r["p99_s"] >= r["p50_s"] > 0 for r in report["minutes"])
