"""Prefix caching through the server: the two Prometheus counters and the `cache_salt` field."""
from __future__ import annotations

from tests.server.conftest import kv_idle, metric, metric_samples, wait_until

PROMPT = list(range(10, 50))  # 40 token ids: two full blocks of 16 can come from the cache
COUNTERS = ("pagedllm:prefix_cache_queries_total", "pagedllm:prefix_cache_hits_total")


def counters(server_url: str) -> tuple[float, float]:
    return metric(server_url, COUNTERS[0]), metric(server_url, COUNTERS[1])


def complete(http, **extra) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_metrics_count_prefix_cache_queries_and_hits_by_salt(server_url, http):
    names = {n for n, _, _ in metric_samples(server_url)}
    assert set(COUNTERS) <= names
    wait_until(lambda: kv_idle(http), "an idle engine")  # nothing else adds to the counters meanwhile
    q0, h0 = counters(server_url)
    first = complete(http, cache_salt="tenant-a")  # a salt nobody used: a miss
    wait_until(lambda: counters(server_url) == (q0 + 40, h0), "a lookup without a hit")

    # The same salt hits the first request's two full blocks; another salt hits nothing.
    again = complete(http, cache_salt="tenant-a")
    wait_until(lambda: counters(server_url) == (q0 + 80, h0 + 32), "a 32-token hit")
    other = complete(http, cache_salt="tenant-b")
    wait_until(lambda: counters(server_url) == (q0 + 120, h0 + 32), "a lookup without a hit")
    assert first["choices"][0]["text"] == again["choices"][0]["text"] == other["choices"][0]["text"]
    mem = wait_until(lambda: kv_idle(http), "an idle engine")
    assert mem["kv_cache_usage"]["blocks_cached"] >= 4  # two salts x two full blocks, freed but kept


def test_chat_accepts_cache_salt_and_an_empty_salt_is_refused(http):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "cache_salt": "s"}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "cache_salt": ""})
    assert r.status_code == 400 and "cache_salt" in r.text
