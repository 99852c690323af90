"""--speculative-config's parsing and the per-step rule that turns speculation off when it does not pay."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pagedllm.speculative_config import SpeculativeConfig
from pagedllm.spec_decode.ngram import propose_ngram
from pagedllm.spec_decode.policy import REFRESH_AFTER_STEPS, SpeculationPolicy, expected_tokens


def test_the_config_takes_vllms_keys_and_refuses_what_it_would_ignore():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 3, 3)
    assert SpeculativeConfig.parse({"method": "ngram"}).prompt_lookup_max == 5
    assert SpeculativeConfig.parse(None) is None
    with pytest.raises(ValueError, match="not supported; known"):
        SpeculativeConfig.parse({"method": "ngram", "prompt_lookahead": 3})
    with pytest.raises(ValueError, match="not implemented yet"):
        SpeculativeConfig.parse({"method": "eagle3", "model": "x"})
    with pytest.raises(ValueError, match="JSON object"):
        SpeculativeConfig.parse("ngram")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="must not exceed"):
        SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2})


def test_ngram_proposes_what_followed_the_latest_longest_match():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 2, 3, 3) == [4, 5, 1]
    assert propose_ngram([9, 2, 3, 7, 1, 2, 3, 8, 2, 3], 2, 2, 2) == [8, 2]  # the latest occurrence of (2, 3)
    assert propose_ngram([5, 1, 2, 3, 6, 2, 3], 2, 3, 2) == [6, 2]  # (1, 2, 3) only once: falls back to (2, 3)
    assert propose_ngram([1, 2, 3, 4], 1, 3, 3) == []
    assert propose_ngram([7, 7, 7, 7], 1, 3, 5) == [7]  # nothing past the sequence's end


def test_expected_tokens():
    assert expected_tokens(0.0, 3.0, 4) == 1.0
    assert expected_tokens(1.0, 4.0, 4) == 5.0
    assert expected_tokens(0.5, 3.0, 2) == pytest.approx(2.0)  # at most the drafts there are


def _policy(**kw) -> SpeculationPolicy:
    return SpeculationPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4, **kw))


@dataclass
class _Req:
    request_id: str
    spec_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    spec_acceptance: tuple[float, float] | None = None


def _batch(n: int) -> list[_Req]:
    return [_Req(str(i)) for i in range(n)]


def _steps_with_drafts(p: SpeculationPolicy, batch: list[_Req], seconds, steps: int = 20) -> int:
    """Run `steps` steps as the engine would (each step's time, from `seconds(n)`, reported back): how many
    checked drafts."""
    checked = 0
    for _ in range(steps):
        chosen = p.select(batch)
        checked += bool(chosen)
        n = len(batch) + sum(len(r.spec_token_ids) for r in batch if r.request_id in chosen)
        p.record_step(n, seconds(n))
    return checked


def test_memory_bound_steps_speculate_and_compute_bound_ones_do_not():
    p = _policy()
    # Measured: 1 token 30 ms, 5 tokens 32 ms (reading the weights dominates); 32 tokens 60 ms, 160 tokens 280 ms.
    for n, t in ((1, 0.030), (5, 0.032), (32, 0.060), (160, 0.280)):
        p.record_step(n, t)
    for r in _batch(5):
        p.record_verify(r, 4, 2)  # first drafts kept, 2 of 4 each time
    assert p.select(_batch(1)) == {"0"}
    assert _steps_with_drafts(p, _batch(32), lambda n: 0.060 + (n - 32) * 0.22 / 128) <= 1


def test_step_times_are_interpolated_between_measured_sizes_and_nothing_is_explored():
    p = _policy()
    assert p.select(_batch(2)) == {"0", "1"}  # nothing timed yet: speculate
    p.record_step(1, 0.020)
    p.record_step(600, 1.200)  # a prefill chunk
    assert p.step_times.seconds(5) == pytest.approx(0.020 + 1.180 * 4 / 599)
    assert p.step_times.seconds(1200) == pytest.approx(2.4)  # beyond the largest: its time per token
    assert p.select(_batch(1))  # ~20 vs ~28 ms for 1.94 expected tokens
    p.record_step(32, 0.080)
    p.record_step(160, 0.320)
    # 4x the time for 2x the tokens (half the first drafts kept, 2 more after): no (but a few drafts may be tried
    # once where their step size was never timed)
    assert _steps_with_drafts(p, _batch(32), lambda n: 0.080 + (n - 32) * 0.24 / 128) <= 1
    assert p.gain(32, 128) == pytest.approx(expected_tokens(0.5, 2.0, 4) * 0.080 / 0.320)


def test_the_requests_whose_drafts_are_being_kept_check_them_and_the_others_do_not():
    p = _policy()
    p.record_step(8, 0.030)
    p.record_step(16, 0.036)
    p.record_step(40, 0.150)
    batch = _batch(8)
    copying, writing = batch[:2], batch[2:]
    for _ in range(4):
        for r in copying:
            p.record_verify(r, 4, 4)  # inside a copied span: every draft kept
        for r in writing:
            p.record_unchecked(r, False)
    assert p.request_first_kept(copying[0]) > 2 * p.request_first_kept(writing[0])
    assert p.kept_after_first > 3.5
    assert p.select(batch) == {"0", "1"}


def test_unchecked_drafts_keep_the_acceptance_rate_current():
    p = _policy()
    p.record_step(1, 0.030)
    p.record_step(5, 0.040)
    r = _Req("r")
    for _ in range(30):
        p.record_unchecked(r, False)  # the first draft was never the token written
    assert not p.select([r])
    for _ in range(6):
        p.record_unchecked(r, True)
    assert p.request_first_kept(r) > 0.7 and p.select([r]) == {"r"}


def test_disable_by_batch_size_caps_it_and_adaptive_false_always_checks():
    capped = _policy(disable_by_batch_size=4)
    assert capped.select(_batch(4)) == {"0", "1", "2", "3"}
    assert capped.select(_batch(5)) == set()
    always = _policy(adaptive=False)
    always.record_step(1, 0.01)
    always.record_step(8, 1.0)
    assert always.select(_batch(1)) == {"0"}
    p = _policy()
    for r in _batch(20):
        p.record_verify(r, 4, 0)
    assert p.stats.num_drafts == 20 and p.stats.num_draft_tokens == 80 and p.stats.accepted_per_position == [0] * 4
    assert p.first_kept < 0.05


def test_a_stale_step_time_near_the_edge_is_measured_again_but_a_hopeless_one_is_not():
    p = _policy()
    p.record_step(1, 0.030)
    p.record_step(5, 0.060)  # one slow step: drafts now look like a loss (2x the time for ~2x the tokens)
    r = _Req("r")
    assert not p.select([r])
    for _ in range(REFRESH_AFTER_STEPS + 1):
        p.record_step(1, 0.030)
    assert p.select([r]) == {"r"}  # close to paying, and 5-token steps not timed for 65 steps: once more
    p.record_step(5, 0.032)
    assert p.select([r]) == {"r"}  # and now it pays
    q = _policy()
    q.record_step(32, 0.080)
    q.record_step(160, 0.400)
    for _ in range(REFRESH_AFTER_STEPS + 1):
        q.record_step(32, 0.080)
    # 5x the time for ~2x the tokens: the whole batch's drafts never tried again (one request's, once at most)
    assert _steps_with_drafts(q, _batch(32), lambda n: 0.080 + (n - 32) * 0.32 / 128) <= 1


def _ngram_by_definition(tokens, min_n, max_n, k):
    """The longest suffix (max_n down to min_n) with an earlier occurrence, its latest one: what followed."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        for end in range(total - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == tokens[total - n:]:
                return tokens[end + 1:end + 1 + k]
    return []


def test_ngram_equals_its_definition_on_random_sequences():
    import random

    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randint(0, rng.choice([2, 4, 10])) for _ in range(rng.randint(1, 50))]
        lo = rng.randint(1, 4)
        hi, k = rng.randint(lo, 6), rng.randint(1, 5)
        assert propose_ngram(tokens, lo, hi, k) == _ngram_by_definition(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_a_draft_model_proposes_all_its_drafts_while_on_and_a_probe_now_and_then_while_off():
    from pagedllm.spec_decode.policy import PROBE_EVERY

    ngram = _policy()
    ngram._last = False
    assert [ngram.drafts_wanted() for _ in range(3)] == [4, 4, 4]  # n-gram drafts cost nothing
    p = SpeculationPolicy(SpeculativeConfig(method="draft_model", model="x", num_speculative_tokens=4))
    assert p.drafts_wanted() == 4  # nothing decided yet
    p.record_step(8, 0.05)
    p.record_step(40, 0.5)
    assert not p.select(_batch(8))  # 10x the time: off
    wanted = [p.drafts_wanted() for _ in range(2 * PROBE_EVERY)]
    assert wanted.count(1) == 2 and wanted.count(0) == 2 * PROBE_EVERY - 2
    for _ in range(20):
        p.record_step(40, 0.06)
    assert p.select(_batch(8))  # cheap again: on, and all drafts wanted
    assert p.drafts_wanted() == 4
