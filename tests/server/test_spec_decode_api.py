"""Speculative decoding through a real server: --speculative-config as vLLM spells it, greedy completions equal
to the engine's without speculation, the spec_decode counters on /metrics; a bad config refused at start with
what is allowed."""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from tests.server.conftest import MAX_MODEL_LEN, _start_server, _stop_server, metric, wait_until

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive": False}
PROMPT = [7, 8, 9, 10] * 8


@pytest.fixture(scope="module")
def spec_server(tiny_llama, tmp_path_factory) -> Iterator[str]:
    proc, url, _ = _start_server(tiny_llama, tmp_path_factory.mktemp("spec-server"),
                                 ["--speculative-config", json.dumps(SPEC)])
    try:
        yield url
    finally:
        _stop_server(proc)


def test_greedy_completions_equal_no_speculation_and_metrics_count_drafts(spec_server, tiny_llama):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{spec_server}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    with LLM(str(tiny_llama), dtype="float32", max_model_len=MAX_MODEL_LEN) as llm:
        ref = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].text
    assert r.json()["choices"][0]["text"] == ref
    wait_until(lambda: metric(spec_server, "pagedllm:spec_decode_num_drafts_total") > 0, "spec decode counters")
    drafts = metric(spec_server, "pagedllm:spec_decode_num_draft_tokens_total")
    kept = metric(spec_server, "pagedllm:spec_decode_num_accepted_tokens_total")
    assert 0 <= kept <= drafts and drafts > 0
    assert metric(spec_server, "pagedllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") <= drafts
    assert metric(spec_server, "pagedllm:spec_decode_steps_total", decision="on") > 0


def test_a_config_it_cannot_run_is_refused_at_start(tiny_llama):
    for config, says in (('{"method": "eagle3", "model": "x"}', "not implemented yet"),
                         ('{"method": "ngram", "lookahead": 2}', "not supported; known"),
                         ("ngram", "must be a JSON object")):
        res = subprocess.run([sys.executable, "-m", "pagedllm", "serve", "--model", str(tiny_llama),
                              "--speculative-config", config], capture_output=True, text=True, timeout=120)
        assert res.returncode != 0 and says in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
