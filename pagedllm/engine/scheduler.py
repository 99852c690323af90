"""Scheduler: which requests advance by how many tokens this step.

There is no prefill phase and no decode phase: every request's computed-token count catches up
with its token count under a per-step token budget, so chunked prefill, decode and recompute
after preemption are one mechanism.

Preemption: running requests are scheduled in (priority, arrival_time) order; when the device pool
runs out, the one with the largest (priority, arrival_time) among those not yet scheduled this step
(the least important, else the newest) gives its blocks back, by swap (its blocks are
copied to the host pool and come back, computed tokens kept, when blocks free up) or by recompute
(its K/V is dropped and it rejoins the front of the waiting queue). See `_swaps`.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.engine.kv_cache_manager import BlockCopy, KVCacheManager
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.spec_decode.policy import SpeculationPolicy
from pagedllm.step_input import NewRequestData, ScheduledTokens, StepInput


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # the drafts included
    block_tables: list[list[int]]  # one per KV group (kv_layout.py)
    # Speculative decoding: draft tokens after the request's last token, checked by this step's forward.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's tokens, so a token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # by recompute: their K/V is dropped
    swapped_out: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)  # also in `scheduled`
    # K/V block copies the model runner makes before this step's forward: swap-outs first (their
    # device blocks may be written by this step), then swap-ins. A step has one kind or none.
    blocks_to_swap_out: list[BlockCopy] = field(default_factory=list)  # (device block, host block)
    blocks_to_swap_in: list[BlockCopy] = field(default_factory=list)  # (host block, device block)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def has_block_copies(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_swap_in)

    @property
    def is_empty(self) -> bool:
        """Nothing to run: no request to compute and no block to copy."""
        return not self.scheduled and not self.has_block_copies


@dataclass
class PreemptionStats:
    """Preemptions since start, by kind."""

    recompute: int = 0
    swap: int = 0
    recomputed_tokens: int = 0  # computed tokens whose K/V recompute preemptions dropped

    @property
    def total(self) -> int:
        return self.recompute + self.swap


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 speculation: SpeculationPolicy | None = None) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.speculation = speculation  # None: no speculative decoding
        self.lookahead = speculation.lookahead if speculation is not None else 0  # a draft model's room past a step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # swapped out, kept in (priority, arrival) order
        self.preemption_stats = PreemptionStats()
        # The model runner's view: ids whose state it holds, and those finished since its last step.
        self._sent_to_executor: set[str] = set()
        self._finished_since_sent: list[str] = []

    @property
    def num_preemptions(self) -> int:
        """Preemptions of both kinds since start."""
        return self.preemption_stats.total

    # -- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End a request wherever it is (stop string, abort) and return its blocks."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.swapped:
            self.swapped.remove(request)
        request.status = status
        self.kv_cache.free(request)
        self._forget(request)

    def _forget(self, request: Request) -> None:
        if request.request_id in self._sent_to_executor:
            self._sent_to_executor.discard(request.request_id)
            self._finished_since_sent.append(request.request_id)

    # -- the step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        # Others join only when nobody had to give blocks back this step: swapped-out requests first,
        # then (once all of those are back) the waiting queue.
        if out.preempted or out.swapped_out:
            return out
        budget = self._schedule_swapped(out, budget)
        if not self.swapped:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests in (priority, arrival) order: the most important get their blocks first,
        and the victims come from the end. A stable sort: ties keep the order they joined in."""
        self.running.sort(key=lambda r: (r.priority, r.arrival_time))
        speculating = self._speculating()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = self._drafts(req, n, budget) if req.request_id in speculating else []
            while not self.kv_cache.allocate_slots(req, n + len(drafts) + self._lookahead(req, n + len(drafts))):
                victim = self._pop_victim(i)
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n + len(drafts), self.kv_cache.group_tables(req.request_id),
                                                      drafts))
                budget -= n + len(drafts)
                i += 1
        return budget

    def _speculating(self) -> set[str]:
        """The requests whose drafts this step checks (the speculation policy's rule)."""
        if self.speculation is None:
            return set()
        return self.speculation.select([r for r in self.running if r.num_tokens - r.num_computed_tokens == 1])

    def _lookahead(self, req: Request, num_new_tokens: int) -> int:
        """Room a draft model needs past this step's tokens (when the step samples), within the request's length."""
        if not self.lookahead or req.num_computed_tokens + num_new_tokens < req.num_tokens:
            return 0
        end = req.num_prompt_tokens + req.max_output_tokens
        return max(0, min(self.lookahead, end - req.num_computed_tokens - num_new_tokens))

    @staticmethod
    def _drafts(req: Request, n: int, budget: int) -> list[int]:
        """The drafts a decoding request checks this step: as many as the token budget, and its output limit
        (a step yields at most one token more than its drafts), allow."""
        if req.num_tokens - req.num_computed_tokens != 1:  # (then n == 1) not decoding: a prefill chunk
            return []
        room = min(budget - n, req.max_output_tokens - req.num_output_tokens - 1)
        return req.spec_token_ids[:max(room, 0)]

    def _pop_victim(self, first: int) -> Request:
        """The lowest-priority running request not yet scheduled this step (running[first:]): the
        largest (priority, arrival_time), the later in the running list on a tie. Requests already
        scheduled keep their blocks: the step's new blocks may already be offered to the prefix cache."""
        running = self.running
        j = max(range(first, len(running)), key=lambda k: (running[k].priority, running[k].arrival_time, k))
        return running.pop(j)

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        """Swap requests back in, in (priority, arrival) order, while their blocks and next tokens fit."""
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            copies = self.kv_cache.swap_in(req, n)
            if copies is None:
                break
            self.swapped.pop(0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.blocks_to_swap_in.extend(copies)
            out.swapped_in.append(req)
            out.scheduled.append(ScheduledRequest(req, n, self.kv_cache.group_tables(req.request_id)))
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            prefix = self.kv_cache.find_cached_prefix(req)  # a waiting request holds no blocks
            n = min(req.num_tokens - prefix.num_tokens, budget)
            lookahead = self._lookahead(req, prefix.num_tokens + n)  # (computed: 0 until allocated)
            if not self.kv_cache.allocate_slots(req, n + lookahead, prefix):
                break
            req.num_computed_tokens = prefix.num_tokens
            self.waiting.popleft()
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, self.kv_cache.group_tables(req.request_id)))
            budget -= n

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        request.num_preemptions += 1
        request.spec_token_ids = []
        if self._swaps(request):
            self._swap_out(request, out)
        else:
            self._recompute(request, out)

    def _swaps(self, request: Request) -> bool:
        """Swap or recompute. Recompute when the host pool has no room for the request's blocks (or
        there is none, or --preemption-mode recompute). Forced swap (--preemption-mode swap) swaps
        whenever it has room. Otherwise (automatic) swap only a request that has computed at least one
        full block: a shorter prefix is recomputed within one step's token budget, riding along with
        the other requests' tokens, which costs less than two copies plus the host blocks it would
        hold (and it holds no full block the prefix cache could give back)."""
        mode = self.config.preemption_mode
        if mode == "recompute" or not self.kv_cache.can_swap_out(request):
            return False
        return mode == "swap" or request.num_computed_tokens >= self.kv_cache.block_size

    def _swap_out(self, request: Request, out: SchedulerOutput) -> None:
        """Swap preemption: the K/V moves to the host pool; the request resumes where it stopped."""
        out.blocks_to_swap_out.extend(self.kv_cache.swap_out(request))
        request.status = RequestStatus.SWAPPED
        self.preemption_stats.swap += 1
        self.swapped.append(request)
        self.swapped.sort(key=lambda r: (r.priority, r.arrival_time))  # stable: ties keep swap-out order
        out.swapped_out.append(request)

    def _recompute(self, request: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: drop the request's K/V; it resumes from its tokens later."""
        self.kv_cache.free(request)
        self.preemption_stats.recompute += 1
        self.preemption_stats.recomputed_tokens += request.num_computed_tokens
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def runner_input(self, out: SchedulerOutput) -> StepInput:
        """The step as plain data for the model runner: each scheduled request's slice, the static data of
        those it has not seen yet, and the ids finished since its last step. Called once per executed step,
        before `update` moves the cursors."""
        step = StepInput(blocks_to_swap_out=out.blocks_to_swap_out, blocks_to_swap_in=out.blocks_to_swap_in,
                         finished_request_ids=self._finished_since_sent)
        self._finished_since_sent = []
        for s in out.scheduled:
            req = s.request
            if req.request_id not in self._sent_to_executor:
                self._sent_to_executor.add(req.request_id)
                step.new_requests.append(NewRequestData(
                    req.request_id, req.prompt_token_ids, req.sampling_params, frozenset(req.eos_token_ids),
                    req.prompt_frames, req.audio_state, req.pooling_params))
                req.audio_state = None  # the runner's from now on
            step.scheduled.append(ScheduledTokens(req.request_id, req.num_computed_tokens, s.num_new_tokens,
                                                  s.block_tables, s.samples, tuple(s.spec_token_ids)))
        return step

    def update(self, out: SchedulerOutput, sampled: dict[str, int | list[int]],
               audio: dict[str, tuple[list[int], bool]] | None = None,
               drafts: dict[str, list[int]] | None = None) -> list[Request]:
        """Advance cursors, append sampled tokens (and an audio model's frames: id -> (frame, audio
        finished)), apply token-level stops. Returns finished requests.

        Speculative decoding: a request that checked drafts gets a list, the drafts the target kept then the
        token it sampled; the K/V of the rejected drafts is dropped (the cursor stays before them and their
        blocks go back). `drafts`: each request's drafts for the next step (the runner's proposals)."""
        finished = []
        for s in out.scheduled:
            req = s.request
            num_drafts = len(s.spec_token_ids)
            req.num_computed_tokens += s.num_new_tokens - num_drafts
            unchecked = req.spec_token_ids if not num_drafts and s.samples else []
            req.spec_token_ids = []
            if req.pooling_params is not None:  # pooled once its prompt is computed: nothing is generated
                if req.num_computed_tokens == req.num_tokens:
                    self._end(req, RequestStatus.FINISHED_STOPPED)
                    finished.append(req)
                continue
            tokens = sampled.get(req.request_id)
            if tokens is None:
                continue
            tokens = [tokens] if isinstance(tokens, int) else tokens
            if num_drafts:
                kept = len(tokens) - 1  # the kept drafts' K/V was computed by this step
                req.num_computed_tokens += kept
                self.speculation.record_verify(req, num_drafts, kept)
            elif unchecked and self.speculation is not None:  # what checking them would have kept first
                self.speculation.record_unchecked(req, unchecked[0] == tokens[0])
            status = None
            for token in tokens:
                req.append_token(token)
                if audio and req.request_id in audio:
                    frame, req.audio_finished = audio[req.request_id]
                    req.audio_frames.append(frame)
                status = self._check_stop(req, token)
                if status is not None:
                    break
            if status is not None:
                self._end(req, status)
                finished.append(req)
                continue
            if num_drafts:
                self.kv_cache.trim(req, self.lookahead)
            if drafts:
                req.spec_token_ids = drafts.get(req.request_id, [])
        return finished

    def _end(self, req: Request, status: RequestStatus) -> None:
        """A running request is done: its blocks go back."""
        self.running.remove(req)
        req.status = status
        self.kv_cache.free(req)
        self._forget(req)

    @staticmethod
    def _check_stop(req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.audio_finished:  # every codebook emitted stream eos
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.min_tokens:  # the sampler masked stops until then
            if token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
