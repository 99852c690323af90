"""Prometheus metrics with vLLM's names under the `pagedllm:` prefix (dashboards port by renaming)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.stats import EngineStats
from pagedllm.outputs import PoolingRequestOutput, RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class EngineMetrics:
    """Collectors in their own registry; `on_step` runs on the engine thread after every step."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes etc., as vLLM's /metrics has
        labels = ["model_name"]
        r, p = self.registry, "pagedllm:"

        def gauge(name, doc):
            return Gauge(p + name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(p + name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc):
            return Histogram(p + name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        # One counter, a series per kind: sum over `mode` is vLLM's num_preemptions.
        preemptions = Counter(p + "num_preemptions", "Preemptions since start, by mode (swap or recompute).",
                              labels + ["mode"], registry=r)
        self.preemptions = {mode: preemptions.labels(model_name, mode) for mode in ("swap", "recompute")}
        self.swapped = gauge("num_requests_swapped", "Requests swapped out to the host (swap) pool.")
        self.swap_usage = gauge("swap_usage_perc", "Fraction of the host (swap) pool's blocks in use (0-1).")
        self.swapped_out_blocks = counter("swapped_out_blocks", "KV blocks copied to the host pool.")
        self.swapped_in_blocks = counter("swapped_in_blocks", "KV blocks copied back from the host pool.")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.mm_cache_queries = counter("mm_cache_queries", "Multi-modal cache queries, in items (reference audio).")
        self.mm_cache_hits = counter("mm_cache_hits", "Multi-modal cache hits, in items (reference audio).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = Counter(p + "request_success", "Finished requests by finish reason.",
                               labels + ["finished_reason"], registry=r)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        self.batch_size = Histogram(p + "iteration_num_sequences", "Sequences in one engine step.", labels,
                                    buckets=(1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256), registry=r
                                    ).labels(model_name)
        self.grammar_compile = Histogram(p + "structured_output_compile_seconds",
                                         "Time to compile a structured output's grammar (cache misses).", labels,
                                         buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5), registry=r
                                         ).labels(model_name)
        self.grammar_bitmask = counter("structured_output_bitmask_seconds",
                                       "Time spent filling structured outputs' token bitmasks.")
        # Speculative decoding (vLLM's names): verify passes, draft tokens checked, drafts kept, kept by position.
        self.spec_drafts = counter("spec_decode_num_drafts", "Requests' drafts checked (one per request per step).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens checked by the target.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens the target kept.")
        self.spec_accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens kept, by their position among a request's drafts.",
                                             labels + ["position"], registry=r)
        self.spec_steps = Counter(p + "spec_decode_steps", "Steps with drafts, by whether the rule let them be "
                                  "checked (on) or ran without them (off).", labels + ["decision"], registry=r)
        self._model_name = model_name
        self._tokens: dict[str, int] = {}
        self._last_time: dict[str, float] = {}
        self._seen: dict[str, int] = {}  # counter name -> the engine's total at the last step
        self._seen_prefix = (0, 0)  # (queries, hits)

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput], now: float) -> None:
        stats = engine.stats()
        self._set_gauges(stats)
        self._on_preemptions(stats)
        prefix = stats.prefix_cache
        self.prefix_queries.inc(prefix.queries - self._seen_prefix[0])
        self.prefix_hits.inc(prefix.hits - self._seen_prefix[1])
        self._seen_prefix = (prefix.queries, prefix.hits)
        self.batch_size.observe(engine.last_step_num_requests)
        self._on_structured_outputs(engine)
        self._on_spec_decode(engine)
        for out in outputs:
            rid = out.request_id
            if isinstance(out, PoolingRequestOutput):  # a pooled prompt: no generated token, one request done
                self.e2e.observe(now - out.metrics["arrival_time"])
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.success.labels(self._model_name, "stop").inc()
                continue
            produced = sum(len(c.token_ids) for c in out.outputs)
            new = produced - self._tokens.get(rid, 0)
            if new > 0:
                self.generation_tokens.inc(new)
                if rid in self._last_time:
                    self.itl.observe(now - self._last_time[rid])
                else:
                    self.ttft.observe(now - out.metrics["arrival_time"])
                    if out.metrics.get("first_scheduled_time") is not None:
                        self.queue_time.observe(out.metrics["first_scheduled_time"] - out.metrics["arrival_time"])
                self._last_time[rid] = now
                self._tokens[rid] = produced
            if out.finished:
                self.e2e.observe(now - out.metrics["arrival_time"])
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                for c in out.outputs:
                    self.success.labels(self._model_name, c.finish_reason or "abort").inc()
                self._tokens.pop(rid, None)
                self._last_time.pop(rid, None)

    def _on_structured_outputs(self, engine: LLMEngine) -> None:
        grammars = engine.structured_outputs
        if not grammars.started:
            return
        for seconds in grammars.compiler.take_compile_times():
            self.grammar_compile.observe(seconds)
        self.grammar_bitmask.inc(grammars.bitmask_seconds - self._seen.get("bitmask_seconds", 0.0))
        self._seen["bitmask_seconds"] = grammars.bitmask_seconds

    def _on_spec_decode(self, engine: LLMEngine) -> None:
        spec = engine.spec_decode_stats
        if spec is None:
            return
        self._advance(self.spec_drafts, "spec_drafts", spec.num_drafts)
        self._advance(self.spec_draft_tokens, "spec_draft_tokens", spec.num_draft_tokens)
        self._advance(self.spec_accepted_tokens, "spec_accepted", spec.num_accepted_tokens)
        for position, kept in enumerate(spec.accepted_per_position):
            self._advance(self.spec_accepted_per_pos.labels(self._model_name, str(position)), f"spec_pos{position}", kept)
        self._advance(self.spec_steps.labels(self._model_name, "on"), "spec_on", spec.steps_on)
        self._advance(self.spec_steps.labels(self._model_name, "off"), "spec_off", spec.steps_off)

    def _on_preemptions(self, stats: EngineStats) -> None:
        pre, swap = stats.preemptions, stats.swaps
        self._advance(self.preemptions["swap"], "swap", pre.swap)
        self._advance(self.preemptions["recompute"], "recompute", pre.recompute)
        self._advance(self.swapped_out_blocks, "out", swap.swapped_out_blocks)
        self._advance(self.swapped_in_blocks, "in", swap.swapped_in_blocks)

    def _advance(self, counter, key: str, total: int) -> None:
        """Move a Prometheus counter up to the engine's running total."""
        counter.inc(total - self._seen.get(key, 0))
        self._seen[key] = total

    def on_mm_cache_lookup(self, hit: bool) -> None:
        """A lookup in the cache of encoded reference audio (called on the event loop)."""
        self.mm_cache_queries.inc()
        if hit:
            self.mm_cache_hits.inc()

    def _set_gauges(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.swapped.set(stats.num_swapped)
        self.kv_usage.set(stats.kv_cache.usage)
        self.swap_usage.set(stats.swap_usage)

    def on_abort(self, engine: LLMEngine, request_id: str) -> None:
        """An aborted request (on the engine thread): its bookkeeping dropped (it produces no final output), and
        the gauges set again. The last requests of a busy server may all end by abort, after which no step runs:
        without this, an idle server would show their running count and blocks until the next request."""
        self._tokens.pop(request_id, None)
        self._last_time.pop(request_id, None)
        self._set_gauges(engine.stats())
