"""OpenAI's Responses API (`POST /v1/responses`), what Codex and the `openai` SDK's `responses.create` speak, over
the chat completions path, stateless: text input or message items, `instructions`, function tools with
`function_call` / `function_call_output` items, `text.format` (a JSON schema), reasoning items from the server's
--reasoning-parser; whole, or streamed as the API's events (`response.created`, `response.output_item.added`,
`response.output_text.delta`, ..., `response.completed`). Nothing is stored: `previous_response_id` and
`store: true` are refused, saying so; a response says `"store": false`.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.bodies import ChatCompletionResponse
from pagedllm.entrypoints.openai.chat_stream import chunk_payloads
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, LenientModel


class FunctionTool(LenientModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(LenientModel):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(LenientModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, no effect


class ResponsesRequest(LenientModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "required", "none"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    text: TextConfig | None = None
    # Accepted and without effect here: the reasoning effort (the server's parser decides), who asked.
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: str | None = None


class ResponseObject(BaseModel):
    """The response: its output items (reasoning, message, function_call), status and token counts."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class ResponseEvent(BaseModel):
    """One event of a streamed response (response.created, response.output_text.delta, ..., response.completed,
    or error), its fields as OpenAI's."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of text parts", "input")
    parts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}[{k}]: a {kind!r} part is not supported (input_text, output_text)", "input")
        parts.append(part["text"])
    return "".join(parts)


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The input items as chat messages: instructions first, function_call items as the assistant's tool_calls
    (consecutive ones in one turn), function_call_output items as tool messages; reasoning items are not re-sent."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return out + [{"role": "user", "content": req.input}]
    for k, item in enumerate(req.input):
        where = f"input[{k}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _text_of(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id") or item.get("id") or ""), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", "{}"))}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": output if isinstance(output, str) else _text_of(output, f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}: an item of type {kind!r} is not supported (message, function_call, "
                                f"function_call_output, reasoning)", "input")
    return out


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id: this server stores no responses (stateless); send the "
                            "conversation's items in `input` instead", "previous_response_id")
    if req.store:
        raise APIError(400, "store: true: this server stores no responses (stateless); send store: false",
                       "store")
    fields: dict[str, Any] = {"model": req.model, "messages": chat_messages(req), "stream": req.stream,
                              "max_tokens": req.max_output_tokens, "temperature": req.temperature,
                              "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                             "parameters": t.parameters or {"type": "object"}}}
                           for t in req.tools]
        choice = req.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not choice.get("name"):
                raise APIError(400, "tool_choice must be auto, required, none or {\"type\": \"function\", "
                                    "\"name\": ...}", "tool_choice")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        fields["tool_choice"] = choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(400, "text.format of type json_schema needs its schema", "text")
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_}}
    elif fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    if req.stream:
        fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


def _ids() -> str:
    return uuid.uuid4().hex


def _usage(prompt: int, completion: int) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def _envelope(req: ResponsesRequest, rid: str, created: int, model: str, status: str, output: list[dict],
              usage: dict | None, finish_reason: str | None) -> dict:
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    return {"id": rid, "object": "response", "created_at": created, "status": status if incomplete is None else
            "incomplete", "model": model, "output": output, "usage": usage, "error": None,
            "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "store": False, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": {"type": "text"}} if req.text is None or req.text.format is None else
            {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []]}


def _message_item(text: str) -> dict:
    return {"type": "message", "id": f"msg_{_ids()}", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{_ids()}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def response_from_chat(reply: ChatCompletionResponse, req: ResponsesRequest, model: str) -> dict:
    choice = reply.choices[0]
    output: list[dict] = []
    if choice.message.reasoning_content:
        output.append(_reasoning_item(choice.message.reasoning_content))
    if choice.message.content:
        output.append(_message_item(choice.message.content))
    for call in choice.message.tool_calls or []:
        output.append({"type": "function_call", "id": f"fc_{_ids()}", "call_id": call.id,
                       "name": call.function.name, "arguments": call.function.arguments, "status": "completed"})
    return _envelope(req, f"resp_{_ids()}", int(time.time()), model, "completed", output,
                     _usage(reply.usage.prompt_tokens, reply.usage.completion_tokens), choice.finish_reason)


class _EventWriter:
    """The stream's events, numbered; output items opened on their first piece and closed when the next begins."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict] = []  # the output items, done or in progress
        self.open: str | None = None  # "reasoning", "message" or "call:k"

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self, key: str, item: dict) -> list[str]:
        events = self.close()
        self.items.append(item)
        self.open = key
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                 item={**item, "status": "in_progress"} if "status" in item else item))
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0,
                                     part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def piece(self, text: str) -> str:
        item, index = self.items[-1], len(self.items) - 1
        if item["type"] == "reasoning":
            item["content"][0]["text"] += text
            return self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                              content_index=0, delta=text)
        if item["type"] == "message":
            item["content"][0]["text"] += text
            return self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                              content_index=0, delta=text, logprobs=[])
        item["arguments"] += text
        return self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=text)

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        item, index = self.items[-1], len(self.items) - 1
        events = []
        if item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"], logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, arguments=item["arguments"]))
        item["status"] = "completed"
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


async def stream_from_chat(chunks, req: ResponsesRequest, model: str):
    """The chat completion's SSE chunks (one choice) as the Responses API's stream of events."""
    out = _EventWriter()
    rid, created = f"resp_{_ids()}", int(time.time())
    usage, finish, calls = None, None, {}
    yield out.event("response.created", response=_envelope(req, rid, created, model, "in_progress", [], None, None))
    yield out.event("response.in_progress", response=_envelope(req, rid, created, model, "in_progress", [], None,
                                                               None))
    async for chunk in chunk_payloads(chunks):
        if "error" in chunk and "choices" not in chunk:  # the chat stream's error event
            for event in out.close():
                yield event
            yield out.event("error", code=str(chunk["error"].get("code")), message=str(chunk["error"].get("message")),
                            param=None)
            return
        if chunk.get("usage"):
            usage = _usage(chunk["usage"]["prompt_tokens"], chunk["usage"]["completion_tokens"])
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            events: list[str] = []
            if delta.get("reasoning_content"):
                if out.open != "reasoning":
                    events += out.start("reasoning", {"type": "reasoning", "id": f"rs_{_ids()}", "summary": [],
                                                      "content": [{"type": "reasoning_text", "text": ""}]})
                events.append(out.piece(delta["reasoning_content"]))
            if delta.get("content"):
                if out.open != "message":
                    events += out.start("message", {**_message_item(""), "status": "in_progress"})
                events.append(out.piece(delta["content"]))
            for call in delta.get("tool_calls") or []:
                k = call.get("index", 0)
                fn = call.get("function") or {}
                if k not in calls:
                    calls[k] = call.get("id") or f"call_{_ids()}"
                    events += out.start(f"call:{k}", {"type": "function_call", "id": f"fc_{_ids()}",
                                                      "call_id": calls[k], "name": fn.get("name", ""),
                                                      "arguments": "", "status": "in_progress"})
                if fn.get("arguments"):
                    events.append(out.piece(fn["arguments"]))
            if choice.get("finish_reason") is not None:
                finish = choice["finish_reason"]
            for event in events:
                yield event
    for event in out.close():
        yield event
    final = _envelope(req, rid, created, model, "completed", out.items, usage, finish)
    yield out.event("response.completed" if final["status"] == "completed" else "response.incomplete",
                    response=final)
