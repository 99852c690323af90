"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), what Claude Code and the
`anthropic` SDK speak, over the chat completions path: a request becomes a chat request (system, text, tool_use /
tool_result blocks, tools and tool_choice, stop_sequences, sampling), its reply or chunk stream becomes Anthropic's
message or event stream (`message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta` with usage,
`message_stop`). Thinking blocks come from the server's --reasoning-parser. Errors take Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`) on these paths (routes.py).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.bodies import ChatCompletionResponse
from pagedllm.entrypoints.openai.chat_stream import chunk_payloads
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, LenientModel, NonEmptyStr

MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class AnthropicMessage(BaseModel):
    """The reply of POST /v1/messages: content blocks (thinking, text, tool_use), why it stopped, token counts."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicEvent(BaseModel):
    """One event of a streamed message: message_start, content_block_start / _delta / _stop, message_delta,
    message_stop (or error), its fields as Anthropic's."""

    model_config = ConfigDict(extra="allow")
    type: Literal["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                  "message_delta", "message_stop", "error"]


class CountTokensResponse(BaseModel):
    input_tokens: int


class ToolSpec(LenientModel):
    name: NonEmptyStr
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolChoice(LenientModel):
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(LenientModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(LenientModel):
    format: OutputFormat | None = None
    effort: str | None = None  # accepted; the server's reasoning parser decides what thinking there is


class Message(LenientModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(LenientModel):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[NonEmptyStr] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None  # format: a JSON schema the reply must follow (structured outputs)
    # Accepted and not needed here: who asked, and the thinking budget (the server's reasoning parser decides).
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None


class CountTokensRequest(LenientModel):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None


def _text_of(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """Text blocks' text joined (a tool_result's content, a system prompt)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for k, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}[{k}]: only text blocks are supported here", where)
        parts.append(block["text"])
    return "".join(parts)


def chat_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat completion messages: the system prompt first, each user turn's tool_result blocks
    as tool messages, each assistant turn's tool_use blocks as its tool_calls (thinking blocks are not re-sent)."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls, results = [], [], []
        for k, block in enumerate(m.content):
            kind = block.get("type") if isinstance(block, dict) else None
            where = f"messages[{i}].content[{k}]"
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and m.role == "assistant":
                calls.append({"id": str(block.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"), "type": "function",
                              "function": {"name": str(block.get("name", "")),
                                           "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and m.role == "user":
                results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                                "content": _text_of(block.get("content"), f"{where}.content")})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue
            else:
                raise APIError(400, f"{where}: a {kind!r} block is not supported in a {m.role} turn (text, tool_use "
                                    f"in assistant turns, tool_result in user turns, thinking)", "messages")
        out.extend(results)  # a tool's answer comes right after the assistant turn that called it
        if text or calls or not results:
            message: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def _chat_tools(req: MessagesRequest | CountTokensRequest) -> tuple[list[dict] | None, Any]:
    if not req.tools:
        return None, None
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice or ToolChoice()
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice of type tool needs the tool's name", "tool_choice")
        return tools, {"type": "function", "function": {"name": choice.name}}
    return tools, {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    tools, tool_choice = _chat_tools(req)
    parallel = None if req.tool_choice is None or req.tool_choice.disable_parallel_tool_use is None \
        else not req.tool_choice.disable_parallel_tool_use
    fields: dict[str, Any] = {
        "model": req.model, "messages": chat_messages(req), "max_tokens": req.max_tokens, "stream": req.stream,
        "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stop": req.stop_sequences}
    if req.output_config is not None and req.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "output", "schema": req.output_config.format.schema_}}
    if req.stream:
        fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


def count_tokens_request(req: CountTokensRequest) -> tuple[list[dict], list[dict] | None]:
    tools, _ = _chat_tools(req)
    return chat_messages(req), tools


def _stop(finish_reason: str | None, stop_reason, stops: list[str]) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat choice's finish."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_reason in stops:
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def message_from_chat(reply: ChatCompletionResponse, req: MessagesRequest, model: str) -> dict:
    choice = reply.choices[0]
    content: list[dict] = []
    if choice.message.reasoning_content:
        content.append({"type": "thinking", "thinking": choice.message.reasoning_content, "signature": ""})
    if choice.message.content:
        content.append({"type": "text", "text": choice.message.content})
    for call in choice.message.tool_calls or []:
        content.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                        "input": _tool_input(call.function.arguments)})
    stop_reason, stop_sequence = _stop(choice.finish_reason, choice.stop_reason, req.stop_sequences or [])
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": reply.usage.prompt_tokens, "output_tokens": reply.usage.completion_tokens}}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _BlockWriter:
    """Content blocks as events: one block open at a time, opened on its first piece and closed when the next
    kind begins (or the message ends)."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text", or a tool call's index as "tool:k"

    def start(self, key: str, block: dict) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = key
        return events + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def delta(self, delta: dict) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]


async def stream_from_chat(chunks, req: MessagesRequest, model: str):
    """The chat completion's SSE chunks (one choice) as Anthropic's stream of events."""
    blocks, started, usage = _BlockWriter(), False, {"input_tokens": 0, "output_tokens": 0}
    finish: tuple[str, str | None] = ("end_turn", None)
    calls: dict[int, str] = {}  # tool call index -> its id
    async for chunk in chunk_payloads(chunks):
        if "error" in chunk and "choices" not in chunk:  # the chat stream's error event
            error = chunk["error"]
            for event in blocks.close():
                yield event
            yield _event("error", {"error": anthropic_error_body(int(error.get("code") or 500),
                                                                 str(error.get("message")))["error"]})
            return
        if chunk.get("usage"):
            usage = {"input_tokens": chunk["usage"]["prompt_tokens"],
                     "output_tokens": chunk["usage"]["completion_tokens"]}
        if not started:
            started = True
            yield _event("message_start", {"message": {
                "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 0}}})
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            events: list[str] = []
            if delta.get("reasoning_content"):
                if blocks.open != "thinking":
                    events += blocks.start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                events.append(blocks.delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                if blocks.open != "text":
                    events += blocks.start("text", {"type": "text", "text": ""})
                events.append(blocks.delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                k = call.get("index", 0)
                fn = call.get("function") or {}
                if k not in calls:
                    calls[k] = call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"
                    events += blocks.start(f"tool:{k}", {"type": "tool_use", "id": calls[k],
                                                         "name": fn.get("name", ""), "input": {}})
                if fn.get("arguments"):
                    events.append(blocks.delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
            if choice.get("finish_reason") is not None:
                finish = _stop(choice["finish_reason"], choice.get("stop_reason"), req.stop_sequences or [])
            for event in events:
                yield event
    for event in blocks.close():
        yield event
    yield _event("message_delta", {"delta": {"stop_reason": finish[0], "stop_sequence": finish[1]},
                                   "usage": {"output_tokens": usage["output_tokens"]}})
    yield _event("message_stop", {})

