"""OpenAI's Responses API through the real `openai` SDK's `responses.create`, unchanged: text, a stream (its events
in order, its text equal to the whole response's), a function tool round trip (function_call ->
function_call_output), a JSON schema format, and the refusals of a stateless server."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedllm.entrypoints.openai.responses_api import ResponsesRequest, chat_messages
from tests.server.conftest import API_KEY

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0)


def test_text_in_text_out(client):
    r = client.responses.create(model="tiny", input="Say hi.", instructions="Be brief.", max_output_tokens=8,
                                temperature=0, store=False)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.store is False
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text != ""
    assert r.usage.output_tokens >= 1 and r.usage.input_tokens > 0
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_a_stream_equals_the_whole_response(client):
    kwargs = dict(model="tiny", input=[{"role": "user", "content": "Count."}], max_output_tokens=12, temperature=0,
                  store=False)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == whole.output_text == events[-1].response.output_text


def test_a_function_tool_round_trip(client):
    r = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=90, temperature=1.0, store=False)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    history = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    answer = client.responses.create(model="tiny", input=history, tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=6, temperature=0, store=False)
    assert [item.type for item in answer.output] == ["message"]


def test_a_json_schema_format_constrains_the_text(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = client.responses.create(model="tiny", input="A digit.", max_output_tokens=40, temperature=1.0, store=False,
                                text={"format": {"type": "json_schema", "name": "digit", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_items_become_chat_turns():
    req = ResponsesRequest.model_validate({"instructions": "S", "input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{\"city\": \"Rome\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "snow"}]})
    assert chat_messages(req) == [
        {"role": "system", "content": "S"}, {"role": "system", "content": "rules"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "snow"}]


@pytest.mark.parametrize("extra,param", [({"previous_response_id": "resp_1"}, "previous_response_id"),
                                         ({"store": True}, "store")])
def test_a_stateless_server_refuses_what_needs_storage(client, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="hi", max_output_tokens=4, **extra)
    assert refused.value.body["param"] == param and "stateless" in refused.value.body["message"]
