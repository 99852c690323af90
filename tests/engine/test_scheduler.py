"""Scheduler: token budget, chunked prefill, mixed batches, preemption and stopping, without a model.

Each simulated step calls schedule(), checks the step against the scheduler's limits, then feeds
a made-up token to every scheduled request whose step reaches the end of its tokens (`samples`).
"""
from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.engine.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.sampling_params import SamplingParams

EOS = 1
FILLER = 7  # a token that is neither eos nor a stop token


def make_request(rid: str, prompt_len: int, max_model_len: int = 1024, eos: set[int] | None = None,
                 **params) -> Request:
    params.setdefault("max_tokens", 8)
    prompt = [100 + (i % 50) for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(**params), eos_token_ids=set() if eos is None else eos,
                   max_model_len=max_model_len)


def make_scheduler(num_blocks: int, block_size: int = 4, max_num_seqs: int = 256,
                   max_num_batched_tokens: int = 2048, enable_caching: bool = False) -> Scheduler:
    """Prefix caching is off unless asked for: most tests count the tokens each step computes, and
    the prompts here share prefixes (100, 101, ...), so cache hits would change those counts."""
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, enable_caching=enable_caching))


def step(sched: Scheduler, token: int | Callable[[Request], int] = FILLER
         ) -> tuple[SchedulerOutput, list[bool], list[Request]]:
    """One simulated engine step. Returns the schedule, which entries sampled, and finished requests."""
    out = sched.schedule()
    cfg = sched.config
    kv = sched.kv_cache
    # The step obeys its limits.
    assert out.num_tokens <= cfg.max_num_batched_tokens
    assert out.num_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert len(sched.running) <= cfg.max_num_seqs
    ids = [s.request.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids)), "a request was scheduled twice in one step"
    for s in out.scheduled:
        r = s.request
        assert s.num_new_tokens >= 1
        assert r.status == RequestStatus.RUNNING
        assert r in sched.running
        assert r.num_computed_tokens + s.num_new_tokens <= r.num_tokens
        # Blocks for every token computed after this step are in the table.
        assert s.block_tables == kv.group_tables(r.request_id)
        assert len(s.block_tables[0]) >= cdiv(r.num_computed_tokens + s.num_new_tokens, kv.block_size)
    for r in out.preempted:
        assert r.request_id not in ids
        assert r.request_id not in kv.block_tables
        assert r.num_computed_tokens == 0
    samples = [s.samples for s in out.scheduled]  # read before update() moves the cursors
    sampled = {}
    for s, smp in zip(out.scheduled, samples):
        if smp:
            sampled[s.request.request_id] = token(s.request) if callable(token) else token
    finished = sched.update(out, sampled)
    for r in finished:
        assert r.is_finished
        assert r not in sched.running and r not in sched.waiting
        assert r.request_id not in kv.block_tables
    kv.check_integrity()
    # Every block in use belongs to a running request.
    owners = {rid for rid, t in kv.block_tables.items() if t}
    assert owners <= {r.request_id for r in sched.running}
    return out, samples, finished


def run_to_completion(sched: Scheduler, max_steps: int, token=FILLER) -> int:
    steps = 0
    while sched.has_unfinished():
        step(sched, token)
        steps += 1
        assert steps <= max_steps, f"not finished after {max_steps} steps: {sched.running} {list(sched.waiting)}"
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.pool.num_blocks
    return steps


def counter_token(req: Request) -> int:
    """Distinct made-up tokens: 1000 + index of the output token."""
    return 1000 + req.num_output_tokens


# --------------------------------------------------------------------------------------------
# Budget, chunked prefill, mixing, max_num_seqs
# --------------------------------------------------------------------------------------------
def test_single_request_prefill_then_decode() -> None:
    sched = make_scheduler(num_blocks=64)
    req = make_request("a", 10, max_tokens=4)
    sched.add_request(req)
    assert req.status == RequestStatus.WAITING
    out, samples, finished = step(sched, counter_token)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 10)]
    assert samples == [True] and not finished
    assert req.num_computed_tokens == 10 and req.output_token_ids == [1000]
    for k in range(1, 4):
        out, samples, finished = step(sched, counter_token)
        assert [s.num_new_tokens for s in out.scheduled] == [1] and samples == [True]
    assert finished == [req]
    assert req.output_token_ids == [1000, 1001, 1002, 1003]
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert not sched.has_unfinished()


def test_token_budget_respected_every_step() -> None:
    budget = 32
    sched = make_scheduler(num_blocks=512, max_num_batched_tokens=budget)
    rng = random.Random(0)
    reqs = [make_request(f"r{i}", rng.randint(1, 90), max_tokens=rng.randint(1, 20)) for i in range(12)]
    for r in reqs:
        sched.add_request(r)
    steps = 0
    full_steps = 0
    while sched.has_unfinished():
        pending = sum(r.num_tokens - r.num_computed_tokens for r in sched.running) + sum(
            r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        out, _, _ = step(sched)
        assert out.num_tokens <= budget
        # With plenty of blocks, the scheduler fills the budget whenever there is enough work.
        assert out.num_tokens == min(budget, pending)
        full_steps += out.num_tokens == budget
        steps += 1
        assert steps < 500
    assert full_steps > 5
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == r.sampling_params.max_tokens


def test_long_prompt_is_chunked() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=32)
    req = make_request("long", 100, max_tokens=3)
    sched.add_request(req)
    chunks, sampled_flags = [], []
    for _ in range(4):
        out, samples, _ = step(sched, counter_token)
        assert len(out.scheduled) == 1
        chunks.append(out.scheduled[0].num_new_tokens)
        sampled_flags.append(samples[0])
        # Blocks grow with the computed prefix, not all at once.
        assert len(sched.kv_cache.block_table("long")) == cdiv(req.num_computed_tokens, 4)
    assert chunks == [32, 32, 32, 4]
    assert sampled_flags == [False, False, False, True]
    assert req.num_computed_tokens == 100
    assert req.output_token_ids == [1000]
    out, samples, _ = step(sched, counter_token)
    assert [s.num_new_tokens for s in out.scheduled] == [1] and samples == [True]


def test_decode_and_prefill_mixed_in_one_step() -> None:
    sched = make_scheduler(num_blocks=128, max_num_batched_tokens=16)
    a = make_request("a", 5, max_tokens=20)
    sched.add_request(a)
    step(sched)  # a prefilled, has its first token
    b = make_request("b", 40, max_tokens=2)
    sched.add_request(b)
    out, samples, _ = step(sched)
    got = {s.request.request_id: (s.num_new_tokens, smp) for s, smp in zip(out.scheduled, samples)}
    # a decodes one token, b takes the rest of the budget as a prefill chunk.
    assert got == {"a": (1, True), "b": (15, False)}
    assert [s.request for s in out.scheduled] == [a, b]  # running requests go first
    out, samples, _ = step(sched)
    got = {s.request.request_id: (s.num_new_tokens, smp) for s, smp in zip(out.scheduled, samples)}
    assert got == {"a": (1, True), "b": (15, False)}
    out, samples, _ = step(sched)
    got = {s.request.request_id: (s.num_new_tokens, smp) for s, smp in zip(out.scheduled, samples)}
    assert got == {"a": (1, True), "b": (10, True)}
    assert b.num_output_tokens == 1


def test_max_num_seqs_respected() -> None:
    sched = make_scheduler(num_blocks=256, max_num_seqs=3)
    reqs = [make_request(f"r{i}", 6, max_tokens=4 + i) for i in range(7)]
    for r in reqs:
        sched.add_request(r)
    out, _, _ = step(sched)
    # First come, first served: the three oldest start.
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1", "r2"]
    assert [r.request_id for r in sched.waiting] == ["r3", "r4", "r5", "r6"]
    steps = 1
    while sched.has_unfinished():
        out, _, _ = step(sched)
        assert len(out.scheduled) <= 3
        assert len(sched.running) <= 3
        steps += 1
        assert steps < 200
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert [r.num_output_tokens for r in reqs] == [4 + i for i in range(7)]


def test_waiting_request_not_admitted_without_blocks() -> None:
    sched = make_scheduler(num_blocks=3, block_size=4)
    a = make_request("a", 8, max_tokens=2)  # 2 blocks, then its second token needs no new block
    b = make_request("b", 8, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out, _, _ = step(sched)
    assert [s.request for s in out.scheduled] == [a]
    assert list(sched.waiting) == [b] and b.status == RequestStatus.WAITING
    assert "b" not in sched.kv_cache.block_tables
    step(sched)  # a decodes its second token and finishes
    assert a.status == RequestStatus.FINISHED_LENGTH
    out, _, _ = step(sched)
    assert [s.request for s in out.scheduled] == [b]


# --------------------------------------------------------------------------------------------
# Preemption
# --------------------------------------------------------------------------------------------
def test_newest_running_request_is_preempted_and_resumes() -> None:
    # Three 4-token prompts in 4-token blocks; the pool has one spare block. d waits (max_num_seqs).
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=3)
    a, b, c = (make_request(n, 4, max_tokens=4) for n in "abc")
    d = make_request("d", 4, max_tokens=1)
    for r in (a, b, c, d):
        sched.add_request(r)
    out, samples, _ = step(sched, counter_token)
    assert [s.request for s in out.scheduled] == [a, b, c] and all(samples)
    assert list(sched.waiting) == [d]
    assert sched.kv_cache.num_free_blocks == 1
    c_tokens = list(c.all_token_ids)
    c_blocks = list(sched.kv_cache.block_table("c"))

    # Each now needs a second block: a takes the spare one, b forces c (the newest) out.
    out, _, _ = step(sched, counter_token)
    assert out.preempted == [c]
    assert [s.request for s in out.scheduled] == [a, b]
    assert sched.num_preemptions == 1
    assert c.num_preemptions == 1
    assert c.status == RequestStatus.PREEMPTED
    assert list(sched.waiting) == [c, d]  # the preempted request goes to the front of the queue
    assert c not in sched.running
    assert c.num_computed_tokens == 0
    assert "c" not in sched.kv_cache.block_tables
    assert c.all_token_ids == c_tokens  # its tokens are kept for the recompute
    # b got one of c's blocks.
    assert set(sched.kv_cache.block_table("b")) & set(c_blocks)

    # A request that arrives now queues behind both.
    e = make_request("e", 4, max_tokens=1)
    sched.add_request(e)
    assert list(sched.waiting) == [c, d, e]

    steps = 0
    order_started = []
    while sched.has_unfinished():
        out, _, _ = step(sched, counter_token)
        for s in out.scheduled:
            if s.request in (c, d, e) and s.request not in order_started:
                order_started.append(s.request)
        steps += 1
        assert steps < 100
    assert order_started == [c, d, e]  # the preempted request resumes first, then FCFS
    for r in (a, b, c):
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [1000, 1001, 1002, 1003]
    assert d.status == e.status == RequestStatus.FINISHED_LENGTH
    assert sched.kv_cache.num_free_blocks == 4


def test_preempted_request_recomputes_prompt_and_outputs() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    a, b = make_request("a", 8, max_tokens=6), make_request("b", 7, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, counter_token)  # a: 2 blocks, b: 2 blocks; b now has 8 tokens
    out, _, _ = step(sched, counter_token)  # a needs a 3rd block -> b preempted
    assert out.preempted == [b]
    assert b.num_tokens == 8
    # b comes back once a has finished; its recompute covers prompt + the token already sampled.
    resumed = None
    for _ in range(20):
        out, samples, _ = step(sched, counter_token)
        for s, smp in zip(out.scheduled, samples):
            if s.request is b and resumed is None:
                resumed = (s.num_new_tokens, smp)
        if not sched.has_unfinished():
            break
    assert resumed == (8, True)
    assert b.output_token_ids == [1000, 1001, 1002]
    assert a.output_token_ids == [1000 + i for i in range(6)]


def test_request_preempts_itself_when_alone_and_too_big() -> None:
    """The only running request that cannot grow gives its own blocks back instead of spinning."""
    sched = make_scheduler(num_blocks=2, block_size=4)
    a = make_request("a", 8, max_tokens=4, max_model_len=1024)
    sched.add_request(a)
    step(sched)
    out, _, _ = step(sched)  # needs a 3rd block; nobody else to preempt
    assert out.preempted == [a]
    assert out.scheduled == []
    assert a.status == RequestStatus.PREEMPTED and list(sched.waiting) == [a]
    assert sched.kv_cache.num_free_blocks == 2
    sched.finish_request(a, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished()
    sched.kv_cache.check_integrity()


def test_chunked_prefill_request_preempted_resets() -> None:
    # a grows to 28 tokens (7 blocks), b to 26 (7 blocks): each fits the pool alone, not together.
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=6)
    a = make_request("a", 8, max_tokens=20)
    b = make_request("b", 24, max_tokens=2)
    sched.add_request(a)
    step(sched)
    sched.add_request(b)
    # b prefills in 5-token chunks next to a's decode until the pool runs dry.
    computed_before = None
    for _ in range(20):
        before = b.num_computed_tokens
        out, _, _ = step(sched)
        if out.preempted:
            computed_before = before
            assert out.preempted == [b]
            assert [s.request for s in out.scheduled] == [a]
            break
    assert computed_before is not None
    assert 0 < computed_before < b.num_prompt_tokens  # it was preempted mid-prefill
    assert b.num_computed_tokens == 0
    assert b.num_output_tokens == 0
    assert b.status == RequestStatus.PREEMPTED
    assert "b" not in sched.kv_cache.block_tables
    run_to_completion(sched, max_steps=200)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.num_output_tokens == 20 and b.num_output_tokens == 2


@pytest.mark.parametrize("enable_caching", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_deadlock_with_pool_for_one_max_length_sequence(seed: int, enable_caching: bool) -> None:
    max_model_len, block_size = 64, 4
    num_blocks = max_model_len // block_size  # exactly one full-length sequence fits
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=4,
                           max_num_batched_tokens=24, enable_caching=enable_caching)
    rng = random.Random(seed)
    reqs = [make_request(f"r{i}", rng.randint(1, 50), max_model_len=max_model_len, max_tokens=None)
            for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    # Each request computes at most 64 tokens per attempt, and the oldest running request always
    # progresses, so a few thousand steps is far beyond what a correct scheduler needs.
    steps = run_to_completion(sched, max_steps=3000)
    assert sched.num_preemptions > 0  # the pool really was tight
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_tokens == max_model_len  # generation ran up to the context window
    assert steps < 3000


@pytest.mark.parametrize("enable_caching", [False, True])
def test_random_workload_many_preemptions_integrity(enable_caching: bool) -> None:
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=20, block_size=4, max_num_seqs=6, max_num_batched_tokens=20,
                           enable_caching=enable_caching)
    reqs = []
    steps = 0
    for i in range(30):
        r = make_request(f"r{i}", rng.randint(1, 40), max_model_len=80, max_tokens=rng.randint(1, 30))
        reqs.append(r)
        sched.add_request(r)
        for _ in range(rng.randint(0, 3)):
            step(sched, counter_token)
            steps += 1
    steps += run_to_completion(sched, max_steps=5000, token=counter_token)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [1000 + k for k in range(r.max_output_tokens)]
    assert sched.num_preemptions == sum(r.num_preemptions for r in reqs) > 0
    assert (sched.kv_cache.prefix_cache_stats.hits > 0) == enable_caching


# --------------------------------------------------------------------------------------------
# Stopping
# --------------------------------------------------------------------------------------------
def test_max_tokens_finishes_with_length() -> None:
    sched = make_scheduler(num_blocks=32)
    r = make_request("r", 5, max_tokens=3)
    sched.add_request(r)
    finished_at = None
    for i in range(10):
        _, _, finished = step(sched)
        if finished:
            finished_at = i
            assert finished == [r]
            break
    assert finished_at == 2
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.num_output_tokens == 3
    assert r.stop_reason is None
    assert not sched.has_unfinished()
    assert sched.kv_cache.num_free_blocks == 32


def test_max_model_len_caps_output() -> None:
    sched = make_scheduler(num_blocks=32)
    r = make_request("r", 10, max_model_len=12, max_tokens=16)
    assert r.max_output_tokens == 2
    sched.add_request(r)
    run_to_completion(sched, max_steps=5)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.num_tokens == 12


def test_eos_finishes_with_stop() -> None:
    sched = make_scheduler(num_blocks=32)
    r = make_request("r", 5, eos={EOS}, max_tokens=10)
    sched.add_request(r)
    step(sched, FILLER)
    step(sched, FILLER)
    _, _, finished = step(sched, EOS)
    assert finished == [r]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [FILLER, FILLER, EOS]
    assert r.stop_reason is None  # eos is not a stop reason
    assert sched.kv_cache.num_free_blocks == 32
    assert not sched.has_unfinished()


def test_ignore_eos() -> None:
    sched = make_scheduler(num_blocks=32)
    r = make_request("r", 5, eos={EOS}, max_tokens=4, ignore_eos=True)
    sched.add_request(r)
    run_to_completion(sched, max_steps=10, token=EOS)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [EOS] * 4


def test_stop_token_ids_set_stop_reason() -> None:
    sched = make_scheduler(num_blocks=32)
    r = make_request("r", 5, eos={EOS}, max_tokens=10, stop_token_ids=[42, 43])
    sched.add_request(r)
    step(sched, 41)
    _, _, finished = step(sched, 43)
    assert finished == [r]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.stop_reason == 43
    assert r.output_token_ids == [41, 43]


def test_stop_token_ids_apply_even_with_ignore_eos() -> None:
    sched = make_scheduler(num_blocks=32)
    r = make_request("r", 5, eos={EOS}, max_tokens=10, stop_token_ids=[42], ignore_eos=True)
    sched.add_request(r)
    step(sched, EOS)
    assert not r.is_finished
    _, _, finished = step(sched, 42)
    assert finished == [r] and r.stop_reason == 42


@pytest.mark.parametrize("stop_tok", [EOS, 42])
def test_min_tokens_delays_stop(stop_tok: int) -> None:
    sched = make_scheduler(num_blocks=32)
    r = make_request("r", 5, eos={EOS}, max_tokens=10, min_tokens=3, stop_token_ids=[42])
    sched.add_request(r)
    step(sched, stop_tok)  # 1st output
    step(sched, stop_tok)  # 2nd output
    assert not r.is_finished and r.stop_reason is None
    step(sched, FILLER)  # 3rd output: min_tokens reached
    assert not r.is_finished
    _, _, finished = step(sched, stop_tok)  # 4th
    assert finished == [r]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [stop_tok, stop_tok, FILLER, stop_tok]


def test_eos_on_last_allowed_token_is_a_stop() -> None:
    sched = make_scheduler(num_blocks=32)
    r = make_request("r", 5, eos={EOS}, max_tokens=2)
    sched.add_request(r)
    step(sched)
    step(sched, EOS)
    assert r.status == RequestStatus.FINISHED_STOPPED


# --------------------------------------------------------------------------------------------
# Aborts
# --------------------------------------------------------------------------------------------
def test_finish_request_running_frees_blocks() -> None:
    sched = make_scheduler(num_blocks=32)
    a, b = make_request("a", 10, max_tokens=10), make_request("b", 10, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.kv_cache.num_free_blocks == 32 - 6
    sched.finish_request(a, RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert a not in sched.running
    assert "a" not in sched.kv_cache.block_tables
    assert sched.kv_cache.num_free_blocks == 32 - 3
    sched.kv_cache.check_integrity()
    out, _, _ = step(sched)
    assert [s.request for s in out.scheduled] == [b]
    # A second finish is a no-op.
    sched.finish_request(a, RequestStatus.FINISHED_STOPPED)
    assert a.status == RequestStatus.FINISHED_ABORTED
    run_to_completion(sched, max_steps=10)
    assert b.status == RequestStatus.FINISHED_LENGTH


def test_finish_request_waiting_and_preempted() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    a, b, c = (make_request(n, 4, max_tokens=4) for n in "abc")
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    out, _, _ = step(sched)
    assert out.preempted == [c]
    d = make_request("d", 4, max_tokens=4)
    sched.add_request(d)
    sched.finish_request(c, RequestStatus.FINISHED_ABORTED)  # preempted, in the waiting queue
    sched.finish_request(d, RequestStatus.FINISHED_ABORTED)  # never started
    assert list(sched.waiting) == []
    assert c.status == d.status == RequestStatus.FINISHED_ABORTED
    sched.kv_cache.check_integrity()
    steps = run_to_completion(sched, max_steps=20)
    assert steps > 0
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert c.num_output_tokens == 1 and d.num_output_tokens == 0


def test_abort_mid_chunked_prefill() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=16)
    r = make_request("r", 60)
    sched.add_request(r)
    step(sched)
    step(sched)
    assert len(sched.kv_cache.block_table("r")) == 8
    sched.finish_request(r, RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache.num_free_blocks == 32
    assert sched.schedule().is_empty
    sched.kv_cache.check_integrity()
