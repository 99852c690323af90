"""`pagedllm serve --data-parallel-size 2`: two replicas behind one server. 32 concurrent streams all answer
what one engine answers, spread over both replicas; a repeated prompt goes back to the replica that has its
prefix; /metrics has each replica's series under a `replica` label; SIGKILL of the router takes the replicas with
it. As a service: the key and the body limit before a body is read, a lost replica takes only its own requests
and is restarted, a client that leaves reaches the replica, the drain as a lone server's."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

from tests.distributed.test_tp_server import alive
from tests.server.conftest import BESIDE_LIMIT_S, NormalClient, metric, start_command, wait_until


def stream_text(url: str, name: str, prompt: list[int]) -> tuple[str, str]:
    """The streamed completion's text and the replica that served it."""
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                      json={"model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                            "stream": True}) as r:
        assert r.status_code == 200
        replica = r.headers["x-pagedllm-replica"]
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text), replica


def test_two_replicas_answer_32_streams_as_one_engine_does(tiny_models, tmp_path):
    from pagedllm import LLM, SamplingParams

    model = tiny_models["llama"]
    prompts = [[3 + i, 4 + 2 * i, 5, 6 + i % 7] for i in range(32)]
    with LLM(str(model), dtype="float32", max_model_len=256) as one:
        expected = [o.outputs[0].text for o in one.generate([{"prompt_token_ids": p} for p in prompts],
                                                            SamplingParams(temperature=0, max_tokens=12),
                                                            use_tqdm=False)]
    proc, url = start_command(lambda port: [sys.executable, "-m", "pagedllm", "serve", str(model), "--port", str(port),
                                            "--dtype", "float32", "--max-model-len", "256", "-dp", "2"], tmp_path)
    try:
        name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        results: dict[int, tuple[str, str]] = {}

        def run(i: int) -> None:
            results[i] = stream_text(url, name, prompts[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i][0] for i in range(32)] == expected
        assert {replica for _, replica in results.values()} == {"0", "1"}
        again = [stream_text(url, name, [9, 9, 9, 9])[1] for _ in range(3)]
        assert len(set(again)) == 1  # the replica holding the prompt's prefix
        metrics = httpx.get(f"{url}/metrics").text
        for replica in ("0", "1"):
            assert f'pagedllm:generation_tokens_total{{replica="{replica}",model_name=' in metrics
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        children = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        proc.kill()  # SIGKILL: the router cannot stop its replicas itself
        proc.wait(timeout=30)
    assert len(children) == 2
    wait_until(lambda: not any(alive(c) for c in children), "the replicas to die with the router", attempts=100,
               interval_s=0.1)


KEY = "sk-dp"
AUTH = {"Authorization": f"Bearer {KEY}"}
# The router test's context: its last stream must outlast --shutdown-timeout (3 s) on an idle machine, where the
# tiny model decoded 4000 tokens in less (the drain then ended on its own, exit status 0, not the forced 1).
LONG_LEN = 16384
KV_CACHE = "64MiB"  # 128k tokens of the tiny model, 8 x LONG_LEN (by default: max_num_seqs x LONG_LEN, 2 GiB)


class Stream(threading.Thread):
    """A streamed completion: its replica and its events."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.replica: str | None = None
        self.events: list = []
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": "m", "prompt": self.prompt, "max_tokens": self.max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
                assert r.status_code == 200, r.read()
                self.replica = r.headers["x-pagedllm-replica"]
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            self.error = e

    @property
    def tokens(self) -> int:
        return sum(1 for e in self.events if isinstance(e, dict) and e.get("choices"))

    @property
    def errors(self) -> list[dict]:
        return [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]


def _replica_pids(router_pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{router_pid}/task/{router_pid}/children").read_text().split()]


def _rss(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_router_serves_as_a_lone_server_does_and_outlives_a_replica(tmp_path):
    from tests.helpers import make_tiny_model

    model = make_tiny_model(tmp_path / "long-llama", "llama", max_position_embeddings=LONG_LEN)
    proc, url = start_command(lambda port: [
        sys.executable, "-m", "pagedllm", "serve", str(model), "--port", str(port), "--dtype", "float32",
        "--max-model-len", str(LONG_LEN), "-dp", "2", "--api-key", KEY, "--served-model-name", "m",
        "--shutdown-timeout", "3", "--disable-log-requests", "--kv-cache-memory", KV_CACHE], tmp_path)
    log = next(tmp_path.glob("server-*.stderr"))
    try:
        replicas = _replica_pids(proc.pid)
        # The key and the body limit come before the body: a 500 MB body without the key is never read.
        rss = _rss(proc.pid)
        u = urlparse(url)
        with NormalClient(url, "m", AUTH):  # every normal request beside each abuse below answers within 1 s
            for _ in range(4):
                with socket.create_connection((u.hostname, u.port), timeout=10) as s:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 500000000\r\n\r\n" + b" " * 65536)
                    assert s.recv(65536).startswith(b"HTTP/1.1 401")
        assert _rss(proc.pid) - rss < 50 << 20
        # The replicas' own API description; HEAD /health for load balancers.
        spec = httpx.get(f"{url}/openapi.json").json()
        assert "/v1/completions" in spec["paths"] and spec["info"]["title"] == "pagedllm"
        assert httpx.head(f"{url}/health").status_code == 200
        assert metric(url, "pagedllm:dp_replicas_serving") == 2

        # A non-streamed client that leaves: the replica is told and stops generating.
        with NormalClient(url, "m", AUTH) as normal:
            before = metric(url, "pagedllm:generation_tokens_total")
            try:
                httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=1.0, json={
                    "model": "m", "prompt": [5, 6, 7], "max_tokens": 3500, "ignore_eos": True, "temperature": 0})
            except httpx.ReadTimeout:
                pass
            wait_until(lambda: metric(url, "pagedllm:num_requests_running") == 0, "the replica to abort the request",
                       attempts=100, interval_s=0.1)
            normal_tokens = 2 * len(normal.latencies) + 2  # the normal client's own, one request in flight
            assert metric(url, "pagedllm:generation_tokens_total") - before < 3000 + normal_tokens

        # SIGKILL one replica while streams run on both: only its streams end (with an error event). The router
        # must first have polled both idle (the aborted request's blocks counted on one until then).
        wait_until(lambda: all(metric(url, "pagedllm:dp_replica_load", replica=str(i)) == 0 for i in (0, 1)),
                   "the router to read both replicas idle", attempts=100, interval_s=0.1)
        streams = [Stream(url, [3 + i, 4, 5], 1000) for i in range(4)]
        for s in streams:
            s.start()
        wait_until(lambda: all(s.tokens for s in streams), "the streams to start", attempts=600, interval_s=0.1)
        served_by = {s.replica for s in streams}
        assert served_by == {"0", "1"}, served_by
        with NormalClient(url, "m", AUTH):  # served by the other replica (or sent on to it) while 0 restarts
            os.kill(replicas[0], signal.SIGKILL)
            for s in streams:
                s.join(timeout=120)
        for s in streams:
            assert s.error is None, s.error
            if s.replica == "0":
                assert s.tokens < 1000 and len(s.errors) == 1 and s.events[-1] == "[DONE]", s.events[-2:]
                assert s.errors[0]["code"] == 503 and "replica 0" in s.errors[0]["message"]
            else:
                assert s.tokens == 1000 and not s.errors
        health = httpx.get(f"{url}/health")
        if health.status_code == 200 and health.content:  # degraded until the restart answers
            assert health.json() == {"status": "degraded", "replicas_serving": 1, "replicas": 2}
        wait_until(lambda: metric(url, "pagedllm:dp_replicas_serving") == 2, "the replica's restart",
                   attempts=1200, interval_s=0.1)
        assert metric(url, "pagedllm:dp_replica_restarts_total", replica="0") == 1
        assert httpx.get(f"{url}/health").content == b""
        idle_from = log.read_text().count("\n")
        time.sleep(2)  # a window in which an idle router writes nothing (it polled /metrics 8 times a second)
        assert log.read_text().count("\n") == idle_from, log.read_text()[-2000:]

        # SIGTERM with a stream running past --shutdown-timeout: 503 for newcomers, the stream ends with an
        # error event, exit status 1 (a forced drain) within the timeout and the grace.
        long = Stream(url, [9, 9, 9], LONG_LEN - 3)
        long.start()
        wait_until(lambda: long.tokens, "the long stream", attempts=600, interval_s=0.1)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        late = wait_until(lambda: (lambda r: r if r.status_code == 503 else None)(httpx.post(
            f"{url}/v1/completions", headers=AUTH, json={"model": "m", "prompt": "hi", "max_tokens": 1},
            timeout=10)), "a late request's 503")
        assert "shutting down" in late.json()["error"]["message"]
        assert late.elapsed.total_seconds() < BESIDE_LIMIT_S  # refused at once while the drain goes on
        assert proc.wait(timeout=60) == 1
        assert time.monotonic() - t < 3 + 2 + 6
        long.join(30)
        assert long.error is None and len(long.errors) == 1 and long.events[-1] == "[DONE]"
        assert "shutting down" in long.errors[0]["message"]
        assert "HTTP Request: GET" not in log.read_text()  # no line per /metrics poll
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
