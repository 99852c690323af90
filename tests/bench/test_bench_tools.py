"""The benchmark tools compute the right numbers from known inputs (no timing assertions)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.bench.roofline import decode_floor
from pagedllm.bench.serve import RequestRecord, compute_metrics
from pagedllm.bench.serve import main as serve_main
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


def test_sweep_roofline_is_prefill_floor_plus_decode_floors():
    from pagedllm.bench.sweep import roofline_tokens_per_s

    # Memory-bound everywhere: prefill reads the weights once (10 s), each decode step reads
    # weights + batch * mid-context * kv bytes = 1000 + 2 * 15 * 10 = 1300 bytes (13 s).
    tps = roofline_tokens_per_s(batch=2, input_len=10, output_len=10, num_params=1, weight_bytes=1000,
                                kv_bytes_per_token=10, bandwidth=100.0, flops_rate=1e12)
    assert tps == pytest.approx(2 * 10 / (10 + 10 * 13))
    # Compute-bound prefill: 2 * params * batch * input_len flops.
    tps = roofline_tokens_per_s(batch=4, input_len=8, output_len=1, num_params=1000, weight_bytes=1,
                                kv_bytes_per_token=0, bandwidth=1e12, flops_rate=1000.0)
    assert tps == pytest.approx(4 / (2 * 1000 * 4 * 8 / 1000 + 2 * 1000 * 4 / 1000))


def test_sweep_roofline_of_a_mixture_of_experts_reads_the_chosen_experts():
    """Qwen3-30B-A3B's shape: a batch-1 decode step's floor reads the experts its token chooses (8 of 128), so the
    floor is the active share's, not all 30B parameters'."""
    import json

    from pagedllm.bench.sweep import roofline_tokens_per_s
    from pagedllm.memory.model_size import decode_active_share
    from pagedllm.model_executor.model_files import PRESETS_DIR
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**json.loads((PRESETS_DIR / "qwen3-30b-a3b.json").read_text()))
    shape = dict(input_len=1, output_len=1, num_params=1000, weight_bytes=10**6, kv_bytes_per_token=0,
                 bandwidth=1e6, flops_rate=1e15)  # memory-bound: tokens/s = 1 / (prefill reads + decode reads)
    read_share = decode_active_share(cfg, 1)[0]
    assert 0.05 < read_share < 0.15  # ~3.3B of 30.5B (the untied embedding table, a row per token, not read)
    assert roofline_tokens_per_s(1, **shape, hf_config=cfg) == pytest.approx(1 / (2 * read_share), rel=1e-4)
    assert roofline_tokens_per_s(1, **shape) == pytest.approx(1 / 2)


def test_sweep_reads_llamacpp_jsonl_rows_of_the_same_workload(tmp_path):
    from pagedllm.bench.sweep import read_llamacpp_jsonl

    f = tmp_path / "bb.jsonl"
    f.write_text('{"pp": 128, "tg": 128, "pl": 1, "t": 4.0}\n{"pp": 128, "tg": 128, "pl": 64, "t": 64.0}\n'
                 '{"pp": 512, "tg": 128, "pl": 8, "t": 1.0}\n')
    rows = read_llamacpp_jsonl(str(f), 128, 128)
    assert [(r["batch"], r["output_tokens_per_second"]) for r in rows] == [(1, 32.0), (64, 128.0)]
    with pytest.raises(ValueError, match="pp=64"):
        read_llamacpp_jsonl(str(f), 64, 128)


def test_sweep_plot_writes_a_png(tmp_path):
    from pagedllm.bench.sweep import ROOFLINE, plot_sweep

    rows = [{"backend": b, "batch": n, "output_tokens_per_second": v * n}
            for b, v in (("pagedllm", 10.0), ("transformers", 5.0), (ROOFLINE, 20.0)) for n in (1, 4, 16)]
    out = tmp_path / "sweep.png"
    plot_sweep(rows, str(out), "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_random_dataset_shared_prefix():
    reqs = random_requests(5, 8, 4, 0.0, vocab_size=1000, seed=1, prefix_len=16)
    assert all(len(r.prompt_token_ids) == 24 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:16]) for r in reqs}) == 1
    assert len({tuple(r.prompt_token_ids[16:]) for r in reqs}) == 5


def test_roofline_runs_on_a_tiny_model_and_writes_every_field(tmp_path):
    """End to end on a tiny model: one row per batch size, the best step no slower than the median, the
    machine rates sampled (positive), and the GEMM-only time a part of the step it bounds."""
    import json

    from pagedllm.bench.roofline import main as roofline_main
    from tests.helpers import make_tiny_model

    model = make_tiny_model(tmp_path / "m", "llama")
    out = tmp_path / "roofline.json"
    assert roofline_main(["--model", str(model), "--dtype", "float32", "--batch-sizes", "1", "3", "--steps", "3",
                          "--prompt-len", "8", "--bandwidth-bytes", "16MiB", "--matmul-window", "0.01",
                          "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert 0 < r["measured_s"] <= r["median_s"] and r["read_bytes_per_s"] > 0 and r["matmul_flops_per_s"] > 0
        assert r["ratio"] == pytest.approx(r["measured_s"] / r["floor_s"]) and r["matmul_dtype"] == "float32"
        assert 0 < r["gemm_only_s"] and r["flops"] == rows[0]["flops"] * r["batch"]


@pytest.mark.parametrize("overlap", ["--async-output-proc", "--no-async-output-proc"])
def test_bench_host_splits_a_decode_step_into_the_engines_phases(tmp_path, overlap):
    """torch.profiler sees every phase the engine labels: the runner's forward and sampling inside its
    launch, and the phases together no longer than the profiled step."""
    import json

    from pagedllm.bench.host import INNER_PHASES, TOP_PHASES
    from pagedllm.bench.host import main as host_main
    from tests.helpers import make_tiny_model

    model = make_tiny_model(tmp_path / "m", "llama")
    out = tmp_path / "host.json"
    assert host_main(["--model", str(model), "--dtype", "float32", "--device", "cpu", "--batch-sizes", "2",
                      "--steps", "3", "--prompt-len", "8", overlap, "--output-json", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["batch"] == 2 and row["step_s"] > 0
    for name in ("schedule", "launch", "wait", "update", "outputs", *INNER_PHASES):
        assert row[f"{name}_s"] > 0, name
    assert row["forward_s"] + row["sample_s"] <= row["launch_s"]
    assert sum(row[f"{name}_s"] for name in TOP_PHASES) <= row["profiled_step_s"]


def test_timed_decode_steps_run_the_whole_batch_after_a_chunked_prefill(tmp_path):
    """Six 8-token prompts at 16 tokens a step: three prefill steps, the first sequences decoding
    during the later ones. Every timed step still runs all six (checked inside), and the requests are
    gone afterwards; where max_model_len leaves no room for the timed steps, the function says so."""
    from pagedllm import LLM
    from pagedllm.bench.roofline import measure_decode_steps
    from tests.helpers import make_tiny_model

    model = make_tiny_model(tmp_path / "m", "llama")
    llm = LLM(str(model), dtype="float32", max_model_len=40, max_num_batched_tokens=16, max_num_seqs=6)
    samples = []
    times = measure_decode_steps(llm, 6, 8, 4, seed=0, before_each=lambda: samples.append(1))
    assert len(times) == 4 and all(t > 0 for t in times) and len(samples) == 4
    assert not llm.llm_engine.has_unfinished_requests()
    short = LLM(str(model), dtype="float32", max_model_len=12, max_num_batched_tokens=16, max_num_seqs=6)
    with pytest.raises(RuntimeError, match="a timed decode step ran [0-5] sequences, not 6"):
        measure_decode_steps(short, 6, 8, 4, seed=0)


def test_roofline_refuses_bad_arguments():
    from pagedllm.bench.roofline import main as roofline_main

    with pytest.raises(ValueError, match="must be >= 1"):
        roofline_main(["--batch-sizes", "0"])
    with pytest.raises(ValueError, match="--matmul-window must be > 0 seconds, got 0.0"):
        roofline_main(["--matmul-window", "0"])


def test_sustained_rate_counts_every_call_in_the_window():
    """The matmul rate of a roofline sample: calls run back to back until the window has passed, and the
    rate is all their work over all their time (a fake clock that advances 0.03 s per call)."""
    from pagedllm.bench.roofline import sustained_rate

    now, calls = [0.0], []

    def call():
        calls.append(1)
        now[0] += 0.03

    assert sustained_rate(call, 6.0, 0.1, clock=lambda: now[0]) == pytest.approx(4 * 6.0 / 0.12)
    assert len(calls) == 4
    calls.clear()
    assert sustained_rate(call, 6.0, 0.001, clock=lambda: now[0]) == pytest.approx(6.0 / 0.03)  # at least once
    assert len(calls) == 1


@pytest.mark.parametrize("bf16_arithmetic", [True, False])
def test_roofline_matmul_rate_is_sampled_in_the_dtype_the_engine_multiplies_in(bf16_arithmetic, monkeypatch):
    """Without bf16 arithmetic the engine's bf16 products run in fp32 (packed_linear's AVX2 path,
    upcast_linear), and PyTorch's bf16 matmul there is a slow fallback: the rate is then fp32's (the
    sweep's roofline takes the same arithmetic_dtype)."""
    from pagedllm.bench import roofline

    monkeypatch.setattr(roofline, "cpu_has_bf16_arithmetic", lambda: bf16_arithmetic)
    sampler = roofline.MachineSampler(torch.bfloat16, 1 << 20, matmul_size=64, matmul_window_s=0.001)
    assert sampler.matmul_dtype == (torch.bfloat16 if bf16_arithmetic else torch.float32)
    assert sampler.a.dtype == sampler.matmul_dtype == roofline.arithmetic_dtype(torch.bfloat16)
    sampler.sample()
    assert sampler.matmul_rate > 0 and sampler.bandwidth > 0
    assert roofline.MachineSampler(torch.float32, 1 << 20, matmul_size=64).matmul_dtype == torch.float32


def test_transformers_baseline_runs_on_the_engines_device(monkeypatch):
    """`bench throughput --device X` runs transformers on X too: the device resolves as the engine's
    (auto: cuda when there is one) and the batches are built on the model's device (a stub model on the
    meta device records where its inputs were)."""
    from types import SimpleNamespace

    from pagedllm.bench.throughput import BenchRequest, bench_device, run_transformers

    args = SimpleNamespace(device="auto", ignore_eos=True)
    assert bench_device(args) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench_device(args) == torch.device("cuda")
    assert bench_device(SimpleNamespace(device="cpu")) == torch.device("cpu")

    seen = []

    class StubModel:
        device = torch.device("meta")

        def generate(self, input_ids, attention_mask, **kw):
            seen.append((input_ids.device, attention_mask.device, tuple(input_ids.shape)))

    requests = [BenchRequest([1, 2, 3], 4), BenchRequest([5, 6], 4), BenchRequest([7], 2)]
    assert run_transformers(args, requests, 2, StubModel()) >= 0
    assert seen == [(torch.device("meta"), torch.device("meta"), (2, 3)), (torch.device("meta"),) * 2 + ((1, 1),)]


def test_roofline_on_a_gpu_multiplies_bf16_as_bf16():
    from pagedllm.bench.roofline import arithmetic_dtype

    assert arithmetic_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    assert arithmetic_dtype(torch.float16, torch.device("cuda")) == torch.float16


def test_bench_compare_runs_both_engines_offline_and_served(tmp_path, capsys):
    """`bench compare` end to end with a second pagedllm as the peer (this venv's Python; CI has no vLLM): both
    engines run the same offline workload and, their servers up side by side, serve the same load; the report holds
    every run's numbers, medians that are those runs', and ratios computed from the medians."""
    import json
    import sys

    from pagedllm.bench.compare import main as compare_main
    from tests.helpers import make_tiny_model

    model = make_tiny_model(tmp_path / "m", "qwen2")
    out = tmp_path / "report.json"
    assert compare_main(["--model", str(model), "--peer", "pagedllm", "--peer-python", sys.executable,
                         "--peer-env", "PAGEDLLM_TEST_MARK=1", "--runs", "1", "--num-prompts", "3",
                         "--input-len", "6", "--output-len", "5", "--serve", "--concurrency", "2",
                         "--serve-input-len", "6", "--serve-output-len", "4", "--min-prompts", "3",
                         "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["peer_env"] == {"PAGEDLLM_TEST_MARK": "1"}  # (vLLM's CPU settings only for a vLLM peer)
    runs, med = report["offline"]["runs"], report["offline"]["medians"]
    assert set(runs) == {"peer-pagedllm", "pagedllm"} and all(len(r) == 1 for r in runs.values())
    for label, rows in runs.items():
        assert med[label] == rows[0] and rows[0]["W_tok_s"] > 0 and rows[0]["batch1_ms"] > 0
    ratios = report["offline"]["ratios"]
    assert ratios["W"] == pytest.approx(med["pagedllm"]["W_tok_s"] / med["peer-pagedllm"]["W_tok_s"])
    assert ratios["batch1_speed"] == pytest.approx(med["peer-pagedllm"]["batch1_ms"] / med["pagedllm"]["batch1_ms"])
    for label in runs:
        (row,) = report["serving"][label]
        assert row["concurrency"] == 2 and row["num_prompts"] == 8 and row["output_tok_s"] > 0
        assert row["median_ttft_ms"] > 0 and row["median_tpot_ms"] > 0
        assert row["runs"] == [{k: row[k] for k in ("output_tok_s", "median_ttft_ms", "median_tpot_ms",
                                                    "p99_tpot_ms")}]  # (one run: its own median)
    printed = capsys.readouterr().out
    assert "W output tok/s (median)" in printed and "median TPOT ms" in printed


@pytest.mark.parametrize("argv, match", [
    (["--runs", "0"], "--runs must be >= 1"),
    (["--concurrency", "0"], "--concurrency values must be >= 1"),
    (["--no-offline"], "leaves nothing to run"),
    (["--peer-env", "NOEQUALS"], "use KEY=VALUE"),
])
def test_bench_compare_refuses_bad_arguments(argv, match, capsys):
    import sys

    from pagedllm.bench.compare import main as compare_main

    with pytest.raises(SystemExit):
        compare_main(["--peer-python", sys.executable, *argv])
    assert match in capsys.readouterr().err


def test_bench_compare_gives_both_servers_the_kv_cache_of_their_longest_sequences(tmp_path):
    """Whole GiB, rounded up, holding --concurrency sequences of input + output (+16) tokens with a quarter more:
    Qwen3-0.6B's bf16 KV is 2 x 28 layers x 8 heads x 128 x 2 bytes = 114,688 bytes a token."""
    import argparse

    from pagedllm.bench.compare import model_folder, serving_kv_gib

    folder = model_folder("qwen3-0.6b", tmp_path)
    args = argparse.Namespace(concurrency=[1, 8, 32], serve_input_len=256, serve_output_len=128)
    assert 114_688 * 32 * 400 * 5 / 4 / 2**30 == pytest.approx(1.709, abs=1e-3)
    assert serving_kv_gib(folder, args) == 2
    args.concurrency = [1]
    assert serving_kv_gib(folder, args) == 1
