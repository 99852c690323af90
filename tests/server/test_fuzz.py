"""schemathesis against the server's own /openapi.json: every operation, every check (no 5xx, every response
as documented: status, content type, headers, body, each event of a stream; schema-invalid data rejected; the
API key enforced), bounded; then the server is healthy and holds nothing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import API_KEY, AUTH, _start_server, _stop_server, kv_idle, wait_until

CONFIG = Path(__file__).with_name("schemathesis.toml")
EXAMPLES = 25  # per operation, every check: 50 took 65 s of a CI run on a 2-core AVX2 machine
SEED = 20261205  # fixed: a CI failure is reproduced by running this test again


# Requests that leave max_tokens out generate up to the context (120 tokens here, ~0.5 s): the coverage phase
# sends ~60 such chats. A served cap (vLLM's max_new_tokens) keeps each to 16; every response is checked the same.
CAP = '{"max_new_tokens": 16}'


@pytest.fixture(scope="module")
def capped_server(tiny_llama, tmp_path_factory):
    proc, url, _ = _start_server(tiny_llama, tmp_path_factory.mktemp("fuzz"),
                                 ["--api-key", API_KEY, "--override-generation-config", CAP])
    yield url
    _stop_server(proc)


@pytest.fixture(scope="module")
def pooling_server(tiny_models, tmp_path_factory):
    """An embedding model's server: its document names the pooling routes (/v1/embeddings, /v1/score,
    /v1/rerank) instead of the generation ones. (With no web page: --no-web-ui.)"""
    proc, url, _ = _start_server(tiny_models["qwen3"], tmp_path_factory.mktemp("fuzz_pooling"),
                                 ["--api-key", API_KEY, "--runner", "pooling", "--no-web-ui"])
    yield url
    _stop_server(proc)


def _fuzz(server_url: str) -> str:
    """schemathesis on every operation of the server's document; its report."""
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run",
           f"{server_url}/openapi.json", "--checks", "all", "--max-examples", str(EXAMPLES), "--workers", "1",
           "--seed", str(SEED), "-H", f"Authorization: {AUTH['Authorization']}", "--no-color"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "No issues found" in run.stdout, run.stdout[-3000:]
    return run.stdout


def test_the_api_does_what_its_openapi_document_says(capped_server):
    server_url = capped_server
    _fuzz(server_url)
    with httpx.Client(base_url=server_url, headers=AUTH, timeout=60) as http:
        assert http.get("/health").status_code == 200
        wait_until(lambda: kv_idle(http), "an idle engine after the fuzzing")
        r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_a_pooling_server_does_what_its_openapi_document_says(pooling_server):
    assert httpx.get(f"{pooling_server}/").status_code == 404  # --no-web-ui
    paths = httpx.get(f"{pooling_server}/openapi.json").json()["paths"]
    assert {"/v1/embeddings", "/v1/score", "/v1/rerank"} <= set(paths) and "/v1/chat/completions" not in paths
    report = _fuzz(pooling_server)
    assert "POST /v1/embeddings" not in report  # (named only in a warning: data the server mostly rejected)
    with httpx.Client(base_url=pooling_server, headers=AUTH, timeout=60) as http:
        assert http.get("/health").status_code == 200
        wait_until(lambda: kv_idle(http), "an idle engine after the fuzzing")
        r = http.post("/v1/embeddings", json={"input": "hello", "encoding_format": "float"})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64
