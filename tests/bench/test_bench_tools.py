"""The benchmark tools compute the right numbers from known inputs (no timing assertions)."""
from __future__ import annotations

import pytest

from pagedllm.bench.roofline import decode_floor
from pagedllm.bench.serve import RequestRecord, compute_metrics, main as serve_main
from pagedllm.bench.throughput import random_requests


def test_serving_metrics_follow_vllm_definitions():
    # Request A: starts at 0, chunks at 0.5, 0.7, 1.0, ends 1.0, 3 output tokens.
    # Request B: starts at 1, chunks at 1.2, 1.3, ends 1.4, 2 output tokens.
    a = RequestRecord(start=0.0, chunk_times=[0.5, 0.7, 1.0], end=1.0, prompt_tokens=10, output_tokens=3)
    b = RequestRecord(start=1.0, chunk_times=[1.2, 1.3], end=1.4, prompt_tokens=6, output_tokens=2)
    failed = RequestRecord(start=0.0, ok=False, error="HTTP 500")
    m = compute_metrics([a, b, failed], duration=2.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx((16 + 5) / 2)
    assert m["mean_ttft_ms"] == pytest.approx((500 + 200) / 2)
    # TPOT = (latency - ttft) / (tokens - 1): A (1.0-0.5)/2 = 250 ms, B (0.4-0.2)/1 = 200 ms
    assert m["mean_tpot_ms"] == pytest.approx(225)
    # ITL = every gap: 200, 300 (A), 100 (B)
    assert m["mean_itl_ms"] == pytest.approx(200) and m["median_itl_ms"] == pytest.approx(200)
    assert m["p99_itl_ms"] == pytest.approx(200 + 0.98 * 100)  # linear interpolation between 200 and 300
    assert m["median_e2e_latency_ms"] == pytest.approx(700)


def test_metrics_with_no_successful_request():
    m = compute_metrics([RequestRecord(start=0.0, ok=False)], duration=1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] is None


def test_decode_floor_picks_the_binding_limit():
    mem = decode_floor(num_params=500, weight_bytes=1000, kv_bytes_per_token=10, batch=1, context=10,
                       bandwidth=100.0, flops_rate=1e6)
    assert mem["bytes"] == 1100 and mem["floor_s"] == pytest.approx(11.0) and mem["bound"] == "memory"
    comp = decode_floor(num_params=500, weight_bytes=1000, kv_bytes_per_token=10, batch=64, context=10,
                        bandwidth=1e9, flops_rate=1000.0)
    assert comp["flops"] == 64000 and comp["floor_s"] == pytest.approx(64.0) and comp["bound"] == "compute"


def test_random_dataset_lengths_and_determinism():
    a = random_requests(20, 100, 50, 0.5, vocab_size=1000, seed=3)
    b = random_requests(20, 100, 50, 0.5, vocab_size=1000, seed=3)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(50 <= len(r.prompt_token_ids) <= 150 and 25 <= r.output_len <= 75 for r in a)
    assert all(10 <= t < 1000 for r in a for t in r.prompt_token_ids)
    assert len({len(r.prompt_token_ids) for r in a}) > 1


@pytest.mark.parametrize("argv, match", [
    (["--num-prompts", "0"], "num-prompts"),
    (["--max-concurrency", "0"], "max-concurrency"),
    (["--request-rate", "0"], "request-rate"),
])
def test_bench_serve_refuses_bad_arguments(argv, match):
    with pytest.raises(ValueError, match=match):
        serve_main(argv)
