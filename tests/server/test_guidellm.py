"""guidellm (a third-party load tool for OpenAI servers, pinned in the test extras) against the demo model as
`pagedllm serve` runs it: its default request settings (chat completions, streamed, `stream_options` with
`include_usage` and `continuous_usage_stats`, `max_completion_tokens`, `ignore_eos`), 8 concurrent streams for
10 seconds. Every request must succeed, and the token counts it reads from the streamed usage must be exact."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import matplotlib.image

from tests.server.conftest import kv_idle, wait_until

# Short requests, so that each stream finishes several in a short run even while the other test worker loads the
# machine (32-token requests beside a busy worker: 32 in all, 4 a stream; the assertions need 3 a stream).
SECONDS = 10
STREAMS = 8
OUTPUT_TOKENS = 16
MIN_PER_STREAM = 3


def test_guidellm_runs_10_seconds_at_concurrency_8_without_an_error(demo_server, tmp_path):
    model = httpx.get(f"{demo_server.url}/v1/models", timeout=10).json()["data"][0]
    assert model["id"] == "pagedllm-demo"  # what guidellm takes as its tokenizer's name
    report = tmp_path / "guidellm.json"
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={demo_server.url}",
           "--profile", f"kind=concurrent,streams={STREAMS}",
           "--constraint", f"kind=max_duration,seconds={SECONDS}",
           "--data", f"kind=synthetic_text,prompt_tokens=256,output_tokens={OUTPUT_TOKENS}",
           "--output", f"kind=json,path={report}", "--disable-progress"]
    # No --tokenizer: guidellm loads the served name ("pagedllm-demo") as a tokenizer, which the demo build copied
    # into the Hugging Face cache; offline, as this machine is.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=SECONDS + 240, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    (bench,) = json.loads(report.read_text())["benchmarks"]
    made = bench["scheduler_metrics"]["requests_made"]
    assert made["errored"] == 0 and bench["metrics"]["request_totals"]["errored"] == 0, made
    assert made["successful"] >= MIN_PER_STREAM * STREAMS, made  # each stream finished requests, over and over
    # Cut off at the run's end: those in flight and those guidellm had queued (8-12 seen); a stalled stream
    # would leave its requests here.
    assert made["incomplete"] <= 2 * STREAMS, made
    tokens = bench["metrics"]["output_token_count"]["successful"]
    assert tokens["count"] == made["successful"] and tokens["total_sum"] == OUTPUT_TOKENS * made["successful"]

    with httpx.Client(base_url=demo_server.url, timeout=30) as http:
        wait_until(lambda: kv_idle(http), "an idle engine after guidellm")
    log = "".join(p.read_text(errors="replace") for p in demo_server.log_dir.iterdir())
    assert "Traceback" not in log


def test_bench_serve_beside_it_chat_and_completions_with_prompts_of_the_asked_length(demo_server, tmp_path):
    """`pagedllm bench serve`, the figures docs/benchmarks.md sets beside guidellm's: no failure; completions
    send the random ids themselves, chat sends them as the server detokenizes them (so about the asked length,
    not 4 tokens per id); a repeated --seed repeats the prompts and reports the prefix cache's hits."""
    from pagedllm.bench.serve import main as bench_serve

    def run(endpoint: str, seed: int, *extra: str) -> dict:
        out = tmp_path / f"{endpoint.strip('/').replace('/', '-')}-{seed}.json"
        code = bench_serve(["--base-url", demo_server.url, "--endpoint", endpoint, "--num-prompts", "8",
                            "--random-input-len", "64", "--random-output-len", "8", "--max-concurrency", "4",
                            "--ignore-eos", "--seed", str(seed), "--output-json", str(out), *extra])
        assert code == 0
        return json.loads(out.read_text())["metrics"]

    completions = run("/v1/completions", 1, "--plot", str(tmp_path / "run.png"))
    height, width = matplotlib.image.imread(tmp_path / "run.png").shape[:2]  # the run's picture decodes
    assert width > 800 and height > 300
    assert completions["completed"] == 8 and completions["failed"] == 0
    assert completions["total_input_tokens"] == 8 * 64 and completions["total_output_tokens"] == 8 * 8
    assert completions["prefix_cache_hits"] == 0
    chat = run("/v1/chat/completions", 2)
    assert chat["completed"] == 8 and chat["total_output_tokens"] == 8 * 8
    assert 8 * 64 <= chat["total_input_tokens"] <= 8 * 64 * 2.5, chat  # ids re-tokenized, plus the template
    again = run("/v1/completions", 1)
    assert again["prefix_cache_hits"] >= 8 * 48, again  # the same prompts: their full blocks come from the cache
