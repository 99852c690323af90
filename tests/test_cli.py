"""The `pagedllm` command as a user runs it (a real subprocess)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedllm import LLM, SamplingParams


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm", *args], check=False, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_generate_prints_the_greedy_completion(tiny_models):
    model = str(tiny_models["qwen3"])
    res = run_cli("generate", "--model", model, "--dtype", "float32", "--max-model-len", "64",
                  "--max-tokens", "8", "--ignore-eos", "Once upon")
    assert res.returncode == 0, res.stderr
    expected = LLM(model, dtype="float32", max_model_len=64).generate(
        "Once upon", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    assert res.stdout.rstrip("\n") == expected
    assert "memory plan" in res.stderr and "KV cache" in res.stderr


def test_generate_reports_bad_input_without_a_traceback(tiny_models):
    res = run_cli("generate", "--model", str(tiny_models["qwen3"]), "--temperature", "-1", "hi")
    assert res.returncode == 2
    assert "temperature must be" in res.stderr and "Traceback" not in res.stderr
    res = run_cli("generate", "--model", "/no/such/model", "hi", env={"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 2 and "/no/such/model" in res.stderr


@pytest.mark.parametrize("model", ["../no-such-dir/qwen2.5-0.5b.json", "./nowhere", "~/x/y/z"])
def test_a_model_path_that_does_not_exist_says_so_and_names_the_presets(model):
    """Not a hub-name error ("Repo id must be in the form ..."), whether or not downloads are allowed."""
    res = run_cli("generate", "--model", model, "--load-format", "dummy", "x", env={"HF_HUB_OFFLINE": "0"})
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"no such file or folder: {model}" in res.stderr and "Repo id" not in res.stderr
    assert "qwen2.5-0.5b" in res.stderr and "llama-3.1-8b" in res.stderr


def test_bench_throughput_writes_json(tiny_models, tmp_path):
    out = tmp_path / "bench.json"
    res = run_cli("bench", "throughput", "--model", str(tiny_models["llama"]), "--dtype", "float32",
                  "--num-prompts", "6", "--input-len", "12", "--output-len", "5", "--ignore-eos",
                  "--backend", "pagedllm", "--backend", "pagedllm-json", "--backend", "transformers",
                  "--hf-batch-size", "2", "6", "--max-model-len", "64", "--output-json", str(out))
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert [r["backend"] for r in data["results"]] == ["pagedllm", "pagedllm-json", "transformers", "transformers"]
    assert [r["hf_batch_size"] for r in data["results"]] == [None, None, 2, 6]
    assert "pagedllm / pagedllm-json" in res.stdout
    for r in data["results"]:
        assert r["output_tokens_per_second"] > 0
        assert r["requests_per_second"] * r["elapsed_s"] == pytest.approx(6)
    assert data["settings"]["output_tokens"] == 30


def test_bench_sweep_runs_each_batch_size_and_plots(tiny_models, tmp_path):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    res = run_cli("bench", "sweep", "--model", str(tiny_models["llama"]), "--dtype", "float32",
                  "--batch-sizes", "1", "3", "--input-len", "8", "--output-len", "4", "--max-model-len", "64",
                  "--backend", "pagedllm", "--backend", "transformers", "--bandwidth-bytes", "16MiB",
                  "--output-json", str(out), "--plot", str(png))
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["settings"]["matmul_dtype"] == "float32"
    assert sorted((r["backend"], r["batch"]) for r in rows if "elapsed_s" in r) == [
        ("pagedllm", 1), ("pagedllm", 3), ("transformers", 1), ("transformers", 3)]
    for r in rows:
        if "elapsed_s" in r:
            assert r["output_tokens_per_second"] == pytest.approx(r["batch"] * 4 / r["elapsed_s"])
    assert sum("roofline" in r["backend"] for r in rows) == 2
    assert png.read_bytes()[:4] == b"\x89PNG"
    res = run_cli("bench", "sweep", "--model", str(tiny_models["llama"]), "--batch-sizes", "0")
    assert res.returncode == 2 and "batch-sizes" in res.stderr
