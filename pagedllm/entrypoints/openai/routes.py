"""The server's routes: the OpenAI-compatible API (completions, chat, audio), the tokenizer's, /health, /version,
/metrics and /v1/memory, with their error handlers and the OpenAPI document they publish. The server's start,
drain and shutdown are in api_server.py."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

from fastapi import Depends, FastAPI, File, Form, Request, UploadFile, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestAbortedError
from pagedllm.entrypoints.openai import serving_audio
from pagedllm.audio.io import AUDIO_CONTENT_TYPES
from pagedllm.entrypoints.openai.audio_args import AudioServerConfig
from pagedllm.entrypoints.openai import messages_api, pooling_api, responses_api
from pagedllm.entrypoints.openai.speech_stream import speech_stream
from pagedllm.entrypoints.openai.errors import APIError, error_response, param_of
from pagedllm.entrypoints.openai.messages_api import (
    MESSAGES_PATHS,
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_body,
)
from pagedllm.entrypoints.openai.guard import RETRY_AFTER_S, ServerGuard, default_max_body_bytes, open_paths
from pagedllm.entrypoints.openai.bodies import (
    Body,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    MemoryResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    TokenizerInfo,
    AudioModel,
    AudioModelList,
    VersionResponse,
    Voice,
    VoiceList,
)
from pagedllm.entrypoints.openai.openapi import (
    GENERATION,
    READ_ONLY,
    TOKENIZER,
    error_responses,
    events_ok,
    json_ok,
    stream_ok,
    truthful_openapi,
)
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SpeechRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.generation_defaults import GenerationDefaults
from pagedllm.entrypoints.openai.limits import RequestLimits
from pagedllm.entrypoints.openai.request_templates import RequestTemplateRenderer
from pagedllm.entrypoints.openai.serving import (
    ServingContext,
    create_chat_completion,
    create_completion,
)
from pagedllm.metrics import EngineMetrics

WEB_DIR = Path(__file__).with_name("web")


def build_app(engine: AsyncLLMEngine, served_names: list[str], api_key: str | None = None,
              chat_template: str | None = None, metrics: EngineMetrics | None = None,
              audio: AudioServerConfig | None = None, max_body_bytes: int | None = None,
              max_waiting_requests: int | None = None, tool_call_parser: str | None = None,
              limits: RequestLimits | None = None, request_templates: RequestTemplateRenderer | None = None,
              body_timeout_s: float = 30.0, metrics_need_key: bool = False,
              generation_defaults: GenerationDefaults | None = None, reasoning_parser: str | None = None,
              constrain_reasoning: bool = False, web_ui: bool = True) -> FastAPI:
    """The API; app.state.guard is the ASGI app to serve (the body limit and draining in front of it)."""
    llm_engine = engine.engine
    max_model_len = llm_engine.config.model.max_model_len
    ctx = ServingContext(engine, served_names, max_model_len, chat_template, max_waiting_requests, tool_call_parser,
                         limits=limits or RequestLimits(), request_templates=request_templates,
                         generation_defaults=generation_defaults or GenerationDefaults(),
                         reasoning_parser=reasoning_parser, constrain_reasoning=constrain_reasoning)
    app = FastAPI(title="pagedllm", version=pagedllm.__version__)
    app.state.guard = guard = ServerGuard(app, max_body_bytes or default_max_body_bytes(max_model_len), api_key,
                                          body_timeout_s, max_prompt_tokens=max_model_len,
                                          open_paths=open_paths(metrics_need_key))
    app.openapi = lambda: truthful_openapi(app, guard.open_paths, api_key is not None, app.state.audio is not None,
                                           llm_engine.config.model.vocab_size, llm_engine.config.model.max_logprobs)
    app.state.audio = None
    if audio is not None and audio.enabled:
        from pagedllm.entrypoints.openai.audio_setup import create_audio_serving

        app.state.audio = create_audio_serving(engine, ctx, audio)
        if metrics is not None:
            app.state.audio.on_cache_lookup = metrics.on_mm_cache_lookup
    with_audio = app.state.audio is not None  # (the audio routes are documented only where they serve)
    # The document names what this server's runner serves: generation, or pooling (the others answer a 400 saying so).
    generates = llm_engine.config.model.pooler is None
    created = int(time.time())

    def serving() -> None:
        if not engine.is_running:
            raise APIError(503, "The engine is not serving (it stopped after an internal error).")

    v1 = [Depends(serving)]  # (the API key is checked by the guard, before the body is read)

    def shaped_error(request: Request, status: int, message: str, param: str | None = None,
                     headers: dict[str, str] | None = None):
        """An error in the shape of the API the path belongs to: Anthropic's on the Messages API, else OpenAI's."""
        if request.url.path in MESSAGES_PATHS:
            return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)
        return error_response(status, message, param, headers)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return shaped_error(request, e.status, e.message, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        parts, param = [], None
        for err in e.errors():
            if err.get("type") == "json_invalid":
                where = err.get("loc", ("body", "?"))[-1]
                detail = (err.get("ctx") or {}).get("error", "malformed JSON")
                return shaped_error(request, 400, f"Invalid JSON in the request body at character {where}: {detail}")
            loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_union_tag(x)]
            param = param or (".".join(loc) or None)
            got = err.get("input")
            shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')} (got {shown[:80]})")
        return shaped_error(request, 400, "Invalid request: " + "; ".join(parts[:5]), param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        # FastAPI's own errors (unknown route, wrong method, a body that is not UTF-8 or nests too
        # deeply to parse) in the OpenAI shape too, not as {"detail": ...}.
        response = shaped_error(request, e.status_code, str(e.detail))
        response.headers.update(e.headers or {})  # e.g. Allow on a 405
        return response

    @app.exception_handler(EngineDeadError)
    async def _dead(request, e: EngineDeadError):
        return shaped_error(request, 503, str(e))

    @app.exception_handler(RequestAbortedError)
    async def _aborted(request, e: RequestAbortedError):
        return shaped_error(request, 503, str(e), headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(ValueError)
    async def _value_error(request, e: ValueError):
        return shaped_error(request, 400, str(e), param_of(e))

    if web_ui:  # the page (web/: static files, no build step, nothing from elsewhere)
        @app.get("/", include_in_schema=False)
        async def index():
            return FileResponse(WEB_DIR / "index.html")

        app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")

    @app.get("/health", response_class=Response,
             responses={200: {"description": "Serving (empty body)", "content": {}}, **error_responses(503)})
    async def health():
        if not engine.is_running:
            return error_response(503, "engine not running")
        if guard.draining:
            return error_response(503, "draining: the server is shutting down",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        return Response(status_code=200)

    app.head("/health", include_in_schema=False)(health)  # load balancers probe with HEAD

    @app.get("/version", responses={200: json_ok(VersionResponse, "The server's version")})
    async def version():
        return JSONBody(VersionResponse(version=pagedllm.__version__))

    @app.get("/metrics", responses={200: {"description": "Prometheus text format",
                                          "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
                                     **error_responses(401)})  # (401 only under --require-api-key-for-metrics)
    async def metrics_endpoint():
        body = generate_latest(metrics.registry) if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=v1, responses={200: json_ok(ModelList, "The served model names"), **READ_ONLY})
    async def models():
        return JSONBody(ModelList(data=[model_card(name) for name in served_names]))

    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, created=created, owned_by="pagedllm", root=str(llm_engine.config.model.path),
                         parent=None, max_model_len=llm_engine.config.model.max_model_len)

    @app.get("/v1/models/{model_id:path}", dependencies=v1,
             responses={200: json_ok(ModelCard, "The model"), **error_responses(401, 404, 503)})
    async def model(model_id: str):
        """OpenAI's models.retrieve (names may hold slashes: "Qwen/Qwen2.5-0.5B")."""
        if model_id not in served_names:
            raise APIError(404, f"The model `{model_id}` does not exist. Served: {', '.join(served_names)}.", "model")
        return JSONBody(model_card(model_id))

    async def respond(result):
        if isinstance(result, Body):
            return JSONBody(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/completions", dependencies=v1, include_in_schema=generates,
              responses={200: stream_ok(CompletionResponse, "The completion"), **GENERATION})
    async def completions(body: CompletionRequest, raw: Request):
        ctx.require_generate("Completions")
        return await respond(await create_completion(ctx, body, raw))

    @app.post("/v1/chat/completions", dependencies=v1, include_in_schema=generates,
              responses={200: stream_ok(ChatCompletionResponse, "The chat completion", ChatCompletionChunk),
                         **GENERATION})
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        ctx.require_generate("Chat Completions")
        if serving_audio.wants_audio(body):
            return await respond(await serving_audio.create_audio_chat_completion(_audio(), body, raw))
        return await respond(await create_chat_completion(ctx, body, raw))

    anthropic_errors = error_responses(400, 401, 404, 413, 503, model=messages_api.AnthropicErrorResponse)

    @app.post("/v1/messages", dependencies=v1, include_in_schema=generates,
              responses={200: events_ok(messages_api.AnthropicMessage, "Anthropic's Messages API: the message",
                                        messages_api.AnthropicEvent), **anthropic_errors})
    async def messages(body: MessagesRequest, raw: Request):
        ctx.require_generate("Messages")
        model = ctx.model_name(body.model)
        reply = await create_chat_completion(ctx, messages_api.chat_request(body), raw)
        if body.stream:
            return StreamingResponse(messages_api.stream_from_chat(reply, body, model), media_type="text/event-stream")
        return JSONResponse(messages_api.message_from_chat(reply, body, model))

    @app.post("/v1/messages/count_tokens", dependencies=v1, include_in_schema=generates,
              responses={200: json_ok(messages_api.CountTokensResponse, "The prompt's tokens"), **anthropic_errors})
    async def count_tokens(body: CountTokensRequest, raw: Request):
        ctx.model_name(body.model)
        messages, tools = messages_api.count_tokens_request(body)
        _, ids = await ctx.render_chat(messages, ctx.chat_template, True, tools, raw=raw)
        return JSONResponse({"input_tokens": len(ids)})

    @app.post("/v1/responses", dependencies=v1, include_in_schema=generates,
              responses={200: events_ok(responses_api.ResponseObject, "The response (stateless: nothing is stored)",
                                        responses_api.ResponseEvent), **GENERATION})
    async def responses(body: responses_api.ResponsesRequest, raw: Request):
        ctx.require_generate("Responses")
        model = ctx.model_name(body.model)
        reply = await create_chat_completion(ctx, responses_api.chat_request(body), raw)
        if body.stream:
            return StreamingResponse(responses_api.stream_from_chat(reply, body, model),
                                     media_type="text/event-stream")
        return JSONResponse(responses_api.response_from_chat(reply, body, model))

    pooling_paths = {"embeddings": ["/v1/embeddings"], "score": ["/v1/score", "/score"],
                     "rerank": ["/v1/rerank", "/rerank", "/v2/rerank"], "classify": ["/classify", "/v1/classify"]}

    async def embeddings(body: pooling_api.EmbeddingRequest, raw: Request):
        return JSONBody(await pooling_api.create_embeddings(ctx, body, raw))

    async def score(body: pooling_api.ScoreRequest, raw: Request):
        return JSONBody(await pooling_api.create_score(ctx, body, raw))

    async def rerank(body: pooling_api.RerankRequest, raw: Request):
        return JSONBody(await pooling_api.create_rerank(ctx, body, raw))

    async def classify(body: pooling_api.ClassificationRequest, raw: Request):
        return JSONBody(await pooling_api.create_classification(ctx, body, raw))

    pooler = llm_engine.config.model.pooler  # (the document names what this pooling model gives)
    serves = {"embeddings": pooler is not None and pooler.task == "embed",
              "score": pooler is not None and pooler.scores, "rerank": pooler is not None and pooler.scores,
              "classify": pooler is not None and pooler.task == "classify"}
    for name, handler, body_model, what in (
            ("embeddings", embeddings, pooling_api.EmbeddingResponse, "The embeddings (a pooling model's)"),
            ("score", score, pooling_api.ScoreResponse, "Each pair's relevance (a cross-encoder's or cosine)"),
            ("rerank", rerank, pooling_api.RerankResponse, "The documents by relevance"),
            ("classify", classify, pooling_api.ClassificationResponse, "Each input's class probabilities")):
        for i, path in enumerate(pooling_paths[name]):  # (vLLM's other spellings, left out of the document)
            app.post(path, dependencies=v1, include_in_schema=i == 0 and serves[name],
                     responses={200: json_ok(body_model, what), **GENERATION})(handler)

    def _audio() -> serving_audio.AudioServing:
        if app.state.audio is None:
            raise APIError(400, f"this server's model ({llm_engine.config.model.architecture}) has no audio: audio "
                                f"input and output need a speech model served with --audio-tokenizer-type")
        return app.state.audio

    audio_file = {"description": "The audio file (or stream)",
                  "content": {t: {"schema": {"type": "string", "format": "binary"}} for t in AUDIO_CONTENT_TYPES}}

    @app.post("/v1/audio/speech", dependencies=v1, include_in_schema=with_audio,
              responses={200: audio_file, **GENERATION})
    async def speech(body: SpeechRequest, raw: Request):
        return await serving_audio.create_speech(_audio(), body, raw)

    @app.get("/v1/audio/voices", dependencies=v1, include_in_schema=with_audio,
             responses={200: json_ok(VoiceList, "The voice presets"), **error_responses(400, 401, 503)})
    async def voices():
        return JSONBody(serving_audio.list_voices(_audio()))

    @app.websocket("/v1/audio/speech/stream")
    async def speech_websocket(ws: WebSocket):
        """Text in as it is written, speech out sentence by sentence (speech_stream.py)."""
        if app.state.audio is None or not engine.is_running:
            await ws.accept()  # (then closed with the reason: a refused handshake would say only 403)
            await ws.close(code=1008, reason="this server has no speech model (--audio-tokenizer-type)"
                           if app.state.audio is None else "the engine is not serving")
            return
        await speech_stream(app.state.audio, ws)

    @app.post("/v1/audio/voices", dependencies=v1, include_in_schema=with_audio,
              responses={200: json_ok(Voice, "The voice, kept in --voice-presets-dir"),
                         **error_responses(400, 401, 409, 413, 503)})
    async def upload_voice(name: Annotated[str, Form(description="the voice's name: letters, digits, _ . -")],
                           audio: Annotated[UploadFile, File(description="the clip (wav, flac, mp3, ogg)")],
                           transcript: Annotated[str, Form(description="what the clip says")]):
        clip = await audio.read()
        return JSONBody(await serving_audio.upload_voice(_audio(), name, clip, audio.filename, transcript))

    @app.delete("/v1/audio/voices/{name}", dependencies=v1, include_in_schema=with_audio,
                responses={200: json_ok(Voice, "The voice removed"), **error_responses(400, 401, 404, 503)})
    async def delete_voice(name: str):
        return JSONBody(await serving_audio.delete_voice_named(_audio(), name))

    @app.get("/v1/audio/models", dependencies=v1, include_in_schema=with_audio,
             responses={200: json_ok(AudioModelList, "The speech model's served names"),
                        **error_responses(400, 401, 503)})
    async def audio_models():
        _audio()
        return JSONBody(AudioModelList(models=[AudioModel(id=name) for name in served_names]))

    @app.post("/tokenize", dependencies=v1, responses={200: json_ok(TokenizeResponse, "Token ids"), **TOKENIZER})
    async def tokenize(body: TokenizeRequest):
        ctx.model_name(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
        if body.messages is not None:
            msgs = [{"role": m.role, "content": m.content if isinstance(m.content, str) else ""}
                    for m in body.messages]
            _, ids = await ctx.render_chat(msgs, chat_template, body.add_generation_prompt)
        else:
            ids = await ctx.tokenize(body.prompt, "prompt", body.add_special_tokens)
        return JSONBody(TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids))

    @app.post("/detokenize", dependencies=v1,
              responses={200: json_ok(DetokenizeResponse, "The text"), **TOKENIZER})
    async def detokenize(body: DetokenizeRequest):
        ctx.model_name(body.model)
        vocab = llm_engine.config.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        tokenizer = ctx._tokenizer()
        return JSONBody(DetokenizeResponse(prompt=await ctx.run(tokenizer.decode, body.tokens)))

    @app.get("/tokenizer_info", dependencies=v1,
             responses={200: json_ok(TokenizerInfo, "The tokenizer's settings"), **READ_ONLY})
    async def tokenizer_info():
        tok = llm_engine.tokenizer  # (attributes only: read here, nothing runs on the engine thread)
        if tok is None:
            return JSONBody(TokenizerInfo(tokenizer=None))
        return JSONBody(TokenizerInfo(
            tokenizer_class=type(tok).__name__, eos_token=tok.eos_token, eos_token_id=tok.eos_token_id,
            bos_token=tok.bos_token, bos_token_id=tok.bos_token_id, pad_token=tok.pad_token,
            pad_token_id=tok.pad_token_id, chat_template=chat_template or getattr(tok, "chat_template", None),
            model_max_length=ctx.max_model_len, vocab_size=llm_engine.config.model.vocab_size))

    @app.get("/v1/memory", dependencies=v1, responses={200: json_ok(MemoryResponse, "Memory plan and KV cache use"),
                                                        **READ_ONLY})
    async def memory():
        def snapshot(e):
            return e.stats(with_requests=True).memory_json()
        return JSONBody(MemoryResponse(**await engine.call(snapshot)))

    return app


class JSONBody(Response):
    """A 200 whose body is one of bodies.py's models, as JSON."""

    media_type = "application/json"

    def __init__(self, body: Body) -> None:
        super().__init__(body.model_dump_json(exclude_unset=True))


def _is_union_tag(part) -> bool:
    """A validation error's location names the member of a union it was tried against ("str", "list[int]");
    the API's `param` is the field, not that."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list", "none") or "[" in part
                                      or part.startswith("constrained-"))  # (a member with a min_length)
