"""Tool calling: the parsers on replies as models write them, and a round trip through the `openai` client with
tool_choice required and a named function (constrained by their JSON schemas: the arguments always parse and
validate, even from the tiny model's random weights at temperature 1)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedllm.entrypoints.openai.tool_calls import parse_tool_calls
from tests.server.conftest import API_KEY

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 6},
                                          "unit": {"enum": ["c", "f"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = {"role": "user", "content": "What is the weather?"}


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0)


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_call_round_trip(client):
    for seed in range(5):
        r = client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, tool_choice="required",
                                           max_tokens=80, temperature=1.0, seed=seed, parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls)
    call = choice.message.tool_calls[0]
    history = [USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, temperature=0)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content


def test_a_named_function_is_called_with_arguments_that_validate(client):
    for seed in range(5):
        r = client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, max_tokens=60,
                                           temperature=1.0, seed=seed,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
        calls = r.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["add"] and r.choices[0].finish_reason == "stop"
        _check_calls(calls)


def test_streamed_tool_calls_arrive_as_deltas(client):
    stream = client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, tool_choice="required",
                                            max_tokens=80, temperature=1.0, seed=11, stream=True,
                                            parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
])
def test_bad_tool_requests_get_a_400_naming_the_field(http, body, param):
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [USER], "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', None,
     [("add", {"a": 1, "b": 2})]),
    ("hermes", 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
               '</tool_call><tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>', "Let me check.",
     [("get_weather", {"city": "Oslo", "unit": "c"}), ("add", {"a": 3, "b": 4})]),
    ("hermes", "no calls here", "no calls here", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                    '{"name": "add", "parameters": {"a": 5, "b": 6}}', None,
     [("add", {"a": 1, "b": 2}), ("add", {"a": 5, "b": 6})]),
    ("llama3_json", "The answer is 3.", "The answer is 3.", []),
])
def test_tool_call_parsers(parser, text, content, calls):
    got_content, got = parse_tool_calls(parser, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
