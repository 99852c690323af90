"""The server's OpenAPI document, made to tell the truth: what each route answers, with which status codes
and bodies (the models of bodies.py, which the routes build their answers from)."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pagedllm.entrypoints.openai.bodies import ErrorResponse


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


def events_ok(model: type[BaseModel], description: str, event: type[BaseModel]) -> dict:
    """A 200 that is JSON, or with "stream": true server-sent events each named and holding an `event` as JSON
    (Anthropic's streams: no [DONE])."""
    _EVENT_MODELS[event.__name__] = event
    data = {"type": "string", "contentMediaType": "application/json",
            "contentSchema": {"$ref": f"#/components/schemas/{event.__name__}"}}
    schema = {"type": "object", "required": ["data", "event"],
              "properties": {"data": data, "event": {"type": "string"}},
              "description": f"one server-sent event: its name, and data a {event.__name__} as JSON"}
    return {"model": model, "description": description, "content": {"text/event-stream": {"schema": schema}}}


def error_responses(*codes: int, model: type[BaseModel] = ErrorResponse) -> dict:
    why = {400: "Invalid request (the message says what was wrong and what is allowed)",
           401: "Missing or wrong API key (only when the server has one)",
           404: "No such model (or route, or voice)", 409: "The name is taken (DELETE it first)",
           413: "Request body over --max-request-body-bytes",
           503: "Draining for shutdown, at --max-waiting-requests, or the engine stopped"}
    return {code: {"model": model, "description": why[code]} for code in codes}


GENERATION = error_responses(400, 401, 404, 413, 503)  # body routes that name a model
TOKENIZER = error_responses(400, 401, 404, 413, 503)
READ_ONLY = error_responses(401, 503)


def truthful_openapi(app: FastAPI, open_paths: frozenset[str], api_key: bool, audio: bool, vocab_size: int,
                     max_logprobs: int) -> dict:
    """FastAPI's document without what the server never sends (422: validation errors are 400s here), with
    each error status's body, (with an API key) the bearer scheme on every route but `open_paths`, and the
    limits of this server: token ids below its vocabulary size, logprobs up to --max-logprobs, and without
    audio no audio fields."""
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
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        fields = schemas.get(request, {}).get("properties", {})
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            for branch in fields.get(name, {}).get("anyOf", []):
                if branch.get("type") == "integer":
                    branch["maximum"] = max_logprobs
    chat = schemas.get("ChatCompletionRequest", {}).get("properties", {})
    if not audio and chat:  # a text model: no audio out, so only "text" and no audio settings
        chat["modalities"] = {"anyOf": [{"type": "array", "items": {"const": "text"}}, {"type": "null"}],
                              "title": "Modalities", "description": "this server's model answers with text only"}
        chat["audio"] = {"type": "null", "title": "Audio", "description": "this server's model has no audio"}
    if api_key:
        doc.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    app.openapi_schema = doc
    return doc
