"""Anthropic's Messages API through the real `anthropic` SDK, unchanged: text, a stream (its event order, and its
text equal to the whole reply's), a tool_use -> tool_result round trip, count_tokens, and Anthropic's error shapes
(the SDK's typed exceptions, x-api-key as the key)."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from pagedllm.entrypoints.openai.messages_api import MessagesRequest, chat_messages
from tests.server.conftest import API_KEY, sse_events

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(server_url):
    return anthropic.Anthropic(base_url=server_url, api_key=API_KEY, max_retries=0)


def test_a_text_message_and_its_token_count(client):
    # (The SDK's create() no longer names the sampling fields; older clients send them, and extra_body does.)
    message = client.messages.create(model="tiny", max_tokens=8, messages=USER, system="Be brief.",
                                     extra_body={"temperature": 0})
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert [block.type for block in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason in ("max_tokens", "end_turn") and message.usage.output_tokens >= 1
    counted = client.messages.count_tokens(model="tiny", messages=USER, system="Be brief.")
    assert counted.input_tokens == message.usage.input_tokens > 0


def test_a_streamed_message_in_anthropics_event_order_equals_the_whole_one(client, server_url):
    kwargs = dict(model="tiny", max_tokens=12, messages=USER)
    whole = client.messages.create(**kwargs, extra_body={"temperature": 0})
    with client.messages.stream(**kwargs, extra_body={"temperature": 0}) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) >= 2 and "".join(pieces) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    with httpx.stream("POST", f"{server_url}/v1/messages", json={**kwargs, "stream": True, "temperature": 0},
                      headers={"x-api-key": API_KEY}, timeout=60) as r:
        lines = list(r.iter_lines())
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    assert [e["type"] for e in sse_events(lines)] == names
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}


def test_a_tool_use_round_trip(client):
    """tool_choice any: the reply is a tool_use block whose input validates; its result goes back as a
    tool_result block and the model answers in text."""
    message = client.messages.create(model="tiny", max_tokens=90, messages=USER, tools=[WEATHER],
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                     extra_body={"temperature": 1.0})
    assert message.stop_reason == "tool_use"
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    history = USER + [{"role": "assistant", "content": [block.model_dump() for block in message.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                    "content": "sunny, 21 C"}]}]
    answer = client.messages.create(model="tiny", max_tokens=6, messages=history, tools=[WEATHER],
                                    tool_choice={"type": "none"}, extra_body={"temperature": 0})
    assert [block.type for block in answer.content] == ["text"]


def test_an_output_format_schema_constrains_the_reply(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer"], "additionalProperties": False}
    message = client.messages.create(model="tiny", max_tokens=40, messages=USER, extra_body={"temperature": 1.0},
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_tool_blocks_become_the_chat_turns_templates_expect():
    req = MessagesRequest.model_validate({"max_tokens": 4, "system": [{"type": "text", "text": "S"}], "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny"}]}]}]})
    assert chat_messages(req) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}]


def test_errors_in_anthropics_shape(client, server_url):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=USER)
    assert missing.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(f"{server_url}/v1/messages", json={"model": "tiny", "messages": USER},
                   headers={"x-api-key": API_KEY})  # max_tokens is required
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    wrong = anthropic.Anthropic(base_url=server_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model="tiny", max_tokens=4, messages=USER)
    assert denied.value.body["error"]["type"] == "authentication_error"
