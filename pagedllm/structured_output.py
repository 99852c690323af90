"""Structured outputs with xgrammar (the library vLLM and SGLang use): a request's constraint (a JSON schema,
any JSON object, a regex, a choice of strings, an EBNF grammar) is compiled once into a grammar; the model
runner keeps a matcher per request that advances with its tokens, and before each sampling step fills the
batch's token bitmask and applies it to the logits on the device.

GuidedDecodingParams has vLLM's field names (SamplingParams(guided_decoding=...))."""
from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import InvalidParameterError
from pagedllm.isolated_worker import IsolatedWorker, WorkerCancelled, WorkerOutOfMemory, WorkerTimeout
from pagedllm.structured_output_limits import FLAGS, StructuredOutputLimits

DEFAULT_CACHE_MB = 512  # vLLM's default for VLLM_XGRAMMAR_CACHE_MB


def grammar_cache_limit_bytes() -> int:
    """The compiled grammars kept, in bytes: VLLM_XGRAMMAR_CACHE_MB as in vLLM (default 512 MiB). Least recently
    used first out; a grammar needed again is compiled again."""
    raw = os.environ.get("VLLM_XGRAMMAR_CACHE_MB", str(DEFAULT_CACHE_MB))
    try:
        mib = float(raw)
    except ValueError:
        raise ValueError(f"VLLM_XGRAMMAR_CACHE_MB must be a number of MiB, got {raw!r}") from None
    if mib < 0:
        raise ValueError(f"VLLM_XGRAMMAR_CACHE_MB must be >= 0, got {raw!r}")
    return int(mib * 2**20)


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Exactly one constraint. `param` names the request field it came from (errors name it)."""

    json: str | dict[str, Any] | None = None  # a JSON schema (a dict, or its text)
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF-style, as xgrammar and llama.cpp take it)
    json_object: bool = False  # any JSON object
    param: str = "guided_decoding"
    # The constraint starts after these output tokens (a reasoning model's end of thinking, `</think>`: the server
    # sets it under --reasoning-parser); the output before them is free. None: from the first token.
    start_after: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidParameterError(self.param, f"{self.param} takes exactly one of json, regex, choice, grammar "
                                                    f"or json_object; got {', '.join(given) or 'none'}.")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidParameterError(self.param, "choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec text): what is compiled, and what the cache is keyed by."""
        if self.json is not None:
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json)  # (key order is output order)
            return "json", spec
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "grammar", "root ::= " + " | ".join(json.dumps(c) for c in self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""


def compile_spec(xgr, compiler, kind: str, spec: str):
    """A constraint's (kind, spec) key compiled by an xgrammar GrammarCompiler (here, or in grammar_worker)."""
    if kind == "json":
        return compiler.compile_grammar(_json_schema_grammar(xgr, spec))
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    # json_object: OpenAI's is an object (xgrammar's built-in JSON grammar allows any value)
    return compiler.compile_grammar(_json_schema_grammar(xgr, _ANY_OBJECT))


def grammar_worker(tokenizer_info_json: str):
    """An isolated worker's handler (isolated_worker.py): (kind, spec) -> the bytes its compiled grammar takes
    (the compile is tried there, where it can be stopped; an invalid constraint's reason comes back)."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info_json), max_threads=1,
                                   cache_enabled=False)
    return lambda request: compile_spec(xgr, compiler, *request).memory_size_bytes


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary (the model's logits width), once each, within
    `limits` (checked before any work; with a compile deadline, compiled in a worker process that is killed
    at the deadline or when the compile is cancelled)."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: int = 2,
                 limits: StructuredOutputLimits | None = None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # xgrammar's own cache off: ours is the one that is bounded and measured.
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self.limits = limits or StructuredOutputLimits()
        self.worker = None
        if self.limits.compile_timeout_s is not None:
            self.worker = IsolatedWorker("pagedllm.structured_output:grammar_worker", info.serialize_json(),
                                         self.limits.compile_memory_bytes)
        self._running: set[threading.Event] = set()  # the cancel events of compiles in progress
        self.vocab_size = vocab_size
        self.cache_limit_bytes = grammar_cache_limit_bytes()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()  # the server validates on its threads, the runner compiles on the engine's
        self._compile_times: list[float] = []  # seconds of each compile (cache miss) not yet taken by /metrics

    def compile(self, params: GuidedDecodingParams, cancel: threading.Event | None = None):
        """The compiled grammar; an invalid schema, regex or grammar, or one over a limit, is an
        InvalidParameterError naming the field. Setting `cancel` (or cancel_all) stops a compile in a worker:
        WorkerCancelled."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        kind, spec = key
        self._check_limits(params, kind, spec)
        start = time.perf_counter()
        try:
            compiled = self._compile(kind, spec, cancel)
        except WorkerCancelled:
            raise
        except WorkerTimeout:
            raise InvalidParameterError(params.param, f"{params.param}: the constraint did not compile within "
                                                      f"{self.limits.compile_timeout_s:g} s, this server's limit "
                                                      f"({FLAGS['compile_timeout_s']}); make it simpler (fewer "
                                                      f"properties, alternatives or repetitions).") from None
        except WorkerOutOfMemory:
            raise InvalidParameterError(params.param, f"{params.param}: compiling the constraint needed more than "
                                                      f"{self.limits.compile_memory_bytes / 2**30:g} GiB, this server's "
                                                      f"limit ({FLAGS['compile_memory_bytes']}); make it simpler.") \
                from None
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types with the reason
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(kind, kind)
            raise InvalidParameterError(params.param, f"{params.param}: invalid {what}: "
                                                      f"{str(e).strip().splitlines()[0][:300]}") from None
        with self._lock:
            if len(self._compile_times) < 10_000:
                self._compile_times.append(time.perf_counter() - start)
            if key not in self._cache:
                self._cache[key] = compiled
                self._cache_bytes += compiled.memory_size_bytes
            while self._cache_bytes > self.cache_limit_bytes and self._cache:
                self._cache_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
        return compiled

    def _check_limits(self, params: GuidedDecodingParams, kind: str, spec: str) -> None:
        if params.choice is not None:
            self.limits.check_choice(params.param, params.choice)
        schema = None
        if kind == "json":
            try:
                schema = json.loads(spec)
            except ValueError as e:
                raise InvalidParameterError(params.param, f"{params.param}: invalid JSON schema: {e}") from None
        self.limits.check(params.param, kind, spec, schema)

    def _compile(self, kind: str, spec: str, cancel: threading.Event | None):
        if self.worker is None:
            return compile_spec(self._xgr, self.compiler, kind, spec)
        cancel = cancel or threading.Event()
        with self._lock:
            self._running.add(cancel)
        try:
            # First in the worker, under the deadline and the memory cap; then, known to finish, here. (A
            # compiled grammar cannot come back from the worker: xgrammar's serialized form is ~100x its size
            # in memory and takes ~30x the compile time to write.)
            self.worker.call((kind, spec), self.limits.compile_timeout_s, cancel)
            if cancel.is_set():
                raise WorkerCancelled()
            return compile_spec(self._xgr, self.compiler, kind, spec)
        finally:
            with self._lock:
                self._running.discard(cancel)

    def cancel_all(self) -> None:
        """Stop every compile in progress (the server is shutting down)."""
        with self._lock:
            for event in self._running:
                event.set()

    def shutdown(self) -> None:
        self.cancel_all()
        if self.worker is not None:
            self.worker.shutdown()

    def take_compile_times(self) -> list[float]:
        with self._lock:
            times, self._compile_times = self._compile_times, []
        return times

    @property
    def cache_bytes(self) -> int:
        """Memory the cached compiled grammars hold (at most cache_limit_bytes)."""
        return self._cache_bytes

    def matcher(self, params: GuidedDecodingParams, output_token_ids: list[int]):
        """A matcher for the request, advanced over the tokens it has already generated (a request rebuilt
        after a preemption resumes where its output is)."""
        matcher = self._xgr.GrammarMatcher(self.compile(params))
        for token in output_token_ids:
            if not matcher.accept_token(token):
                break
        return matcher


# xgrammar (0.2.9) writes a string with a maxLength / minLength as characters of [^"\\\r\n], which lets raw
# control characters (U+0000-U+001F) in: not JSON (json.loads refuses them). Its unbounded strings exclude them.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


_ANY_OBJECT = '{"type": "object", "additionalProperties": true}'


def _json_schema_grammar(xgr, schema: str) -> str:
    """The EBNF of a JSON schema (compact: no optional whitespace), every string character JSON allows raw."""
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    return grammar.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


@dataclass
class GrammarState:
    """A request's matcher and how many of its output tokens it has accepted: advanced to the request's output
    before each step it samples in, so any path that adds tokens (a step, a preemption's recompute) keeps it
    in step. `matcher` is None while the constraint waits for its `start_after` tokens (`num_accepted`: the output
    searched for them so far)."""

    matcher: Any
    num_accepted: int = 0


def constraint_start(params: GuidedDecodingParams, output: list[int], searched: int = 0) -> int | None:
    """Where a request's constrained output begins in its output tokens: 0, or just after the first `start_after`
    run; None while that run has not been written (the output is free so far). `searched`: the output's length when
    the run was last looked for (it was not in it)."""
    marker = params.start_after
    if not marker:
        return 0
    n = len(marker)
    for i in range(max(0, searched - n + 1), len(output) - n + 1):
        if tuple(output[i:i + n]) == marker:
            return i + n
    return None


# Up to this many constrained rows a step fills their bitmask rows one by one in the engine's thread: xgrammar's
# batch fill hands them to its own threads, which on a CPU engine wait for cores the model's OpenMP threads hold
# (1.85 ms a step for one 152k-token row against 0.2 ms one by one, 2-core EPYC).
_FILL_ALONE_UP_TO = 8


@dataclass
class GrammarBitmask:
    """A step's structured-output constraint as plain data: the allowed next tokens of the step's constrained
    sampling rows, one bit per token (xgrammar's int32 words). `rows[i]` is the index, among the step's
    sampling requests in scheduled order, of the request bitmask row i is for."""

    rows: list[int]  # (speculative decoding: among the step's sampling rows, one per draft and one after them)
    bitmask: Any  # torch.Tensor (len(rows), ceil(vocab_size / 32)) int32, on the host
    vocab_size: int


def apply_grammar_bitmask(logits, mask: GrammarBitmask) -> None:
    """Masked tokens' logits to -inf, in place (the model runner, on the logits' device)."""
    import torch
    import xgrammar as xgr

    full = torch.zeros(logits.shape[0], mask.bitmask.shape[1], dtype=torch.int32)
    full[mask.rows] = mask.bitmask
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True), vocab_size=mask.vocab_size,
                                    indices=mask.rows)


class StructuredOutputManager:
    """The engine's side of structured outputs: compiles constraints (from any thread: the server validates
    them before a request is queued) and, each step, fills the bitmask of the step's constrained requests from
    their matchers, which live on the engine's requests. The runner only applies it: the bitmask travels
    in the step (StepInput.grammar_bitmask), so every executor applies the same constraint."""

    def __init__(self, tokenizer, vocab_size: int, limits: StructuredOutputLimits | None = None) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits or StructuredOutputLimits()
        self._compiler: GrammarCompiler | None = None
        self._batch = None  # xgrammar's BatchGrammarMatcher, made with the compiler
        self._lock = threading.Lock()
        self.bitmask_seconds = 0.0  # filling bitmasks, since start (/metrics)

    @property
    def compiler(self) -> GrammarCompiler:
        """Made at the first constraint (it reads the tokenizer's vocabulary: ~1 s for 150k tokens)."""
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise InvalidParameterError("guided_decoding", "structured outputs need the model's tokenizer; "
                                                                   "this model has none")
                import xgrammar as xgr

                self._compiler = GrammarCompiler(self._tokenizer, self.vocab_size, limits=self.limits)
                self._batch = xgr.BatchGrammarMatcher(max_threads=2)
            return self._compiler

    @property
    def started(self) -> bool:
        """A constraint has been compiled (the compiler exists)."""
        return self._compiler is not None

    def compile(self, params: GuidedDecodingParams, cancel: threading.Event | None = None):
        return self.compiler.compile(params, cancel)

    def cancel_all(self) -> None:
        """Stop the compiles in progress (a server shutting down)."""
        if self._compiler is not None:
            self._compiler.cancel_all()

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()

    def bitmask(self, requests: list, drafts: list | None = None) -> GrammarBitmask | None:
        """The bitmask for a step whose sampling requests are `requests` (engine Requests, in the step's
        order); None when none of them is constrained (or every constrained one's grammar is complete).

        Speculative decoding: `drafts[i]` are request i's drafts checked this step; it then has a sampling row per
        draft and one after them, each masked as if the drafts before it were accepted (the matcher walks them
        and is rolled back). Rows after a draft the grammar refuses stay unmasked: the target rejects that draft
        (it is masked at its own row), so they are never used."""
        if self._compiler is None or not any(r.sampling_params.guided_decoding for r in requests):
            return None
        drafts = drafts or [()] * len(requests)
        start = time.perf_counter()
        rows, matchers, walks, first_row = [], [], [], 0
        for req, req_drafts in zip(requests, drafts):
            matcher = self._live_matcher(req)
            if matcher is not None:
                if req_drafts:
                    walks.append((matcher, first_row, req_drafts))
                else:
                    rows.append(first_row)
                    matchers.append(matcher)
            first_row += 1 + len(req_drafts)
        walked_rows = [(matcher, row + j, d) for matcher, row, d in walks for j in range(len(d) + 1)]
        if not rows and not walked_rows:
            return None
        bitmask = self._compiler._xgr.allocate_token_bitmask(len(rows) + len(walked_rows), self.vocab_size)
        if len(matchers) > _FILL_ALONE_UP_TO:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        else:  # a few: in this thread (xgrammar's batch fill waits for its threads, here ~1.8 ms a step)
            for i, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(bitmask, i)
        at = len(rows)
        for matcher, row, req_drafts in walks:
            accepted = 0
            for j in range(len(req_drafts) + 1):
                rows.append(row + j)
                if accepted == j:  # the drafts before this row are grammatical: mask it
                    matcher.fill_next_token_bitmask(bitmask, at + j)
                    if j < len(req_drafts) and not matcher.is_terminated() and matcher.accept_token(req_drafts[j]):
                        accepted += 1
            matcher.rollback(accepted)
            at += len(req_drafts) + 1
        self.bitmask_seconds += time.perf_counter() - start
        return GrammarBitmask(rows, bitmask, self.vocab_size)

    def _live_matcher(self, req):
        """The request's matcher advanced to its output, while its output is constrained (None: no constraint, one
        that starts after tokens not written yet, or the grammar is complete)."""
        params = req.sampling_params.guided_decoding
        if params is None:
            return None
        state: GrammarState | None = req.grammar
        output = req.output_token_ids
        if state is None:
            state = req.grammar = GrammarState(None)
        if state.matcher is None:
            start = constraint_start(params, output, state.num_accepted)
            if start is None:  # thinking: the constraint starts after its end marker
                state.num_accepted = len(output)
                return None
            state.matcher, state.num_accepted = self._compiler.matcher(params, output[start:]), len(output)
        for token in output[state.num_accepted:]:
            if state.matcher.is_terminated() or not state.matcher.accept_token(token):
                break
        state.num_accepted = len(output)
        return None if state.matcher.is_terminated() else state.matcher
