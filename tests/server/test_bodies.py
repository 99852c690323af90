"""The response models are the code that writes the bodies: what they refuse cannot be sent, what was not given
is not sent, and what they always send the document says is required."""
import json

import pytest
from pydantic import ValidationError

from pagedllm.entrypoints.openai.bodies import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    ToolCallOut,
    FunctionCall,
    Usage,
)


def _chunk(**extra) -> ChatCompletionChunk:
    return ChatCompletionChunk(id="chatcmpl-1", created=7, model="m",
                               choices=[ChatChunkChoice(index=0, delta=ChatDelta(content="hi"))], **extra)


def test_a_field_the_document_does_not_name_cannot_be_sent():
    with pytest.raises(ValidationError, match="reasoning"):
        ChatDelta(content="x", reasoning="y")
    with pytest.raises(ValidationError, match="finish_reason"):
        CompletionChoice(index=0, text="", logprobs=None, finish_reason="timeout")


def test_fields_not_given_are_not_sent_and_none_is_null():
    body = json.loads(_chunk().sse().removeprefix("data: "))
    assert body == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                    "choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}]}
    assert json.loads(_chunk(usage=None).sse()[6:])["usage"] is None  # include_usage: null until the last chunk
    last = ChatChunkChoice(index=0, delta=ChatDelta(), finish_reason="stop", stop_reason=None)
    assert last.to_json() == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop", "stop_reason": None}


def test_a_whole_call_streams_as_one_delta():
    call = ToolCallOut(id="call_1", function=FunctionCall(name="f", arguments='{"a": 1}'))
    assert call.to_json() == {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert call.as_delta(2).to_json() == {"index": 2, **call.to_json()}
    assert ChatMessageOut(content=None, tool_calls=[call]).to_json()["role"] == "assistant"


def test_the_document_requires_what_is_always_sent_and_not_what_may_be_left_out():
    schema = CompletionResponse.model_json_schema()
    assert {"id", "object", "created", "model", "choices"} <= set(schema["required"])
    assert "usage" not in schema["required"]
    choice = ChatCompletionChunk.model_json_schema()["$defs"]["ChatChunkChoice"]
    assert {"logprobs", "finish_reason"} <= set(choice["required"]) and "stop_reason" not in choice["required"]
    body = CompletionResponse(id="c", created=1, model="m", choices=[], usage=Usage(
        prompt_tokens=1, completion_tokens=2, total_tokens=3)).to_json()
    assert body["object"] == "text_completion" and body["usage"]["total_tokens"] == 3
