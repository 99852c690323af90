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
`/metrics` is every replica's, each sample labelled `replica="i"`; `/health` is 200 while every replica
answers 200. A replica that exits stops the server (status 1) after stopping the others."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import pickle
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

logger = logging.getLogger(__name__)

PREFIX_CHARS = 256  # about the first 4 blocks of 16 tokens of English text
AFFINITY_SLACK = 0.25  # how much fuller than the emptiest a replica may be and still get its prefixes
POLL_S = 0.25
MAX_PREFIXES = 4096  # prefix -> replica entries remembered (least recently used dropped)
GENERATION_PATHS = ("v1/completions", "v1/chat/completions", "v1/audio/speech")
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


class Replica:
    def __init__(self, index: int, proc: subprocess.Popen, url: str) -> None:
        self.index, self.proc, self.url = index, proc, url
        self.kv_usage = 0.0  # last read from its /metrics
        self.in_flight = 0  # requests sent and not yet answered in full
        self.sent_since_poll = 0


class Router:
    def __init__(self, replicas: list[Replica], max_num_seqs: int) -> None:
        self.replicas = replicas
        self.max_num_seqs = max_num_seqs
        self.prefixes: OrderedDict[str, int] = OrderedDict()

    def load(self, r: Replica) -> float:
        """Fraction of the KV cache in use, the requests sent since the last reading counted as taking a
        sequence's share each."""
        return r.kv_usage + r.sent_since_poll / self.max_num_seqs

    def choose(self, prefix_key: str | None) -> Replica:
        least = min(self.replicas, key=lambda r: (self.load(r), r.in_flight, r.index))
        if prefix_key is not None and prefix_key in self.prefixes:
            favoured = self.replicas[self.prefixes[prefix_key]]
            if self.load(favoured) <= self.load(least) + AFFINITY_SLACK:
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


def start_replicas(ns: argparse.Namespace, count: int, workdir: Path) -> list[Replica]:
    """Each replica: this server's settings, one replica, on a free local port, in a process of its own
    (on CUDA with GPUs 0.. of this machine: replica i gets the i-th group of --tensor-parallel-size)."""
    import os

    import torch

    from pagedllm.executor.multiproc import free_port

    tp = getattr(ns, "tensor_parallel_size", 1) or 1
    replicas = []
    for i in range(count):
        port = free_port()
        child = argparse.Namespace(**{**vars(ns), "data_parallel_size": 1, "port": port, "host": "127.0.0.1"})
        child.func = None  # not picklable, not needed
        settings = workdir / f"replica-{i}.pickle"
        settings.write_bytes(pickle.dumps(child))
        env = dict(os.environ)
        if torch.cuda.is_available():
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(i * tp, (i + 1) * tp))
        proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.openai.data_parallel", str(settings)],
                                env=env)
        replicas.append(Replica(i, proc, f"http://127.0.0.1:{port}"))
    return replicas


def wait_healthy(replicas: list[Replica], timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    while pending:
        for r in list(pending):
            if r.proc.poll() is not None:
                raise RuntimeError(f"data-parallel replica {r.index} exited with code {r.proc.returncode} while "
                                   f"starting (its log is above)")
            try:
                if httpx.get(f"{r.url}/health", timeout=2).status_code == 200:
                    pending.remove(r)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"data-parallel replicas {[r.index for r in pending]} did not start within "
                               f"{timeout_s:.0f} s")
        time.sleep(0.2)


def stop_replicas(replicas: list[Replica], timeout_s: float = 60.0) -> None:
    """SIGTERM (each drains as a lone server would), then kill what is left."""
    for r in replicas:
        if r.proc.poll() is None:
            r.proc.terminate()
    for r in replicas:
        try:
            r.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()


def serve_data_parallel(ns: argparse.Namespace) -> int:
    """The router on the user's host and port, in front of ns.data_parallel_size replicas."""
    import threading

    count = ns.data_parallel_size
    with tempfile.TemporaryDirectory(prefix="pagedllm-dp-") as workdir:
        replicas = start_replicas(ns, count, Path(workdir))
        lost: list[Replica] = []
        try:
            wait_healthy(replicas)
            router = Router(replicas, ns.max_num_seqs or 256)
            server = RouterServer(uvicorn.Config(build_router_app(router), host=ns.host, port=ns.port,
                                                  log_level=ns.uvicorn_log_level,
                                                  access_log=not ns.disable_log_requests))

            def watch() -> None:
                while not server.should_exit:
                    for r in replicas:
                        if r.proc.poll() is not None:
                            logger.error("data-parallel replica %d exited with code %s: stopping", r.index,
                                         r.proc.returncode)
                            lost.append(r)
                            server.should_exit = True
                            return
                    time.sleep(0.5)

            threading.Thread(target=watch, daemon=True, name="pagedllm-dp-watch").start()
            logger.info("data parallel: %d replicas (%s) behind http://%s:%d/v1", count,
                        ", ".join(r.url for r in replicas), ns.host, ns.port)
            server.run()
        finally:
            stop_replicas(replicas)
    return 1 if lost else 0


class RouterServer(uvicorn.Server):
    """SIGTERM / SIGINT end serving without re-raising the signal afterwards (uvicorn's default), so the
    replicas are stopped before this process exits (status 0)."""

    def handle_exit(self, sig, frame) -> None:
        self.should_exit = True


def _replica_main() -> int:
    """`python -m pagedllm.entrypoints.openai.data_parallel SETTINGS`: one replica, a lone server."""
    from pagedllm.entrypoints.cli import run_command
    from pagedllm.entrypoints.openai.api_server import run_server

    ns = pickle.loads(Path(sys.argv[1]).read_bytes())
    return run_command(run_server, ns)


def build_router_app(router: Router) -> FastAPI:
    client = httpx.AsyncClient(timeout=None)

    async def poll() -> None:
        while True:
            for r in router.replicas:
                try:
                    text = (await client.get(f"{r.url}/metrics", timeout=5)).text
                    r.kv_usage = _gauge(text, "pagedllm:kv_cache_usage_perc")
                    r.sent_since_poll = 0
                except httpx.HTTPError:
                    pass
            await asyncio.sleep(POLL_S)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        poller = asyncio.create_task(poll())
        yield
        poller.cancel()
        await client.aclose()

    app = FastAPI(title="pagedllm (data parallel)", lifespan=lifespan)

    @app.get("/health")
    async def health():
        for r in router.replicas:
            try:
                ok = (await client.get(f"{r.url}/health", timeout=5)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                return JSONResponse({"error": {"message": f"replica {r.index} is not healthy", "type": "unavailable",
                                               "code": 503}}, status_code=503)
        return PlainTextResponse("")

    @app.get("/metrics")
    async def metrics():
        parts = []
        for r in router.replicas:
            text = (await client.get(f"{r.url}/metrics", timeout=10)).text
            parts.append(_label_samples(text, f'replica="{r.index}"'))
        return PlainTextResponse("\n".join(parts), media_type="text/plain; version=0.0.4")

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def proxy(path: str, request: Request):
        body = await request.body()
        generation = request.method == "POST" and path.strip("/") in GENERATION_PATHS
        replica = router.choose(prefix_key(body)) if generation else router.replicas[0]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        upstream = client.build_request(request.method, f"{replica.url}/{path}", params=request.query_params,
                                        headers=headers, content=body)
        replica.in_flight += 1
        replica.sent_since_poll += generation
        try:
            response = await client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            replica.in_flight -= 1
            return JSONResponse({"error": {"message": f"data-parallel replica {replica.index} did not answer: {e}",
                                           "type": "unavailable", "param": None, "code": 503}}, status_code=503)

        async def relay():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()
                replica.in_flight -= 1

        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
        out_headers["x-pagedllm-replica"] = str(replica.index)
        return StreamingResponse(relay(), status_code=response.status_code, headers=out_headers)

    return app


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


if __name__ == "__main__":
    sys.exit(_replica_main())
