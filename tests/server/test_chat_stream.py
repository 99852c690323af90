"""The chat stream's per-choice streamers on their own (the server tests stream them end to end)."""
from __future__ import annotations

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


def test_each_mode_has_its_streamer():
    assert isinstance(streamer_for(0, ToolUse(), [], None), TextStreamer)
    assert isinstance(streamer_for(0, _tools("auto"), [], None), FreeReplyStreamer)
    assert isinstance(streamer_for(0, _tools("required"), [], None), ConstrainedCallStreamer)
    assert isinstance(streamer_for(0, _tools("none"), [], None), TextStreamer)  # tools given, none to call


def test_text_is_held_back_while_it_may_start_a_stop_string():
    streamer = TextStreamer(0, ["END"], None)
    assert streamer.opening()["delta"] == {"role": "assistant", "content": ""}
    assert [c["delta"] for c in streamer.chunks(_out("abcEN"))] == [{"content": "abc"}]  # "EN" may be "END"
    last = streamer.chunks(_out("abcENx", "stop"))
    assert [c["delta"] for c in last] == [{"content": "ENx"}, {}]
    assert last[-1]["finish_reason"] == "stop" and "stop_reason" in last[-1]


def test_a_constrained_call_streams_its_name_then_its_arguments():
    streamer = ConstrainedCallStreamer(0, _tools("required"))
    first = streamer.chunks(_out('[{"name": "get_weather", "parameters": {"ci'))
    calls = first[0]["delta"]["tool_calls"]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["function"]["arguments"] == ""
    more = streamer.chunks(_out('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', "stop"))
    arguments = "".join(call["function"]["arguments"] for c in first + more for call in c["delta"].get("tool_calls", []))
    assert arguments.replace(" ", "") == '{"city":"Paris"}'
    assert more[-1]["finish_reason"] == "tool_calls"
