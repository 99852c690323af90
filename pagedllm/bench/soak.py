"""`pagedllm bench soak`: minutes of mixed traffic against a running server, as production sends it.

Clients (threads) send completions and chat, streamed or not (and speech when the server documents
/v1/audio/speech); a share of the streams is abandoned after a few chunks, a share of the requests is
malformed (bad JSON, wrong types, unknown model), a share is an oversize body (announced by its
Content-Length, only its first bytes sent), and a share is abusive but cheap to send (issue 35's kinds: a
looping request chat template, a schema over the structured-output limits, a long stop list, a wide prompts x n,
a body that stalls, a non-streamed request whose client leaves at once). Per minute: requests served, errors by kind, p50/p99 latency of
the well-formed requests that ran to the end, the server's resident memory (its /metrics), and at the end the
KV blocks in use once idle (/v1/memory). A 5xx other than 503 counts as an error of the server."""
from __future__ import annotations

import argparse
import json
import logging
import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from urllib.parse import urlparse

MALFORMED = [
    b'{"prompt": "hi",',  # truncated JSON
    b'{"prompt": "hi", "max_tokens": "ten"}',  # wrong type
    b'{"prompt": "hi", "temperature": -1}',  # out of range
    b'{"model": "no-such-model", "prompt": "hi"}',  # unknown model
    b'{"prompt": [1.0, true]}',  # token ids that are not integers
]


LOOPING_TEMPLATE = "{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}hello"
ABUSIVE_KINDS = ("template", "schema", "stop-list", "wide-n", "slow-body", "dropped")


def abusive_body(kind: str, model: str) -> tuple[str, dict]:
    """(path, JSON body) of an abusive request the server must refuse at once (or bound: the template)."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    if kind == "template":
        return "/v1/chat/completions", {**chat, "chat_template": LOOPING_TEMPLATE}
    if kind == "schema":
        schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20_000)}}
        return "/v1/chat/completions", {**chat, "response_format": {"type": "json_schema",
                                                                    "json_schema": {"name": "big", "schema": schema}}}
    if kind == "stop-list":
        return "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4,
                                   "stop": [f"stop-{i}" for i in range(10_000)]}
    if kind == "wide-n":
        return "/v1/completions", {"model": model, "prompt": ["hi"] * 400, "n": 256, "max_tokens": 4}
    raise ValueError(kind)


@dataclass
class Outcome:
    end: float  # seconds since the start of the run
    kind: str  # completion, completion-stream, chat, chat-stream, speech, abort, malformed, oversize
    status: int | str  # HTTP status, or the exception's class name
    latency: float | None  # seconds, for requests that ran to the end


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


class Soak:
    def __init__(self, args) -> None:
        import httpx

        self.args = args
        self.base = args.base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        with httpx.Client(base_url=self.base, headers=self.headers, timeout=30) as c:
            self.model = args.model or c.get("/v1/models").json()["data"][0]["id"]
            self.speech = "/v1/audio/speech" in c.get("/openapi.json").json().get("paths", {})
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.start = time.monotonic()
        self.deadline = self.start + args.minutes * args.window_seconds

    def record(self, kind: str, status, latency: float | None = None) -> None:
        with self.lock:
            self.outcomes.append(Outcome(time.monotonic() - self.start, kind, status, latency))

    def worker(self, seed: int) -> None:
        import httpx

        rng = random.Random(seed)
        with httpx.Client(base_url=self.base, headers=self.headers, timeout=self.args.request_timeout) as c:
            while time.monotonic() < self.deadline:
                roll = rng.random()
                try:
                    if roll < self.args.oversize_fraction:
                        self.oversize()
                    elif roll < self.args.oversize_fraction + self.args.malformed_fraction:
                        r = c.post("/v1/completions", content=rng.choice(MALFORMED),
                                   headers={"content-type": "application/json"})
                        self.record("malformed", r.status_code)
                    elif roll < (self.args.oversize_fraction + self.args.malformed_fraction
                                 + self.args.abusive_fraction):
                        self.abusive(c, rng.choice(self.args.abusive_kinds))
                    else:
                        self.well_formed(c, rng)
                except httpx.HTTPError as e:
                    self.record("transport", type(e).__name__)

    def well_formed(self, c, rng: random.Random) -> None:
        chat = rng.random() < 0.5
        stream = rng.random() < 0.5
        abort = stream and rng.random() < self.args.abort_fraction / 0.5
        if self.speech and rng.random() < 0.2:
            t = time.monotonic()
            r = c.post("/v1/audio/speech", json={"model": self.model, "input": "hello there", "max_tokens": 16})
            self.record("speech", r.status_code, time.monotonic() - t if r.status_code == 200 else None)
            return
        words = " ".join(rng.choice(("the", "cat", "sat", "on", "a", "mat", "and", "then")) for _ in range(
            rng.randint(4, self.args.prompt_words)))
        body = {"model": self.model, "max_tokens": rng.randint(4, self.args.max_tokens), "stream": stream,
                "temperature": rng.choice((0.0, 0.7, 1.0))}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body |= {"messages": [{"role": "user", "content": words}]} if chat else {"prompt": words}
        kind = ("chat" if chat else "completion") + ("-stream" if stream else "")
        t = time.monotonic()
        if not stream:
            r = c.post(path, json=body)
            self.record(kind, r.status_code, time.monotonic() - t if r.status_code == 200 else None)
            return
        with c.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                self.record(kind, r.status_code)
                return
            events, errors = 0, 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    errors += '"error"' in line
                    if abort and events >= 2:
                        break  # the client leaves mid-stream
        if abort:
            self.record("abort", 200)
        else:
            self.record(kind, "stream-error" if errors else 200, None if errors else time.monotonic() - t)

    def abusive(self, c, kind: str) -> None:
        import httpx

        if kind == "slow-body":
            self.record(kind, self.slow_body())
        elif kind == "dropped":  # a non-streamed request whose client leaves before the answer
            try:
                c.post("/v1/completions", timeout=0.2, json={"model": self.model, "prompt": "the cat",
                                                             "max_tokens": self.args.max_tokens, "ignore_eos": True})
                self.record(kind, "answered")
            except httpx.TimeoutException:
                self.record(kind, "dropped")
        else:
            path, body = abusive_body(kind, self.model)
            self.record(kind, c.post(path, json=body).status_code)

    def _raw(self, head: str, first_bytes: bytes) -> int:
        """Send a request's head and its first body bytes, then nothing: the status the server answers."""
        u = urlparse(self.base)
        with socket.create_connection((u.hostname, u.port or 80), timeout=self.args.request_timeout) as s:
            s.sendall(head.encode())
            try:
                s.sendall(first_bytes)
            except OSError:
                pass
            return int(s.recv(64).split(b" ", 2)[1].decode())

    def _head(self, length: int) -> str:
        u = urlparse(self.base)
        auth = f"Authorization: {self.headers['Authorization']}\r\n" if self.headers else ""
        return (f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
                f"{auth}Content-Length: {length}\r\nConnection: close\r\n\r\n")

    def slow_body(self) -> int:
        """A body that stops after its first bytes: the server answers 408 at its --body-timeout."""
        return self._raw(self._head(1000), b'{"prompt": "hi", ')

    def oversize(self) -> None:
        """An announced body over the server's limit; only its first 64 KiB are sent."""
        self.record("oversize", self._raw(self._head(self.args.oversize_bytes), b"{" + b" " * 65535))

    def server_rss(self) -> float | None:
        import httpx

        try:
            for line in httpx.get(f"{self.base}/metrics", timeout=10).text.splitlines():
                if line.startswith("process_resident_memory_bytes "):
                    return float(line.split()[1])
        except httpx.HTTPError:
            return None
        return None

    def idle_kv_blocks(self) -> dict:
        """Wait (bounded) for the engine to hold no request, then what its KV cache holds."""
        import httpx

        with httpx.Client(base_url=self.base, headers=self.headers, timeout=30) as c:
            for _ in range(300):
                mem = c.get("/v1/memory").json()
                if not mem["requests"] and mem["num_waiting"] == 0:
                    break
                time.sleep(0.1)
            usage = mem["kv_cache_usage"]
            return {"blocks_used": usage["blocks_used"], "blocks_total": usage["blocks_total"],
                    "requests": len(mem["requests"]), "num_waiting": mem["num_waiting"]}


def _served(o: Outcome) -> bool:
    """Answered as it should be: 200, a 4xx for a deliberately bad or abusive request, a dropped request left."""
    if o.kind == "dropped":
        return o.status in ("dropped", "answered")
    return o.status == 200 or (o.kind in ("malformed", "oversize", *ABUSIVE_KINDS) and isinstance(o.status, int)
                               and 400 <= o.status < 500)


def summarize(outcomes: list[Outcome], minutes: int, rss: dict[int, float | None], window_s: float = 60.0,
              first: int = 0) -> list[dict]:
    """One row per window from `first` to `minutes` - 1 (one pass over the outcomes)."""
    rows = []
    by_window: dict[int, list[Outcome]] = {}
    for o in outcomes:
        by_window.setdefault(int(o.end // window_s), []).append(o)
    for m in range(first, minutes):
        window = by_window.get(m, [])
        ok = [o for o in window if _served(o)]
        errors = Counter(f"{o.kind}:{o.status}" for o in window if not _served(o))
        latencies = [o.latency for o in window if o.latency is not None]
        rows.append({"minute": m + 1, "requests": len(window), "served": len(ok),
                     "server_errors": sum(1 for o in window if isinstance(o.status, int) and o.status >= 500
                                          and o.status != 503),
                     "errors": dict(errors), "by_kind": dict(Counter(o.kind for o in window)),
                     "p50_s": _percentile(latencies, 0.5), "p99_s": _percentile(latencies, 0.99),
                     "rss_bytes": rss.get(m + 1)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedllm bench soak")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    p.add_argument("--minutes", type=int, default=10)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--abort-fraction", type=float, default=0.10, help="share of requests abandoned mid-stream")
    p.add_argument("--malformed-fraction", type=float, default=0.05)
    p.add_argument("--oversize-fraction", type=float, default=0.01)
    p.add_argument("--oversize-bytes", type=int, default=50_000_000)
    p.add_argument("--abusive-fraction", type=float, default=0.05,
                   help="share of abusive requests, spread over --abusive-kinds")
    p.add_argument("--abusive-kinds", type=lambda v: v.split(","), default=list(ABUSIVE_KINDS),
                   help=f"comma-separated, of {','.join(ABUSIVE_KINDS)} (a slow body holds its client until the "
                        f"server's --body-timeout)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window-seconds", type=float, default=60.0, help="length of a report row (a 'minute')")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if args.minutes < 1 or args.concurrency < 1 or not args.window_seconds > 0:
        raise ValueError("--minutes, --concurrency and --window-seconds must be >= 1, >= 1 and > 0")
    unknown = set(args.abusive_kinds) - set(ABUSIVE_KINDS)
    if unknown:
        raise ValueError(f"--abusive-kinds: unknown {sorted(unknown)}; the kinds are {', '.join(ABUSIVE_KINDS)}")

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    soak = Soak(args)
    threads = [threading.Thread(target=soak.worker, args=(args.seed + k,), daemon=True)
               for k in range(args.concurrency)]
    for t in threads:
        t.start()
    rss: dict[int, float | None] = {}
    print(f"soak: {args.minutes} min, {args.concurrency} clients, model {soak.model}"
          f"{', speech too' if soak.speech else ''}", flush=True)
    for minute in range(1, args.minutes + 1):
        time.sleep(max(0.0, soak.start + minute * args.window_seconds - time.monotonic()))
        rss[minute] = soak.server_rss()
        with soak.lock:
            recent = [o for o in soak.outcomes[-100_000:] if o.end >= (minute - 1) * args.window_seconds]
        row = summarize(recent, minute, rss, args.window_seconds, first=minute - 1)[-1]
        print(f"minute {minute:>3}: {row['requests']:>6} requests, {row['served']:>6} served, 5xx "
              f"{row['server_errors']}, errors {row['errors'] or '-'}, p50 "
              f"{(row['p50_s'] or 0) * 1000:.0f} ms, p99 {(row['p99_s'] or 0) * 1000:.0f} ms, rss "
              f"{(row['rss_bytes'] or 0) / 2**30:.2f} GiB", flush=True)
    for t in threads:
        t.join(timeout=args.request_timeout + 10)
    rows = summarize(soak.outcomes, args.minutes, rss, args.window_seconds)
    idle = soak.idle_kv_blocks()
    after_warmup = [r["rss_bytes"] for r in rows[5:] if r["rss_bytes"]] if args.minutes > 5 else []
    drift = (max(after_warmup) - min(after_warmup)) / min(after_warmup) if len(after_warmup) > 1 else None
    total = {"requests": len(soak.outcomes), "server_errors": sum(r["server_errors"] for r in rows),
             "kv_when_idle": idle, "rss_drift_after_5_min": drift,
             "by_kind": dict(Counter(o.kind for o in soak.outcomes))}
    print(f"total: {total['requests']} requests, {total['server_errors']} server errors (5xx other than 503), KV "
          f"blocks in use when idle {idle['blocks_used']} of {idle['blocks_total']}, resident memory drift after "
          f"minute 5: {'-' if drift is None else f'{100 * drift:.1f}%'}; by kind {total['by_kind']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"settings": vars(args), "minutes": rows, "total": total}, f, indent=2)
    return 0 if total["server_errors"] == 0 and idle["blocks_used"] == 0 else 1
