"""The chat stream's per-choice streamers on their own (the server tests stream them end to end)."""
from __future__ import annotations

import json

from pagedllm.entrypoints.openai.chat_stream import (
    ConstrainedCallStreamer,
    FreeReplyStreamer,
    TextStreamer,
    streamer_for,
)
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_use import ToolUse
from pagedllm.outputs import CompletionOutput

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _tools(choice) -> ToolUse:
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[TOOL],
                                tool_choice=choice)
    return ToolUse.of(req, "hermes")


def _out(text: str, finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(0, text, list(range(len(text))), None, None, finish)


def _sent(choices) -> list[dict]:
    """The chunk choices as they go on the wire."""
    return [c.to_json() for c in choices]


def test_each_mode_has_its_streamer():
    assert isinstance(streamer_for(0, ToolUse(), [], None), TextStreamer)
    assert isinstance(streamer_for(0, _tools("auto"), [], None), FreeReplyStreamer)
    assert isinstance(streamer_for(0, _tools("required"), [], None), ConstrainedCallStreamer)
    assert isinstance(streamer_for(0, _tools("none"), [], None), TextStreamer)  # tools given, none to call


def test_text_is_held_back_while_it_may_start_a_stop_string():
    streamer = TextStreamer(0, ["END"], None)
    assert streamer.opening().to_json()["delta"] == {"role": "assistant", "content": ""}
    assert [c["delta"] for c in _sent(streamer.chunks(_out("abcEN")))] == [{"content": "abc"}]  # "EN" may be "END"
    last = _sent(streamer.chunks(_out("abcENx", "stop")))
    assert [c["delta"] for c in last] == [{"content": "ENx"}, {}]
    assert last[-1]["finish_reason"] == "stop" and "stop_reason" in last[-1]


def test_a_constrained_call_streams_its_name_then_its_arguments():
    streamer = ConstrainedCallStreamer(0, _tools("required"))
    first = _sent(streamer.chunks(_out('[{"name": "get_weather", "parameters": {"ci')))
    calls = first[0]["delta"]["tool_calls"]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["function"]["arguments"] == ""
    more = _sent(streamer.chunks(_out('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', "stop")))
    arguments = "".join(call["function"]["arguments"] for c in first + more for call in c["delta"].get("tool_calls", []))
    assert arguments.replace(" ", "") == '{"city":"Paris"}'
    assert more[-1]["finish_reason"] == "tool_calls"


def test_a_free_reply_streams_its_content_and_sends_its_calls_once_complete():
    streamer = FreeReplyStreamer(0, _tools("auto"), has_stops=False)
    assert _sent(streamer.chunks(_out("Let me look."))) == [
        {"index": 0, "delta": {"content": "Let me look."}, "logprobs": None, "finish_reason": None}]
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert _sent(streamer.chunks(_out("Let me look. " + call[:12]))) == []  # may be a call: held
    calls, last = _sent(streamer.chunks(_out("Let me look. " + call, "stop")))
    (sent,) = calls["delta"]["tool_calls"]
    assert sent["index"] == 0 and sent["type"] == "function" and sent["id"].startswith("call_")
    assert sent["function"]["name"] == "get_weather" and json.loads(sent["function"]["arguments"]) == {"city": "Paris"}
    assert last["finish_reason"] == "tool_calls" and last["delta"] == {}


def test_a_harmony_reply_streams_reasoning_content_then_its_tool_call():
    """gpt-oss: the reply (read with its special tokens) rewritten by harmony.py at each step, streamed by the
    reasoning streamer over a free reply with tools (the openai parser): reasoning_content pieces, then the call
    in one delta once the reply ends; joined, what the whole reply's message holds."""
    from pagedllm.entrypoints.openai.chat_stream import answer_of
    from pagedllm.entrypoints.openai.harmony import harmony_to_text

    raw = ('<|channel|>analysis<|message|>The user wants Paris weather.<|end|><|start|>assistant to=functions.'
           'get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}')
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[TOOL])
    tools = ToolUse.of(req, "openai")
    streamer = streamer_for(0, tools, [], None, reasoning=True, in_reasoning=False)
    deltas = []
    for end in range(1, len(raw) + 1):
        finish = "stop" if end == len(raw) else None
        deltas += [c["delta"] for c in _sent(streamer.chunks(_out(harmony_to_text(raw[:end], finish is not None),
                                                                  finish)))]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    answer, whole_reasoning = answer_of(_out(harmony_to_text(raw, True), "stop"), False)
    message, finish = tools.reply(answer)
    assert reasoning == whole_reasoning == "The user wants Paris weather."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})] == [(t.function.name, json.loads(t.function.arguments))
                                               for t in message.tool_calls]
    assert finish == "tool_calls" and not any(d.get("content") for d in deltas) and message.content is None
