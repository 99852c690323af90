"""The server's OpenAPI document, made to tell the truth: what each route answers, with which status codes
and bodies. The response models here describe the dicts the routes build (serving.py, serving_audio.py);
they document, they do not convert (the routes return their dicts as they are)."""
from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """Every error, as OpenAI sends it."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str | None]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """POST /v1/completions; with "stream": true each server-sent event's data is one of these (usage only
    on the last, when stream_options.include_usage), then "[DONE]"."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatAudio(BaseModel):
    id: str
    data: str  # base64 of the audio file
    expires_at: int
    transcript: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None  # in the call's first piece only
    arguments: str  # the next piece of the JSON text


class ToolCallDelta(BaseModel):
    """A piece of a streamed call (as OpenAI): the first has id, type and name; the rest only arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None
    audio: ChatAudio | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatAudioDelta(BaseModel):
    """A chunk of streamed audio: base64 16-bit PCM, mono, at the codec's rate (24 kHz for Higgs Audio v2)."""

    id: str
    data: str
    transcript: str | None = None  # in the first chunk
    expires_at: int | None = None  # in the first chunk


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    audio: ChatAudioDelta | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (then "[DONE]")."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class Voice(BaseModel):
    id: str
    object: Literal["voice"]
    name: str
    format: str
    transcript: str | None


class VoiceList(BaseModel):
    object: Literal["list"]
    data: list[Voice]


class MemoryResponse(BaseModel):
    """The memory plan (`pagedllm plan --json`'s fields) and what the KV cache holds now."""

    model_config = {"extra": "allow"}
    kv_cache_usage: dict[str, Any]
    requests: list[dict[str, Any]]
    num_waiting: int
    num_swapped: int


def json_ok(model: type[BaseModel], description: str) -> dict:
    return {"model": model, "description": description}


def stream_ok(model: type[BaseModel], description: str, chunk: type[BaseModel] | None = None) -> dict:
    """A 200 that is JSON, or with "stream": true server-sent events: each one's data a `chunk` (default:
    `model`) or an error as JSON, the last one "[DONE]"."""
    chunk = chunk or model
    _EVENT_MODELS.update({chunk.__name__: chunk, ErrorResponse.__name__: ErrorResponse})
    data = {"anyOf": [{"const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json",
                       "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                                                   {"$ref": "#/components/schemas/ErrorResponse"}]}}]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data, "event": {"type": "string"}},
             "description": f"one server-sent event: data is a {chunk.__name__} (or an ErrorResponse) as JSON, "
                            f"the last one [DONE]"}
    return {"model": model, "description": description, "content": {"text/event-stream": {"schema": event}}}


_EVENT_MODELS: dict[str, type[BaseModel]] = {}  # models the event streams' documents refer to


def error_responses(*codes: int) -> dict:
    why = {400: "Invalid request (the message says what was wrong and what is allowed)",
           401: "Missing or wrong API key (only when the server has one)",
           404: "No such model (or route)", 413: "Request body over --max-request-body-bytes",
           503: "Draining for shutdown, at --max-waiting-requests, or the engine stopped"}
    return {code: {"model": ErrorResponse, "description": why[code]} for code in codes}


GENERATION = error_responses(400, 401, 404, 413, 503)  # body routes that name a model
TOKENIZER = error_responses(400, 401, 404, 413, 503)
READ_ONLY = error_responses(401, 503)


def truthful_openapi(app: FastAPI, open_paths: frozenset[str], api_key: bool, audio: bool, vocab_size: int) -> dict:
    """FastAPI's document without what the server never sends (422: validation errors are 400s here), with
    each error status's body, (with an API key) the bearer scheme on every route but `open_paths`, and the
    limits of this server's model: token ids below its vocabulary size, and without audio no audio fields."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible API of pagedllm (vLLM's extra fields included).")
    for route, path in doc.get("paths", {}).items():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
            if route in open_paths:
                operation["security"] = []
                operation.get("responses", {}).pop("401", None)
            elif api_key:
                operation["security"] = [{"bearer": []}]
            else:
                operation.get("responses", {}).pop("401", None)
    schemas = doc.get("components", {}).get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    for name, model in _EVENT_MODELS.items():
        if name not in schemas:
            definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(definition.pop("$defs", {}))
            schemas[name] = definition
    tokens = schemas.get("DetokenizeRequest", {}).get("properties", {}).get("tokens", {})
    if "items" in tokens:
        tokens["items"]["maximum"] = vocab_size - 1
    chat = schemas.get("ChatCompletionRequest", {}).get("properties", {})
    if not audio and chat:  # a text model: no audio out, so only "text" and no audio settings
        chat["modalities"] = {"anyOf": [{"type": "array", "items": {"const": "text"}}, {"type": "null"}],
                              "title": "Modalities", "description": "this server's model answers with text only"}
        chat["audio"] = {"type": "null", "title": "Audio", "description": "this server's model has no audio"}
    if api_key:
        doc.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    app.openapi_schema = doc
    return doc
