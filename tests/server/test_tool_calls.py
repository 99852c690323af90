"""Tool calling: the parsers on replies as models write them, and a round trip through the `openai` client with
tool_choice required and a named function (constrained by their JSON schemas: the arguments always parse and
validate, even from the tiny model's random weights at temperature 1)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedllm.entrypoints.openai.tool_calls import content_so_far, parse_tool_calls
from tests.server.conftest import API_KEY, _stop_server, start_command

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


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_streamed_tool_calls_arrive_as_they_are_written(client, tool_choice):
    """The name first (once), then the arguments in pieces as tokens come; joined, they are exactly the
    arguments of the same request not streamed (same seed)."""
    kwargs = dict(model="tiny", messages=[USER], tools=TOOLS, tool_choice=tool_choice, max_tokens=80,
                  temperature=1.0, seed=11, parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    pieces, finish = 0, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": "", "ids": 0})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
                entry["ids"] += d.id is not None
                pieces += bool(d.function.arguments)
            finish = c.finish_reason or finish
    assert finish == ("tool_calls" if tool_choice == "required" else "stop") and len(calls) == 1
    assert calls[0]["ids"] == 1 and pieces > 1, calls
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert [(t.function.name, t.function.arguments) for t in whole] == [(calls[0]["name"], calls[0]["arguments"])]


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
    # Mistral, tokenizers before v11: a JSON array after [TOOL_CALLS] (a special token: the text keeps it)
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": '
                '{"a": 3, "b": 4}}]', None, [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),
    # v11 on (Mistral Small 3.2, Devstral, Magistral): NAME[ARGS]{...} after each [TOOL_CALLS]; v13 adds [CALL_ID]
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]add[CALL_ID]a1B2c3D4e[ARGS]'
                '{"a": 5, "b": 6}', "Checking.", [("get_weather", {"city": "Oslo"}), ("add", {"a": 5, "b": 6})]),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{\"city\": ", "[TOOL_CALLS]get_weather[ARGS]{\"city\": ", []),
    ("mistral", '[TOOL_CALLS] [{"arguments": {}}]', '[TOOL_CALLS] [{"arguments": {}}]', []),  # no name: content
    ("mistral", "Just text.", "Just text.", []),
    # gpt-oss: harmony calls as harmony.py rewrites them (the openai parser reads <tool_call> blocks)
    ("openai", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', None,
     [("get_weather", {"city": "Oslo"})]),
])
def test_tool_call_parsers(parser, text, content, calls):
    got_content, got = parse_tool_calls(parser, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_partial_calls_read_every_prefix_of_a_reply():
    """Strings holding quotes, braces and brackets do not end a call early; each prefix's arguments are a
    prefix of the final ones, and a call is complete exactly when its object closes."""
    from pagedllm.entrypoints.openai.tool_calls import ConstrainedCallReader, partial_calls

    text = '[{"name": "add", "parameters": {"a": 1, "b": "x}\\"{["}}, {"name":"mul","parameters":{"c":[1,{"d":2}]}}]'
    final = partial_calls(text, "required")
    assert [(c.name, json.loads(c.arguments), c.complete) for c in final] == [
        ("add", {"a": 1, "b": 'x}"{['}, True), ("mul", {"c": [1, {"d": 2}]}, True)]
    reader = ConstrainedCallReader("required")  # read as a stream grows: the same as each prefix read whole
    for n in range(len(text)):
        assert [(c.name, c.arguments, c.complete) for c in reader.read(text[:n])] == [
            (c.name, c.arguments, c.complete) for c in partial_calls(text[:n], "required")]
        for got, want in zip(partial_calls(text[:n], "required"), final):
            assert want.arguments.startswith(got.arguments) and got.name in (None, want.name)
            assert got.complete == (got.arguments == want.arguments and got.arguments != "")
    named = ' {"a": {"b": "}"}} '
    assert [partial_calls(named[:n], {"function": {"name": "f"}})[0].complete for n in (9, 17, 18)] == [
        False, False, True]


@pytest.mark.parametrize("parser, text, streamed", [
    ("hermes", "The weather", "The weather"),
    ("hermes", "Let me check. <tool", "Let me check."),  # may be a call's start: held back
    ("hermes", "Let me check. <tool_call>\n{\"name\"", "Let me check."),
    ("hermes", "a < b and <to", "a < b and"),
    ("llama3_json", "  {\"name\": \"add\"", ""),
    ("llama3_json", "<|python", ""),
    ("llama3_json", "Sunny today ", "Sunny today"),
    ("mistral", "Let me check.[TOOL_C", "Let me check."),
    ("mistral", "Let me check. [TOOL_CALLS]get_weather[ARGS]{", "Let me check."),
    ("mistral", "[ not a call", "[ not a call"),
])
def test_the_content_of_a_free_reply_streams_until_a_call_may_begin(parser, text, streamed):
    assert content_so_far(parser, text) == streamed
    for n in range(len(text)):  # what streams only grows
        assert content_so_far(parser, text).startswith(content_so_far(parser, text[:n]))


@pytest.fixture(scope="module")
def auto_url(tiny_llama, tmp_path_factory):
    import sys

    proc, url = start_command(lambda port: [
        sys.executable, "-m", "pagedllm", "serve", str(tiny_llama), "--served-model-name", "tiny", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "512", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        tmp_path_factory.mktemp("auto-tools"))
    yield url
    _stop_server(proc)


def test_tool_choice_auto_streams_a_text_reply_as_it_is_written(auto_url):
    """With tools and tool_choice auto the tiny model answers in text: it arrives in many deltas, and joined it
    is the reply of the same request not streamed."""
    client = openai.OpenAI(base_url=f"{auto_url}/v1", api_key="none", max_retries=0)
    kwargs = dict(model="tiny", messages=[USER], tools=TOOLS, max_tokens=40, temperature=1.0, seed=5,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.message.tool_calls is None and whole.message.content
    pieces = [c.delta.content for chunk in client.chat.completions.create(stream=True, **kwargs)
              for c in chunk.choices if c.delta.content]
    assert "".join(pieces) == whole.message.content and len(pieces) > 3, pieces


CODER_TOOLS = {"get_weather": {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "zip": {"type": "string"},
                                     "where": {"type": "object"}}}}}}
CODER_REPLY = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
               "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=zip>\n"
               "01234\n</parameter>\n<parameter=where>\n{\"lat\": 40.7}\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder_xml_calls_take_their_parameters_schema_types():
    """Qwen3-Coder's XML: each value is read as its schema type says (the string "01234" stays a string; 3, true
    and the object are parsed); the text before the call is the content, streamed as it is written."""
    content, calls = parse_tool_calls("qwen3_coder", CODER_REPLY, CODER_TOOLS)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "New York", "days": 3, "metric": True, "zip": "01234",
                                              "where": {"lat": 40.7}}
    assert content_so_far("qwen3_coder", CODER_REPLY[:20]) == "Let me check."
    broken = CODER_REPLY.replace("</function>", "")
    assert parse_tool_calls("qwen3_coder", broken, CODER_TOOLS) == (broken, [])  # a malformed call stays content
