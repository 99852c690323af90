"""Scheduler: which requests advance by how many tokens this step.

There is no prefill phase and no decode phase: every request's computed-token count catches up
with its token count under a per-step token budget, so chunked prefill, decode and recompute
after preemption are one mechanism.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_table: list[int]

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's tokens, so a token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End a request wherever it is (stop string, abort) and return its blocks."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache.free(request)

    # -- the step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(req, n):
                victim = self.running.pop()  # the newest running request gives its blocks back
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, self.kv_cache.block_table(req.request_id)))
                budget -= n
                i += 1

        # New (or preempted) requests join only when nobody had to give blocks back this step.
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv_cache.allocate_slots(req, n):
                break
            self.waiting.popleft()
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, self.kv_cache.block_table(req.request_id)))
            budget -= n
        return out

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the request's K/V; it resumes from its tokens later."""
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance cursors, append sampled tokens, apply token-level stops. Returns finished requests."""
        finished = []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.append_token(token)
            status = self._check_stop(req, token)
            if status is not None:
                self.running.remove(req)
                req.status = status
                self.kv_cache.free(req)
                finished.append(req)
        return finished

    @staticmethod
    def _check_stop(req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:  # the sampler masked stops until then
            if token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
