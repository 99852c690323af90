"""Completions and chat completions: requests -> engine streams -> OpenAI responses and SSE chunks."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestAbortedError
from pagedllm.entrypoints.openai.bodies import (
    Body,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)
from pagedllm.entrypoints.openai.errors import APIError, error_body, param_of
from pagedllm.entrypoints.openai.guard import RETRY_AFTER_S
from pagedllm.entrypoints.openai.generation_defaults import GenerationDefaults
from pagedllm.entrypoints.openai.limits import RequestLimits
from pagedllm.entrypoints.openai.request_templates import FLAG as TRUST_TEMPLATE_FLAG
from pagedllm.entrypoints.openai.request_templates import RequestTemplateError, RequestTemplateRenderer
from pagedllm.entrypoints.openai.chat_stream import (
    ChoiceStreamer,
    TextCursor,
    answer_of,
    chat_logprobs,
    json_logprob,
    streamer_for,
)
from pagedllm.entrypoints.openai.harmony import harmony_to_text
from pagedllm.entrypoints.openai.reasoning import HARMONY_PARSERS, opens_reasoning, reasoning_end
from pagedllm.entrypoints.openai.tool_calls import SPECIAL_TOKEN_PARSERS
from pagedllm.entrypoints.openai.tool_use import ToolUse
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.errors import InvalidParameterError, InvalidPromptError
from pagedllm.isolated_worker import WorkerCancelled
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


# A prompt longer than this many characters per token of max_model_len is measured on a prefix first: text
# that can never fit is refused without tokenizing all of it.
_CHARS_PER_TOKEN_CHECK = 8


@dataclass
class Admission:
    """A request counted against --max-waiting-requests while it is prepared (ServingContext.admit); released
    once, when it is handed to the engine or given up (a `with` block releases it at the latest)."""

    ctx: ServingContext
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.ctx.num_admitting -= 1

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass
class ServingContext:
    engine: AsyncLLMEngine
    served_names: list[str]
    max_model_len: int
    chat_template: str | None = None
    max_waiting_requests: int | None = None  # --max-waiting-requests; None: no limit
    tool_call_parser: str | None = None  # with --enable-auto-tool-choice: how tool_choice auto's replies are read
    # Tokenization and chat templates run here, off the engine thread and the event loop; one worker, so
    # the tokenizer is never used by two of them at once.
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenizer"))
    # Work one request can make long (its grammar's compile, its own chat template) waits on worker processes
    # from these threads: never on the tokenizer's, so other requests' prompts never queue behind it.
    isolated_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="pagedllm-isolated"))
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Requests' own chat templates: None refuses them (400), else they render in its worker process.
    request_templates: RequestTemplateRenderer | None = None
    # --generation-config / --override-generation-config: sampling defaults, and a cap on max_tokens.
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    reasoning_parser: str | None = None  # --reasoning-parser: think blocks go to reasoning_content (reasoning.py)
    # --structured-outputs-config enable_in_reasoning: a constraint applies to the reasoning too (default: after it)
    constrain_reasoning: bool = False

    def require_generate(self, api: str) -> None:
        """The generation APIs need the generate runner: a pooling model's server refuses them by name."""
        pooler = self.engine.engine.config.model.pooler
        if pooler is not None:
            raise APIError(400, f"The model does not support the {api} API: this server runs the pooling runner "
                                f"({pooler.describe()}): /v1/embeddings, /v1/score and /v1/rerank. Serve a "
                                f"generative model (or this one with --runner generate) to generate.", "model")

    def model_name(self, requested: str | None) -> str:
        if requested is None or requested == "":
            return self.served_names[0]
        if requested not in self.served_names:
            raise APIError(404, f"The model `{requested}` does not exist. Served: {', '.join(self.served_names)}.",
                           "model")
        return requested

    # Requests admitted (past the --max-waiting-requests check) whose prompts are still being tokenized or
    # rendered, not yet in the engine's queue. Touched on the event loop only.
    num_admitting: int = 0

    def admit(self) -> Admission:
        """Back-pressure: 503 with Retry-After once --max-waiting-requests requests wait to be scheduled. A
        request counts from its admission here (before its prompt is tokenized) until it is handed to the engine
        (Admission.release, with no await before the engine counts it), then in the engine's count until it is
        scheduled: never twice, never not at all, so of a burst exactly the overflow is refused."""
        limit = self.max_waiting_requests
        if limit is not None and self.engine.num_waiting + self.num_admitting >= limit:
            raise APIError(503, f"The server is at capacity: {limit} requests are waiting to be scheduled "
                                f"(--max-waiting-requests). Retry later.", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.num_admitting += 1
        return Admission(self)

    def _tokenizer(self):
        tokenizer = self.engine.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer (its folder has no tokenizer files), so prompts must "
                                "be token ids", "prompt")
        return tokenizer

    async def run(self, fn, *args):
        """fn(*args) on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    async def tokenize(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt, off the engine thread, refused first if it cannot fit (refuse_if_too_long)."""
        check_text(text, param)
        tokenizer = self._tokenizer()
        await self.refuse_if_too_long(text, param, add_special_tokens)
        return await self.run(lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def refuse_if_too_long(self, text: str, param: str, add_special_tokens: bool = True) -> None:
        """Text over _CHARS_PER_TOKEN_CHECK characters per token of max_model_len is measured on such a prefix
        first, and refused if that alone does not fit: megabytes of text are never tokenized whole."""
        limit = self.max_model_len * _CHARS_PER_TOKEN_CHECK
        if len(text) > limit:
            tokenizer = self._tokenizer()
            head = await self.run(lambda: len(tokenizer.encode(text[:limit], add_special_tokens=add_special_tokens)))
            if head >= self.max_model_len:
                raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; the "
                                    f"{param} is longer: its first {limit} of {len(text)} characters alone are "
                                    f"{head} tokens.", param)

    async def isolated(self, fn, raw: Request | None, *args):
        """fn(*args, cancel) on the isolated pool. The client leaving (`raw`) or this task's cancellation (the
        server stopping) sets `cancel`, which kills the worker process doing the work."""
        cancel = threading.Event()
        work = asyncio.get_running_loop().run_in_executor(self.isolated_pool, lambda: fn(*args, cancel))
        try:
            return await (unless_disconnected(work, raw) if raw is not None else work)
        except (WorkerCancelled, asyncio.CancelledError):  # the kill, or uvicorn ending the task first (a busy host)
            raise APIError(503, "the server is shutting down: this request was ended before it started",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        finally:
            cancel.set()

    async def compile_constraint(self, params: SamplingParams | PoolingParams, raw: Request | None = None) -> None:
        """A structured output's grammar, compiled off the engine thread (the engine then finds it cached);
        an invalid schema, regex or grammar, or one over a limit, is a 400 naming its field."""
        if getattr(params, "guided_decoding", None) is None:  # (a pooling request samples nothing)
            return
        try:
            await self.isolated(self.engine.engine.structured_outputs.compile, raw, params.guided_decoding)
        except InvalidParameterError as e:
            raise APIError(400, str(e), e.param) from None

    async def render_chat(self, messages: list[dict], template: str | None, add_generation_prompt: bool,
                          tools: list[dict] | None = None, request_template: str | None = None,
                          raw: Request | None = None, template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """The conversation (and tools) through the chat template -> (text, token ids), off the engine thread.
        Messages that alone cannot fit are refused before any template runs. A `request_template` (the
        request's own) renders in a worker process, and only where the server trusts request templates."""
        contents = "".join(m["content"] for m in messages if isinstance(m.get("content"), str))
        await self.refuse_if_too_long(contents, "messages", add_special_tokens=False)
        engine = self.engine.engine
        if request_template is not None:
            if self.request_templates is None:
                raise APIError(400, f"chat_template in a request is refused: a template is a program run on the "
                                    f"server, and this one was not started with {TRUST_TEMPLATE_FLAG}. Leave "
                                    f"chat_template out to use the model's template.", "chat_template")
            try:
                text = await self.isolated(self.request_templates.render, raw, request_template, messages, tools,
                                           add_generation_prompt, template_kwargs)
            except RequestTemplateError as e:
                raise APIError(400, str(e), "chat_template") from None
            await self.refuse_if_too_long(text, "messages", add_special_tokens=False)
            tokenizer = self._tokenizer()
            return text, await self.run(lambda: tokenizer.encode(text, add_special_tokens=False))
        try:
            return await self.run(engine.apply_chat_template, messages, template, add_generation_prompt, tools,
                                  template_kwargs)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        except Exception as e:  # a template that fails to render on these messages
            raise APIError(400, f"the chat template failed on these messages: {e}", "messages") from None




def _after_reasoning(ctx: ServingContext, params: SamplingParams, prompt: str) -> SamplingParams:
    """Under a reasoning parser, a constraint (a structured output, a tool_choice that constrains) applies to the
    answer: it starts after the tokens that end the reasoning, unless the prompt already ended it."""
    constraint = params.guided_decoding
    if ctx.reasoning_parser is None or constraint is None or ctx.constrain_reasoning:
        return params
    marker = reasoning_end(ctx.reasoning_parser, prompt)
    if marker is None:
        return params
    ids = ctx._tokenizer().encode(marker, add_special_tokens=False)
    return params.clone(guided_decoding=dataclasses.replace(constraint, start_after=tuple(ids)))


def _sampling_params(ctx: ServingContext, req, max_tokens: int | None, logprobs: int | None, default_max_tokens,
                     logprobs_param: str = "logprobs") -> SamplingParams:
    for param, why in req.unsupported():
        raise APIError(400, why, param)
    try:
        ctx.engine.engine.check_priority(req.priority)
        ctx.generation_defaults.fill(req)
        max_tokens = ctx.generation_defaults.cap_max_tokens(max_tokens)
        params = req.to_sampling_params(max_tokens, logprobs, default_max_tokens)
    except ValueError as e:
        raise APIError(400, str(e), param_of(e)) from None
    # Values SamplingParams accepts but the server cannot serve: an n of 2**70 would stall the
    # engine thread creating samples; logprobs past --max-logprobs are refused as the request names them.
    config = ctx.engine.engine.config
    if params.n > config.scheduler.max_num_seqs:
        raise APIError(400, f"n must be at most {config.scheduler.max_num_seqs} (the server's --max-num-seqs), "
                            f"got {params.n}.", "n")
    most = config.model.max_logprobs
    for param, value in ((logprobs_param, params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
        if value is not None and value > most:
            raise APIError(400, f"{param} must be at most {most} (the server's --max-logprobs), got {value}.", param)
    return params


def _sse(obj: Body | dict | str) -> str:
    """One server-sent event: a body, an error (a dict from error_body) or "[DONE]"."""
    if isinstance(obj, Body):
        return obj.sse()
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the outputs of several prompts' streams as they come."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(raw: Request) -> None:
    """Returns when the client goes away (the body was already read, so the next message says so)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(streams: list[AsyncIterator[RequestOutput]], raw: Request) -> list[RequestOutput]:
    """Final outputs of every prompt; a client disconnect cancels (and so aborts) them all."""
    async def final(stream):
        last = None
        async for out in stream:
            last = out
        return last

    return await unless_disconnected(asyncio.gather(*(final(s) for s in streams)), raw)


async def unless_disconnected(awaitable, raw: Request):
    """The awaitable's result; a client disconnect first cancels it (aborting its requests): 499."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(until_disconnect(raw))
    try:
        await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise APIError(499, "client disconnected")
    return work.result()


def _with_cache_salt(prompt: str | dict, cache_salt: str | None) -> str | dict:
    if cache_salt is None:
        return prompt
    return {**({"prompt": prompt} if isinstance(prompt, str) else prompt), "cache_salt": cache_salt}


async def _start(ctx: ServingContext, prefix: str, prompts: list, params: SamplingParams | PoolingParams,
                 cache_salt: str | None = None, priority: int = 0,
                 admission: Admission | None = None, raw: Request | None = None,
                 prompt_param: str = "prompt") -> list[AsyncIterator[RequestOutput]]:
    """Submit every prompt (text tokenized off the engine thread first); the first invalid one aborts those
    already submitted and raises 400. Admitted here (ctx.admit) unless the caller already was (`admission`)."""
    try:
        ctx.engine.engine.check_priority(priority)  # before any work on the prompts
    except InvalidParameterError as e:
        raise APIError(400, str(e), e.param) from None
    with admission or ctx.admit() as admission:
        await ctx.compile_constraint(params, raw)
        prompts = [{"prompt": p, "prompt_token_ids": await ctx.tokenize(p)} if isinstance(p, str) else p
                   for p in prompts]
        admission.release()  # the engine counts the request from its add_request on: no await in between
    base = f"{prefix}-{uuid.uuid4().hex}"
    ids, streams = [], []
    try:
        for i, prompt in enumerate(prompts):
            prompt = _with_cache_salt(prompt, cache_salt)
            ids.append(f"{base}-{i}")
            streams.append(await ctx.engine.add_request(ids[-1], prompt, params, strict_length=True,
                                                        priority=priority))
    except ValueError as e:  # InvalidPromptError and other bad input
        for rid in ids:
            ctx.engine.abort(rid)
        param = prompt_param if isinstance(e, InvalidPromptError) else param_of(e)
        raise APIError(400, str(e), param) from None
    return streams


def stream_error(e: Exception) -> dict:
    """The error event of a stream that cannot go on: 503 when the server ended it (shutdown) or the engine
    stopped, else 500."""
    if isinstance(e, (RequestAbortedError, EngineDeadError)):
        return error_body(503, str(e))
    return error_body(500, f"generation failed: {e}")


def check_text(text: str, param: str) -> str:
    """JSON can carry lone surrogates ("\\ud800"), which are not text: the tokenizer raises a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} is not valid Unicode: {e.reason} at character {e.start}", param) from None
    return text


def _completion_prompts(prompt, param: str = "prompt") -> list:
    """A text, texts, token ids or lists of them (the `prompt` of completions, the `input` of embeddings) as the
    engine's prompts."""
    if isinstance(prompt, str):
        return [check_text(prompt, param)]
    if not prompt:
        raise APIError(400, f"{param} must not be empty", param)
    if all(isinstance(t, int) for t in prompt):
        return [{"prompt_token_ids": prompt}]
    if all(isinstance(p, str) for p in prompt):
        return [check_text(p, param) for p in prompt]
    return [{"prompt_token_ids": p} for p in prompt]


def _completion_logprobs(entries, decode_token, first_offset: int = 0) -> CompletionLogprobs:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset. `decode_token(id)`: the
    text of a token that has no logprob entry (the first prompt token of an echo), which is still a token."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = first_offset
    for k, (token_id, entry) in enumerate(entries):
        if entry is None:  # the first prompt token has no logprob (nothing before it), but it has its text
            text = decode_token(token_id)
            tokens.append(text)
            token_lps.append(None)
            tops.append(None)
            offsets.append(offset)
            offset += len(text)
            continue
        chosen = entry[token_id]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_lps.append(json_logprob(chosen.logprob))
        tops.append({(lp.decoded_token or ""): json_logprob(lp.logprob) for lp in entry.values()})
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets)


def _chunk_usage(options):
    """What a stream's chunks carry besides their choices: with stream_options.include_usage, "usage": null
    (the totals come in a last chunk of their own), or with continuous_usage_stats the counts so far (vLLM)."""
    def field(out: RequestOutput | None) -> dict:
        """The chunk's keyword arguments: none (no usage field), or usage."""
        if options is None or not (options.include_usage or options.continuous_usage_stats):
            return {}
        if options.continuous_usage_stats and out is not None:
            return {"usage": _usage([out])}
        return {"usage": None}

    return field


def _usage(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs if o is not None)
    completion = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request):
    model = ctx.model_name(req.model)
    prompts = _completion_prompts(req.prompt)
    params = _sampling_params(ctx, req, req.max_tokens, req.logprobs, 16)
    if req.echo and req.logprobs is not None:
        params = params.clone(prompt_logprobs=req.logprobs)
    ctx.limits.check(params, len(prompts), params.max_tokens or ctx.max_model_len)
    streams = await _start(ctx, "cmpl", prompts, params, req.cache_salt, req.priority, raw=raw)
    created, rid, n = int(time.time()), f"cmpl-{uuid.uuid4().hex}", params.n

    tokenizer = ctx.engine.engine.tokenizer

    def decode_token(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else ""

    def echo_entries(out: RequestOutput):
        ids = out.prompt_token_ids
        return list(zip(ids, out.prompt_logprobs or [None] * len(ids)))

    def prompt_text(out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""

    if not req.stream:
        outputs = await _collect(streams, raw)
        choices = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                text, entries = c.text, list(zip(c.token_ids, c.logprobs or []))
                if req.echo:
                    text = prompt_text(out) + text
                    entries = echo_entries(out) + entries
                logprobs = _completion_logprobs(entries, decode_token) if req.logprobs is not None else None
                choices.append(CompletionChoice(index=i * n + c.index, text=text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=_usage(outputs))

    usage_field = _chunk_usage(req.stream_options)

    async def events():
        cursors: dict[tuple[int, int], TextCursor] = {}
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in _merge(streams):
                for c in out.outputs:
                    key = (i, c.index)
                    first = key not in cursors
                    cur = cursors.setdefault(key, TextCursor(params.stop))
                    delta, t0, t1 = cur.advance(c)
                    entries = list(zip(c.token_ids[t0:t1], (c.logprobs or [])[t0:t1]))
                    if first and req.echo:
                        delta = prompt_text(out) + delta
                        entries = echo_entries(out) + entries
                    if not delta and not entries and t1 == t0 and not c.finished():
                        continue  # nothing new (a token's text may still be held back: it is sent later)
                    logprobs = _completion_logprobs(entries, decode_token) if req.logprobs is not None else None
                    choice = CompletionChoice(index=i * n + c.index, text=delta, logprobs=logprobs,
                                              finish_reason=c.finish_reason if c.finished() else None,
                                              stop_reason=c.stop_reason)
                    yield _sse(CompletionResponse(id=rid, created=created, model=model, choices=[choice],
                                                  **usage_field(out)))
                if out.finished:
                    finals[i] = out
            if req.stream_options and req.stream_options.include_usage:
                yield _sse(CompletionResponse(id=rid, created=created, model=model, choices=[],
                                              usage=_usage(list(finals.values()))))
        except Exception as e:  # an error after the stream started: an error chunk, then [DONE]
            yield _sse(stream_error(e))
        yield _sse("[DONE]")

    return events()


def _messages(req: ChatCompletionRequest) -> list[dict]:
    messages = []
    for k, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text":
                    raise APIError(400, f"messages[{k}].content: part type {part.get('type')!r} is not supported "
                                        f"(only 'text')", "messages")
                parts.append(part.get("text", ""))
            content = "".join(parts)
        message = {"role": m.role, "content": content or ""}
        extra = m.model_extra or {}
        if extra.get("tool_calls"):  # an assistant's earlier calls: templates want the arguments as objects
            message["tool_calls"] = [_call_for_template(call) for call in extra["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if extra.get(key) is not None or getattr(m, key, None) is not None:
                message[key] = extra.get(key, getattr(m, key, None))
        messages.append(message)
    return messages


def _call_for_template(call) -> dict:
    if not isinstance(call, dict):
        return call
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            pass
    return {**call, "function": fn}


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request):
    model = ctx.model_name(req.model)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling_params(ctx, req, max_tokens, logprobs, None, "top_logprobs")
    tools = ToolUse.of(req, ctx.tool_call_parser)
    if tools.constraint is not None:
        if params.guided_decoding is not None:
            raise APIError(400, f"tool_choice {tools.choice!r} constrains the reply, and so does "
                                f"{params.guided_decoding.param}: give one", "tool_choice")
        params = params.clone(guided_decoding=tools.constraint)
    if tools.active and tools.constraint is None and tools.parser in SPECIAL_TOKEN_PARSERS:
        params = params.clone(skip_special_tokens=False)  # (the parser's call marker is a special token)
    harmony = ctx.reasoning_parser in HARMONY_PARSERS
    if harmony:  # its channels are special tokens: the reply is read with them, then rewritten (harmony.py)
        params = params.clone(skip_special_tokens=False, spaces_between_special_tokens=False)
    messages = _messages(req)
    ctx.limits.check(params, 1, params.max_tokens or ctx.max_model_len, "top_logprobs")
    with ctx.admit() as admission:
        text, ids = await ctx.render_chat(messages, ctx.chat_template, req.add_generation_prompt, tools.rendered,
                                          req.chat_template, raw, req.chat_template_kwargs)
        params = _after_reasoning(ctx, params, text)
        streams = await _start(ctx, "chatcmpl", [{"prompt": text, "prompt_token_ids": ids}], params, req.cache_salt,
                               req.priority, admission, raw)
    created, rid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
    # Whether the template opened a think block (harmony's rewrite opens its own).
    in_reasoning = ctx.reasoning_parser is not None and not harmony and opens_reasoning(text)

    def reply(c: CompletionOutput) -> CompletionOutput:
        """The sample as the reasoning parser reads it: a harmony reply rewritten as think block and answer."""
        return dataclasses.replace(c, text=harmony_to_text(c.text, c.finished())) if harmony else c

    if not req.stream:
        (out,) = await _collect(streams, raw)
        choices = []
        for c in out.outputs:
            c = reply(c)
            answer, reasoning = answer_of(c, in_reasoning) if ctx.reasoning_parser else (c, None)
            message, finish = tools.reply(answer)
            if ctx.reasoning_parser:
                message.reasoning_content = reasoning
            choices.append(ChatChoice(index=c.index, message=message,
                                      logprobs=chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                                      if req.logprobs else None, finish_reason=finish, stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices, usage=_usage([out]))

    usage_field = _chunk_usage(req.stream_options)
    current: list[RequestOutput] = []  # the output the chunks being written come from

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        extra = {"usage": usage} if usage is not None else usage_field(current[-1] if current else None)
        return _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, **extra))

    async def events():
        streamers: dict[int, ChoiceStreamer] = {}
        final = None
        try:
            async for _, out in _merge(streams):
                current.append(out)
                del current[:-1]
                for c in map(reply, out.outputs):
                    if c.index not in streamers:
                        streamers[c.index] = streamer_for(c.index, tools, params.stop,
                                                          (req.top_logprobs or 0) if req.logprobs else None,
                                                          ctx.reasoning_parser is not None, in_reasoning)
                        yield chunk([streamers[c.index].opening()])
                    for choice in streamers[c.index].chunks(c):
                        yield chunk([choice])
                if out.finished:
                    final = out
            if req.stream_options and req.stream_options.include_usage and final is not None:
                yield chunk([], _usage([final]))
        except Exception as e:
            yield _sse(stream_error(e))
        yield _sse("[DONE]")

    return events()
