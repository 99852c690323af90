"""`--data-parallel-size N`: N engine replicas behind one OpenAI server.

Each replica is a whole pagedllm server of its own (its engine, its tensor-parallel workers, its KV cache),
started as a child process on a local port; this process serves the user's port and routes each request
to one replica, streaming the answer back byte for byte. A replica runs a request exactly as a lone server
would, so its outputs are the same.

Routing, per generation request (completions, chat, speech):
1. a replica that recently served a prompt with the same beginning (its first PREFIX_CHARS characters),
   while its KV cache is not fuller than the emptiest replica's by more than AFFINITY_SLACK: its prefix
   cache likely holds the prompt's first blocks;
2. else the replica with the most free KV blocks (kv_cache_usage_perc, read from each replica's /metrics
   every POLL_S seconds), counting the requests sent to it since as in use, fewest in flight on a tie.

As a service: the router's front is a lone server's (the API key and the body limit before a body is read,
read timeouts, 503 while draining, --shutdown-timeout passed on to the replicas, which end their own streams
with an error event). A replica that dies takes only its own requests (each open stream gets an error event)
and is started again (backing off while it keeps dying); meanwhile the others serve, and `/health` (200, a
"degraded" body) and `/metrics` (pagedllm:dp_replicas_serving) say so. The replicas die with the router
(PR_SET_PDEATHSIG), even a router killed with SIGKILL. A client that leaves closes the replica's connection,
so the replica aborts its request. `/metrics` is every replica's, each sample labelled `replica="i"`."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.errors import error_body, error_response
from pagedllm.entrypoints.openai.guard import RETRY_AFTER_S
from pagedllm.entrypoints.openai.serving import until_disconnect

logger = logging.getLogger(__name__)

PREFIX_CHARS = 256  # about the first 4 blocks of 16 tokens of English text
AFFINITY_SLACK = 0.25  # how much fuller than the emptiest a replica may be and still get its prefixes
POLL_S = 0.25
WATCH_S = 0.5  # how often the replicas' processes are looked at
RESTART_BACKOFF_S = (1.0, 60.0)  # the wait before restarting a replica that died: doubled per death, capped
START_TIMEOUT_S = 900.0
MAX_PREFIXES = 4096  # prefix -> replica entries remembered (least recently used dropped)
GENERATION_PATHS = ("v1/completions", "v1/chat/completions", "v1/audio/speech")
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


REPLICA_DRAIN_MARGIN_S = 5.0  # a replica's --shutdown-timeout over the router's


class Replica:
    """One replica: its process (replaced when it is restarted), its URL, and what routing reads."""

    def __init__(self, index: int, settings: Path, env: dict[str, str]) -> None:
        self.index, self.settings, self.env = index, settings, env
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.serving = False  # started and answering; False from its death until its restart answers
        self.restarts = 0
        self.kv_usage = 0.0  # last read from its /metrics
        self.in_flight = 0  # requests sent and not yet answered in full
        self.sent_since_poll = 0

    def start(self, ns: argparse.Namespace) -> None:
        """A new process on a new free port (call on the main thread: the replica dies with the thread that
        started it)."""
        from pagedllm.executor.multiproc import free_port

        port = free_port()
        # The router logs each request once. Its drain decides when running requests are ended (it sends the
        # replicas their second signal then): a replica's own deadline comes later, never first.
        child = argparse.Namespace(**{**vars(ns), "data_parallel_size": 1, "port": port, "host": "127.0.0.1",
                                      "disable_log_requests": True,
                                      "shutdown_timeout": ns.shutdown_timeout + REPLICA_DRAIN_MARGIN_S})
        child.func = None  # not picklable, not needed
        self.settings.write_bytes(pickle.dumps(child))
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.openai.replica",
                                      str(self.settings)], env=self.env)
        self.url = f"http://127.0.0.1:{port}"
        self.kv_usage, self.sent_since_poll = 0.0, 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Router:
    def __init__(self, replicas: list[Replica], max_num_seqs: int) -> None:
        self.replicas = replicas
        self.max_num_seqs = max_num_seqs
        self.prefixes: OrderedDict[str, int] = OrderedDict()

    @property
    def serving(self) -> list[Replica]:
        """Replicas serving now (a process that just died is left out before the watch notices it)."""
        return [r for r in self.replicas if r.serving and r.alive]

    def load(self, r: Replica) -> float:
        """Fraction of the KV cache in use, the requests sent since the last reading counted as taking a
        sequence's share each."""
        return r.kv_usage + r.sent_since_poll / self.max_num_seqs

    def choose(self, prefix_key: str | None) -> Replica | None:
        """The replica for a request (None when none is serving)."""
        serving = self.serving
        if not serving:
            return None
        least = min(serving, key=lambda r: (self.load(r), r.in_flight, r.index))
        if prefix_key is not None and prefix_key in self.prefixes:
            favoured = self.replicas[self.prefixes[prefix_key]]
            if favoured in serving and self.load(favoured) <= self.load(least) + AFFINITY_SLACK:
                least = favoured
        if prefix_key is not None:
            self.prefixes[prefix_key] = least.index
            self.prefixes.move_to_end(prefix_key)
            while len(self.prefixes) > MAX_PREFIXES:
                self.prefixes.popitem(last=False)
        return least


def prefix_key(body: bytes) -> str | None:
    """The prompt's beginning (a completion's prompt, or the chat messages / speech input as sent)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    prompt = data.get("prompt", data.get("messages", data.get("input")))
    if prompt is None:
        return None
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    return hashlib.sha1(text[:PREFIX_CHARS].encode()).hexdigest()


def make_replicas(ns: argparse.Namespace, count: int, workdir: Path) -> list[Replica]:
    """Each replica: this server's settings, one replica, in a process of its own (on CUDA with GPUs 0.. of
    this machine: replica i gets the i-th group of --tensor-parallel-size)."""
    import torch

    tp = getattr(ns, "tensor_parallel_size", 1) or 1
    replicas = []
    for i in range(count):
        env = dict(os.environ)
        if torch.cuda.is_available():
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(i * tp, (i + 1) * tp))
        replica = Replica(i, workdir / f"replica-{i}.pickle", env)
        replica.start(ns)
        replicas.append(replica)
    return replicas


def wait_healthy(replicas: list[Replica], timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    while pending:
        for r in list(pending):
            if not r.alive:
                raise RuntimeError(f"data-parallel replica {r.index} exited with code {r.proc.returncode} while "
                                   f"starting (its log is above)")
            try:
                if httpx.get(f"{r.url}/health", timeout=2).status_code == 200:
                    pending.remove(r)
                    r.serving = True
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"data-parallel replicas {[r.index for r in pending]} did not start within "
                               f"{timeout_s:.0f} s")
        time.sleep(0.2)


def signal_replicas(replicas: list[Replica], sig: int = signal.SIGTERM) -> None:
    for r in replicas:
        if r.alive:
            r.proc.send_signal(sig)


def stop_replicas(replicas: list[Replica], timeout_s: float) -> list[int]:
    """SIGTERM (each drains as a lone server would), then kill what is left; their exit statuses."""
    signal_replicas(replicas)
    codes = []
    for r in replicas:
        if r.proc is None:
            continue
        try:
            codes.append(r.proc.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            codes.append(r.proc.wait())
    return codes


def serve_data_parallel(ns: argparse.Namespace, api_key: str | None) -> int:
    """The router on the user's host and port, in front of ns.data_parallel_size replicas. Exit status 0 after
    a clean drain, 1 after a forced one."""
    from pagedllm.entrypoints.openai.connections import uvicorn_config
    from pagedllm.entrypoints.openai.cors import with_cors
    from pagedllm.entrypoints.openai.guard import ServerGuard, default_max_body_bytes, open_paths
    from pagedllm.entrypoints.openai.shutdown import CLOSE_GRACE_S, DrainingServer

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per /metrics poll otherwise
    count = ns.data_parallel_size
    with tempfile.TemporaryDirectory(prefix="pagedllm-dp-") as workdir:
        replicas = make_replicas(ns, count, Path(workdir))
        server: DrainingServer | None = None
        try:
            wait_healthy(replicas)
            router = Router(replicas, ns.max_num_seqs or 256)
            app = build_router_app(router, lambda r: r.start(ns), lambda: guard.draining, api_key)
            max_model_len = _replica_max_model_len(replicas[0], api_key)
            guard = ServerGuard(app, ns.max_request_body_bytes or default_max_body_bytes(max_model_len), api_key,
                                ns.body_timeout, max_prompt_tokens=max_model_len,
                                open_paths=open_paths(ns.require_api_key_for_metrics))
            config = uvicorn_config(with_cors(guard, ns), ns, CLOSE_GRACE_S, access_log=not ns.disable_log_requests)
            # The replicas drain themselves: the first signal is passed on, and a forced drain is their second.
            server = DrainingServer(config, guard, ns.shutdown_timeout, end_requests=lambda: signal_replicas(replicas),
                                    on_drain=lambda: signal_replicas(replicas))
            logger.info("data parallel: %d replicas (%s) behind http://%s:%d/v1", count,
                        ", ".join(r.url for r in replicas), ns.host, ns.port)
            server.run()
        finally:
            codes = stop_replicas(replicas, ns.shutdown_timeout + REPLICA_DRAIN_MARGIN_S + CLOSE_GRACE_S + 5)
    forced = server is not None and server.forced
    return 1 if forced or any(code not in (0, -signal.SIGTERM) for code in codes) else 0


def _replica_max_model_len(replica: Replica, api_key: str | None) -> int:
    """The context length the replica serves (--max-model-len auto is its own plan's)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(f"{replica.url}/v1/models", headers=headers, timeout=10).json()["data"][0]["max_model_len"]


def _unavailable(message: str) -> JSONResponse:
    return error_response(503, message, headers={"Retry-After": str(RETRY_AFTER_S)})


def _sse_error(message: str) -> bytes:
    return f"data: {json.dumps(error_body(503, message))}\n\ndata: [DONE]\n\n".encode()


def build_router_app(router: Router, restart, draining, api_key: str | None = None) -> FastAPI:
    """The router's routes. `restart(replica)` starts a replica's new process; `draining()` says whether the
    server is shutting down (then a replica that exits is not restarted). The router's own calls to the
    replicas (/metrics, /health) carry `api_key`; proxied requests carry their client's headers."""
    client = httpx.AsyncClient(timeout=None, headers={"Authorization": f"Bearer {api_key}"} if api_key else None)

    async def poll() -> None:
        while True:
            for r in router.serving:
                try:
                    text = (await client.get(f"{r.url}/metrics", timeout=5)).text
                    r.kv_usage = _gauge(text, "pagedllm:kv_cache_usage_perc")
                    r.sent_since_poll = 0
                except httpx.HTTPError:
                    pass
            await asyncio.sleep(POLL_S)

    async def supervise(r: Replica) -> None:
        """Restart a replica that died, backing off while it keeps dying; it serves again once healthy."""
        backoff = RESTART_BACKOFF_S[0]
        while not draining():
            logger.error("data-parallel replica %d exited with code %s: its requests failed; the other replicas "
                         "serve; restarting it in %.0f s", r.index, r.proc.returncode, backoff)
            await asyncio.sleep(backoff)
            if draining():
                return
            restart(r)  # on the event loop: the main thread
            r.restarts += 1
            if await _healthy_within(client, r, START_TIMEOUT_S):
                r.serving = True
                logger.info("data-parallel replica %d serves again (restart %d)", r.index, r.restarts)
                return
            if r.alive:
                r.proc.kill()
            backoff = min(backoff * 2, RESTART_BACKOFF_S[1])

    async def watch() -> None:
        restarting: dict[int, asyncio.Task] = {}
        while True:
            for r in router.replicas:
                if r.serving and not r.alive:
                    r.serving = False
                    if r.index not in restarting or restarting[r.index].done():
                        restarting[r.index] = asyncio.create_task(supervise(r))
            await asyncio.sleep(WATCH_S)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        tasks = [asyncio.create_task(poll()), asyncio.create_task(watch())]
        yield
        for task in tasks:
            task.cancel()
        await client.aclose()

    # The replicas' own /openapi.json and /docs pass through the proxy route.
    app = FastAPI(title="pagedllm (data parallel)", lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if draining():
            return _unavailable("draining: the server is shutting down")
        serving = len(router.serving)
        if serving == 0:
            return _unavailable("no data-parallel replica is serving (they are restarting)")
        if serving < len(router.replicas):
            return JSONResponse({"status": "degraded", "replicas_serving": serving,
                                 "replicas": len(router.replicas)})
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        parts = [_router_metrics(router)]
        for r in router.serving:
            try:
                text = (await client.get(f"{r.url}/metrics", timeout=10)).text
            except httpx.HTTPError:
                continue
            parts.append(_label_samples(text, f'replica="{r.index}"'))
        return PlainTextResponse("\n".join(parts), media_type="text/plain; version=0.0.4")

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def proxy(path: str, request: Request):
        body = await request.body()
        generation = request.method == "POST" and path.strip("/") in GENERATION_PATHS
        key = prefix_key(body) if generation else None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            for _ in router.replicas:  # a replica found dead is left for the next
                replica = router.choose(key)
                if replica is None:
                    return _unavailable("no data-parallel replica is serving (they are restarting)")
                upstream = client.build_request(request.method, f"{replica.url}/{path}",
                                                params=request.query_params, headers=headers, content=body)
                replica.in_flight += 1
                replica.sent_since_poll += generation
                sending = asyncio.ensure_future(client.send(upstream, stream=True))
                # A non-streamed answer comes whole at the end: a client that leaves before closes the
                # replica's connection (the replica aborts the request) instead of waiting for it.
                await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not sending.done():
                    sending.cancel()
                    replica.in_flight -= 1
                    return Response(status_code=499)  # nobody reads it
                try:
                    response = sending.result()
                    break
                except httpx.HTTPError as e:
                    replica.in_flight -= 1
                    await asyncio.sleep(0.05)  # a replica that just died is reaped by then
                    if not replica.alive:  # it died before answering: what it began died with it, try another
                        continue
                    return _unavailable(f"data-parallel replica {replica.index} did not answer "
                                        f"({type(e).__name__}): retry, the other replicas serve")
            else:
                return _unavailable("no data-parallel replica accepted the request")
        finally:
            gone.cancel()
        event_stream = response.headers.get("content-type", "").startswith("text/event-stream")

        async def relay():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            except httpx.HTTPError:  # the replica died mid-answer
                if event_stream:
                    yield _sse_error(f"data-parallel replica {replica.index} stopped while answering: this "
                                     f"request was ended; retry it")
            finally:
                await response.aclose()
                replica.in_flight -= 1

        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
        out_headers["x-pagedllm-replica"] = str(replica.index)
        return StreamingResponse(relay(), status_code=response.status_code, headers=out_headers)

    return app


async def _healthy_within(client: httpx.AsyncClient, replica: Replica, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and replica.alive:
        try:
            if (await client.get(f"{replica.url}/health", timeout=2)).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)
    return False


def _router_metrics(router: Router) -> str:
    lines = ["# HELP pagedllm:dp_replicas_serving Data-parallel replicas serving now (fewer than "
             "pagedllm:dp_replicas while one restarts).", "# TYPE pagedllm:dp_replicas_serving gauge",
             f"pagedllm:dp_replicas_serving {len(router.serving)}",
             "# HELP pagedllm:dp_replicas Data-parallel replicas configured.", "# TYPE pagedllm:dp_replicas gauge",
             f"pagedllm:dp_replicas {len(router.replicas)}",
             "# HELP pagedllm:dp_replica_restarts_total Replicas started again after they died.",
             "# TYPE pagedllm:dp_replica_restarts_total counter"]
    lines += [f'pagedllm:dp_replica_restarts_total{{replica="{r.index}"}} {r.restarts}' for r in router.replicas]
    lines += ["# HELP pagedllm:dp_replica_load What the router reads as each replica's load: its KV cache usage at "
              "the last poll plus the requests sent since, a sequence's share each (the least loaded gets the next "
              "request).", "# TYPE pagedllm:dp_replica_load gauge"]
    lines += [f'pagedllm:dp_replica_load{{replica="{r.index}"}} {router.load(r)}' for r in router.replicas]
    return "\n".join(lines)


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _label_samples(text: str, label: str) -> str:
    """Prometheus text with `label` added to every sample line (HELP/TYPE lines kept)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            out.append(line)
        elif "{" in line:
            name, rest = line.split("{", 1)
            out.append(f"{name}{{{label},{rest}")
        else:
            name, value = line.split(" ", 1)
            out.append(f"{name}{{{label}}} {value}")
    return "\n".join(out)
