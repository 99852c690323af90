"""Structured outputs (xgrammar) through the `openai` client against the live server, and offline under
preemption. The tiny model's random weights at temperature 1 pick anything the grammar allows: every
output must still validate."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import openai
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.structured_output import GuidedDecodingParams
from tests.server.conftest import API_KEY, kv_idle, metric, wait_until

NUM_SCHEMAS = 50


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema with short names and bounded values (the model has 128 positions): strings with a
    maxLength, integers and numbers with bounds, enums, booleans, small arrays, one level of nesting."""
    props = {}
    for name in rng.sample("abcdefg", rng.randint(1, 3 if depth == 0 else 2)):
        kind = rng.choice(["string", "integer", "number", "enum", "boolean", "array"] + (["object"] if depth == 0
                                                                                         else []))
        if kind == "string":
            props[name] = {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 5)}
        elif kind == "integer":
            low = rng.randint(-50, 50)
            props[name] = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
        elif kind == "number":
            props[name] = {"type": "number", "minimum": 0, "maximum": rng.randint(1, 10)}
        elif kind == "enum":
            props[name] = {"enum": rng.sample(["red", "green", "blue", "x", "yes", "no"], rng.randint(1, 3))}
        elif kind == "boolean":
            props[name] = {"type": "boolean"}
        elif kind == "array":
            props[name] = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                           "minItems": 1, "maxItems": rng.randint(1, 3)}
        else:
            props[name] = random_schema(rng, depth + 1)
    required = sorted(rng.sample(sorted(props), rng.randint(1, len(props))))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0)


def _text_of(client, schema: dict, stream: bool, chat: bool, seed: int) -> tuple[str, str]:
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    common = {"model": "tiny", "max_tokens": 100, "temperature": 1.0, "seed": seed}
    if chat:
        kwargs = {"messages": [{"role": "user", "content": "hi"}], "response_format": fmt, **common}
        if not stream:
            r = client.chat.completions.create(**kwargs)
            return r.choices[0].message.content, r.choices[0].finish_reason
        parts, finish = [], None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                finish = c.finish_reason or finish
        return "".join(parts), finish
    kwargs = {"prompt": "hi", "extra_body": {"response_format": fmt}, **common}
    if not stream:
        r = client.completions.create(**kwargs)
        return r.choices[0].text, r.choices[0].finish_reason
    parts, finish = [], None
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            parts.append(c.text)
            finish = c.finish_reason or finish
    return "".join(parts), finish


def test_random_json_schemas_give_outputs_that_validate(client, http):
    rng = random.Random(2026)
    for k in range(NUM_SCHEMAS):
        schema = random_schema(rng)
        text, finish = _text_of(client, schema, stream=k % 2 == 1, chat=k % 4 >= 2, seed=k)
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    wait_until(lambda: kv_idle(http), "an idle engine")


def test_json_object_regex_and_choice_hold(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=100,
                                       temperature=1.0, seed=3, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # (any JSON object may be longer than the tokens left)
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    for seed in range(4):
        r = client.completions.create(model="tiny", prompt="hi", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body={"guided_regex": r"[a-c]{2}-[0-9]{3}"})
        assert re.fullmatch(r"[a-c]{2}-[0-9]{3}", r.choices[0].text), r.choices[0].text
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "pick"}],
                                           max_tokens=20, temperature=1.0, seed=seed,
                                           extra_body={"guided_choice": ["alpha", "beta", "gamma delta"]})
        assert r.choices[0].message.content in ("alpha", "beta", "gamma delta")
        r = client.completions.create(model="tiny", prompt="hi", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body={"structured_outputs": {"choice": ["on", "off"]}})
        assert r.choices[0].text in ("on", "off")


def _strict_json(text: str):
    """Parse as strict JSON: -Infinity / NaN (which Python's json writes and reads) are refused."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_masked_tokens_are_json_numbers(http, stream):
    """Under a constraint most tokens have logprob -inf; the response must still be JSON (vLLM's -9999.0)."""
    for path, body in (("/v1/completions", {"prompt": "hi", "logprobs": 5}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                                 "top_logprobs": 5})):
        r = http.post(path, json={"model": "tiny", "max_tokens": 3, "temperature": 0, "stream": stream,
                                  "guided_choice": ["on", "off"], **body})
        assert r.status_code == 200, r.text
        events = ([line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: {")] if stream
                  else [r.text])
        logprobs = [c["logprobs"] for e in events for c in _strict_json(e)["choices"] if c.get("logprobs")]
        assert logprobs and -9999.0 in set(_floats(logprobs)), events


def _floats(value):
    if isinstance(value, float):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _floats(v)
    elif isinstance(value, list):
        for v in value:
            yield from _floats(v)


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": {"type": "nonsense-type"}}, "guided_json"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                      "minProperties": "two"}}}},
     "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_an_invalid_constraint_gets_a_400_naming_its_field(http, body, param):
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_logit_bias_moves_the_greedy_choice_and_is_clamped(http):
    base = http.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 1,
                                              "temperature": 0, "logprobs": 1}).json()
    first = base["choices"][0]["logprobs"]["tokens"][0]
    target = 7
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0,
                                           "logit_bias": {str(target): 1000}}).json()  # clamped to 100: enough
    ids = http.post("/tokenize", json={"prompt": r["choices"][0]["text"], "add_special_tokens": False}).json()
    assert ids["tokens"] and set(ids["tokens"]) == {target}, (first, r)
    bad = http.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "logit_bias": {"abc": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"
    bad = http.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "logit_bias": {"99999999": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_grammar_state_survives_preemption(tiny_llama):
    """Seeded structured outputs are the same with a KV cache so small that requests are preempted (recompute)
    as with room for all: each matcher follows its request's own tokens, whatever happened to its KV."""
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(6)]
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(len(schemas))]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, guided_decoding=GuidedDecodingParams(json=s))
              for i, s in enumerate(schemas)]
    roomy = LLM(str(tiny_llama), dtype="float32", max_model_len=64)
    expected = [o.outputs[0].text for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(str(tiny_llama), dtype="float32", max_model_len=64, num_gpu_blocks_override=8, block_size=8,
                preemption_mode="recompute")
    got = [o.outputs[0].text for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.preemption_stats.recompute > 0
    assert got == expected
    for text, schema in zip(got, schemas):
        jsonschema.validate(json.loads(text), schema)


def test_metrics_and_memory_count_structured_output_work(server_url, http):
    http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 8,
                                       "guided_regex": "[0-9]{4}x"}).raise_for_status()
    assert metric(server_url, "pagedllm:structured_output_compile_seconds_count") > 0
    assert metric(server_url, "pagedllm:structured_output_bitmask_seconds_total") > 0
    assert http.get("/v1/memory").json()["structured_output_cache_bytes"] > 0


def test_structured_outputs_fields_sent_by_their_names_are_known(caplog):
    """`structured_outputs: {"json": ...}` is vLLM's name for the field held as `json_`: it is read without the
    "unknown field" warning, which a field the server does not know still gets."""
    import logging

    from pagedllm.entrypoints.openai import protocol
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest

    protocol._WARNED.clear()
    body = {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"json": {"type": "object"}}}
    with caplog.at_level(logging.WARNING, logger=protocol.__name__):
        req = ChatCompletionRequest.model_validate(body)
    assert req.guided_decoding().json == {"type": "object"} and "unknown field" not in caplog.text
    with caplog.at_level(logging.WARNING, logger=protocol.__name__):
        ChatCompletionRequest.model_validate(body | {"structured_outputs": {"json": {}, "jsn": 1}})
    assert "ignoring the unknown field 'jsn' of StructuredOutputs" in caplog.text
