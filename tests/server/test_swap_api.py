"""Swap preemption through a real server: --swap-space and --preemption-mode are accepted, a pool too
small for the concurrent requests makes them swap, and /metrics and /v1/memory show it."""
from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import (
    AUTH,
    _start_server,
    _stop_server,
    kv_idle,
    metric,
    metric_samples,
    wait_until,
)

# 8 blocks of 16 hold one sequence of max_model_len 128; four requests of 100 tokens need 28.
FLAGS = ["--swap-space", "0.001", "--preemption-mode", "swap", "--num-gpu-blocks-override", "8",
         "--scheduling-policy", "priority"]
SWAP_METRICS = ("pagedllm:num_requests_swapped", "pagedllm:swap_usage_perc", "pagedllm:swapped_out_blocks_total",
                "pagedllm:swapped_in_blocks_total", "pagedllm:num_preemptions_total")


@pytest.fixture(scope="module")
def swap_server(tiny_llama, tmp_path_factory) -> Iterator[str]:
    proc, url, _ = _start_server(tiny_llama, tmp_path_factory.mktemp("swap-server"), FLAGS)
    try:
        yield url
    finally:
        _stop_server(proc)


def complete(url: str, first: int) -> dict:
    body = {"model": "tiny", "prompt": list(range(first, first + 40)), "max_tokens": 60, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_requests_swap_and_the_metrics_show_it(swap_server):
    names = {n for n, _, _ in metric_samples(swap_server)}
    assert set(SWAP_METRICS) <= names
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda k: complete(swap_server, 10 + 50 * k), range(4)))
    assert all(o["usage"]["completion_tokens"] == 60 for o in outs)
    alone = complete(swap_server, 10)  # no preemption: the same greedy text
    assert alone["choices"][0]["text"] == outs[0]["choices"][0]["text"]

    def swapped() -> bool:
        out = metric(swap_server, "pagedllm:swapped_out_blocks_total")
        back = metric(swap_server, "pagedllm:swapped_in_blocks_total")  # fewer: prefix-cache hits are not copied
        return 0 < back <= out and metric(swap_server, "pagedllm:num_preemptions_total", mode="swap") > 0

    wait_until(swapped, "swap counters after the step that answered")
    assert metric(swap_server, "pagedllm:num_preemptions_total", mode="recompute") == 0
    with httpx.Client(base_url=swap_server, headers=AUTH, timeout=60) as http:
        mem = wait_until(lambda: kv_idle(http), "an idle engine")
    assert mem["num_swapped"] == 0 and mem["swap_usage"]["blocks_used"] == 0
    assert mem["swap_usage"]["blocks_total"] == mem["num_swap_blocks"] > 0
    assert metric(swap_server, "pagedllm:swap_usage_perc") == 0.0
    assert metric(swap_server, "pagedllm:num_requests_swapped") == 0.0


def test_shared_server_exports_the_swap_metrics_at_zero(server_url):
    samples = metric_samples(server_url)
    assert set(SWAP_METRICS) <= {n for n, _, _ in samples}
    assert {lab["mode"] for n, lab, _ in samples if n == "pagedllm:num_preemptions_total"} == {"swap", "recompute"}
    assert metric(server_url, "pagedllm:swapped_out_blocks_total") == 0.0


def test_priority_is_honoured_only_under_the_priority_policy(server_url, swap_server):
    """As vLLM: a client's priority counts only on a server started with --scheduling-policy priority; under the
    default (fcfs) a priority other than 0 is a 400 naming the flag, so no client can jump the queue."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "priority": 3}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -1}
    with httpx.Client(base_url=swap_server, timeout=60) as http:
        assert http.post("/v1/completions", json=body).status_code == 200
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        assert http.post("/v1/completions", json={**body, "priority": "high"}).status_code == 400
        assert http.post("/v1/completions", json={**body, "priority": -1e30}).status_code == 400
    with httpx.Client(base_url=server_url, headers=AUTH, timeout=60) as http:
        for path, payload in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            r = http.post(path, json=payload)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "priority" and "--scheduling-policy priority" in r.text
        assert http.post("/v1/completions", json={**body, "priority": 0}).status_code == 200
