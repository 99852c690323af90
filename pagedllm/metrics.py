"""Prometheus metrics with vLLM's names under the `pagedllm:` prefix (dashboards port by renaming)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class EngineMetrics:
    """Collectors in their own registry; `on_step` runs on the engine thread after every step."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
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
        self.preemptions = counter("num_preemptions", "Preemptions since start.")
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
        self._model_name = model_name
        self._tokens: dict[str, int] = {}
        self._last_time: dict[str, float] = {}
        self._seen_preemptions = 0

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput], now: float) -> None:
        sched = engine.scheduler
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.kv_usage.set(engine.kv_cache.pool.usage)
        self.preemptions.inc(sched.num_preemptions - self._seen_preemptions)
        self._seen_preemptions = sched.num_preemptions
        self.batch_size.observe(engine.last_step_num_requests)
        for out in outputs:
            rid = out.request_id
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

    def forget(self, request_id: str) -> None:
        """An aborted request produces no final output: drop its bookkeeping."""
        self._tokens.pop(request_id, None)
        self._last_time.pop(request_id, None)
