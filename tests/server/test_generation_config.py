"""--generation-config and --override-generation-config, as vLLM's: the model's generation_config.json gives
the sampling of requests that leave a field out, the override sets values on top, max_new_tokens caps every
request; 'vllm' ignores the file; bad values are refused at start, naming the flag."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.generation_defaults import GenerationDefaults
from tests.helpers import make_tiny_model
from tests.server.conftest import MAX_MODEL_LEN, _start_server, _stop_server

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A tiny Llama whose maker recommends greedy decoding (temperature 0) and top_k 5."""
    path = make_tiny_model(tmp_path_factory.mktemp("gen") / "m", "llama")
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(gen | {"temperature": 0.0, "top_k": 5, "top_p": 1.0}))
    return path


def test_the_model_file_and_the_override_resolve_as_vllms(model, tmp_path):
    assert GenerationDefaults.resolve("auto", model, None).values == {"temperature": 0.0, "top_k": 5}  # top_p 1.0: HF's own default
    assert GenerationDefaults.resolve("vllm", model, None).values == {}
    both = GenerationDefaults.resolve("auto", model, {"temperature": 0.7, "max_new_tokens": 9})
    assert both.values == {"temperature": 0.7, "top_k": 5, "max_tokens": 9}
    assert GenerationDefaults.resolve("vllm", model, {"min_p": 0.1}).values == {"min_p": 0.1}
    assert GenerationDefaults.resolve(str(model), tmp_path, None).values["top_k"] == 5  # another folder's file
    assert both.cap_max_tokens(None) == 9 and both.cap_max_tokens(100) == 9 and both.cap_max_tokens(3) == 3


@pytest.mark.parametrize("source,override,message", [
    ("auto", {"max_length": 10}, "max_length not used by pagedllm; the keys it takes: temperature"),
    ("auto", {"temperature": -1}, "out of range"),
    ("auto", {"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ("/nonexistent", None, "no generation_config.json in that folder"),
])
def test_bad_values_are_refused_naming_the_flag(model, source, override, message):
    with pytest.raises(ValueError, match=message):
        GenerationDefaults.resolve(source, model, override)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    proc, url, stderr = _start_server(model, tmp_path_factory.mktemp("gen_server"),
                                      ["--override-generation-config", '{"max_new_tokens": 6}'])
    yield url, stderr
    _stop_server(proc)


def test_requests_get_the_models_defaults_and_the_served_cap(model, server):
    url, stderr = server
    assert '"temperature": 0.0, "top_k": 5, "max_tokens": 6' in stderr.read_text()  # said at start
    llm = LLM(str(model), dtype="float32", max_model_len=MAX_MODEL_LEN)

    def offline(**kw) -> str:
        return llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(**kw), use_tqdm=False)[0].outputs[0].text

    # No temperature, no max_tokens: greedy (the model's file), 6 tokens (the cap), not 124.
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 6
    assert chat.json()["choices"][0]["finish_reason"] == "length"
    # A max_tokens above the cap is cut to it; the text is the greedy one.
    done = httpx.post(f"{url}/v1/completions", timeout=60, json={"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 6
    assert done.json()["choices"][0]["text"] == offline(temperature=0.0, max_tokens=6, ignore_eos=True)
    # What a request sets wins over the defaults: seeded sampling at temperature 1 with the file's top_k 5.
    sampled = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 1.0, "seed": 7})
    assert sampled.json()["choices"][0]["text"] == offline(temperature=1.0, top_k=5, seed=7, max_tokens=6,
                                                           ignore_eos=True)
