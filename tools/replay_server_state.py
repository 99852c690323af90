"""Replay one fixed traffic against `pagedllm serve` from two source trees and compare what /metrics and
/v1/memory say afterwards (a refactor must not change them).

    python tools/replay_server_state.py MODEL_DIR OLD_TREE NEW_TREE [-- serve flags]

Each tree is a checkout of pagedllm (its `pagedllm/` is put first on PYTHONPATH). The traffic is sequential and
greedy, so every count is deterministic: completions, a streamed chat, a prefix-cache hit, a stop string, n=2.
Values that are times or measured by the process (latency histograms' buckets and sums, process_* series,
measured memory) are shown but not compared; everything else must be equal."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

TIMED = re.compile(r"(_seconds(_bucket|_sum)|^process_|^python_|_created)")
# /v1/memory values read from the machine at start-up (memory in use, page cache), measured by a profiling run,
# or computed from those (the KV budget is what the machine had free)
MEASURED_PLAN_KEYS = ("measured", "other_processes", "free", "available", "peak", "rss", "time", "device_used",
                      "page_cache", "overhead", "kv_cache_budget")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read()


def traffic(base: str, model: str) -> None:
    prompt = "The quick brown fox jumps over the lazy dog and then"
    for k in range(4):
        _post(f"{base}/v1/completions", {"model": model, "prompt": f"{prompt} {k}", "max_tokens": 12,
                                         "temperature": 0})
    _post(f"{base}/v1/completions", {"model": model, "prompt": f"{prompt} 0", "max_tokens": 12, "temperature": 0})
    _post(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8, "n": 2, "seed": 1})
    _post(f"{base}/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hello"}],
                                          "max_tokens": 10, "temperature": 0, "stream": True,
                                          "stream_options": {"include_usage": True}})
    _post(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                                     "stop": ["e"]})


def _metrics(text: str) -> dict[str, str]:
    series = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            series[name] = value
    return series


def _flatten(obj, prefix: str = "") -> dict[str, object]:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flatten(val, f"{prefix}{key}.").items()}
    if isinstance(obj, list):
        return {k: v for i, val in enumerate(obj) for k, v in _flatten(val, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): obj}


def state_after_traffic(tree: str, model: str, flags: list[str]) -> tuple[dict, dict]:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port", str(port), *flags]
    server = subprocess.Popen(cmd, env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                _get(f"{base}/health")
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{tree}: the server did not start: {server.stderr.read().decode()[-2000:]}")
                time.sleep(0.5)
        name = json.loads(_get(f"{base}/v1/models"))["data"][0]["id"]
        traffic(base, name)
        return _metrics(_get(f"{base}/metrics").decode()), _flatten(json.loads(_get(f"{base}/v1/memory")))
    finally:
        server.terminate()
        server.wait(60)


def compare(kind: str, old: dict, new: dict, skip) -> int:
    differ = 0
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "(absent)"), new.get(key, "(absent)")
        if a == b:
            continue
        compared = not skip(key)
        differ += compared
        print(f"{'DIFFERS' if compared else 'timed  '} {kind} {key}: {a} -> {b}")
    print(f"{kind}: {len(set(old) | set(new))} values, {differ} differ (not counting times and measurements)")
    return differ


def main() -> None:
    args = sys.argv[1:]
    flags = args[args.index("--") + 1:] if "--" in args else []
    model, old_tree, new_tree = args[:3]
    old_metrics, old_memory = state_after_traffic(old_tree, model, flags)
    new_metrics, new_memory = state_after_traffic(new_tree, model, flags)
    differ = compare("/metrics", old_metrics, new_metrics, lambda k: bool(TIMED.search(k.split("{")[0])))
    differ += compare("/v1/memory", old_memory, new_memory,
                      lambda k: any(word in k for word in MEASURED_PLAN_KEYS))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
