"""Sampler on hand-made logits: greedy, top-k/top-p/min-p, seeds, the sampled distribution,
logprobs, min_tokens and penalties. No model is involved."""
from __future__ import annotations

import math

import pytest
import torch

from pagedllm.model_executor.request_state import RunnerRequest
from pagedllm.model_executor import sampler as sampler_module
from pagedllm.model_executor.sampler import Sampler, _nucleus_coverage, _top_k_top_p, argmax_rows
from pagedllm.sampling_params import SamplingParams

CPU = torch.device("cpu")

# Chi-square critical value for 7 degrees of freedom at alpha = 1e-4: 29.88 (standard tables, e.g.
# NIST/SEMATECH e-Handbook 1.3.6.7.4; it is also what chi2_sf below gives: sf(29.877, 7) = 1.000e-4).
# (27.9 is sometimes quoted but corresponds to alpha ~2.3e-4.)
CHI2_CRIT_DF7_ALPHA_1E4 = 29.88
ALPHA = 1e-4


def chi2_sf(x: float, df: int) -> float:
    """Chi-square survival function (p-value): the regularised upper incomplete gamma Q(df/2, x/2)."""
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                   torch.tensor(x / 2, dtype=torch.float64)).item()


def chi2_stat(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def runner_request(rid: str, prompt: list[int], params: SamplingParams, eos_token_ids=()) -> RunnerRequest:
    """The model runner's state of a request: what the sampler reads."""
    return RunnerRequest(rid, list(prompt), params, frozenset(eos_token_ids), list(prompt))


def make_req(rid: str = "r", prompt: list[int] | None = None, eos: set[int] | None = None,
             **params) -> RunnerRequest:
    return runner_request(rid, [0] if prompt is None else prompt, SamplingParams(**params),
                   eos_token_ids=set() if eos is None else eos)


def make_reqs(n: int, **params) -> list[RunnerRequest]:
    """n requests with identical parameters (each row of a batch needs its own request state)."""
    sp = SamplingParams(**params)
    return [runner_request(f"r{i}", [0], sp, eos_token_ids=set()) for i in range(n)]


def sample(sampler: Sampler, logits: torch.Tensor, reqs: list[RunnerRequest]) -> list[int]:
    return [row.token_id for row in sampler(logits.clone(), reqs)]


def test_chi2_helpers() -> None:
    assert chi2_sf(CHI2_CRIT_DF7_ALPHA_1E4, 7) == pytest.approx(ALPHA, rel=1e-2)
    assert chi2_sf(7.0, 7) == pytest.approx(0.4289, abs=1e-4)  # median-ish of chi2(7)
    assert chi2_stat([0, 1, 1, 1], torch.tensor([0.5, 0.5])) == pytest.approx(1.0)


# --------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------
def test_greedy_is_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 100, generator=gen) * 3
    reqs = make_reqs(64, temperature=0.0)
    rows = Sampler(CPU, seed=0)(logits.clone(), reqs)
    assert [r.token_id for r in rows] == logits.argmax(dim=-1).tolist()
    assert all(r.logprob is None and r.top_ids is None for r in rows)


def test_greedy_rows_are_argmax_in_mixed_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 50, generator=gen)
    reqs = [make_req(f"r{i}", temperature=0.0 if i % 2 == 0 else 1.0) for i in range(40)]
    tokens = sample(Sampler(CPU, seed=0), logits, reqs)
    argmax = logits.argmax(dim=-1).tolist()
    assert [tokens[i] for i in range(0, 40, 2)] == [argmax[i] for i in range(0, 40, 2)]
    # The sampled rows of near-flat logits do not all land on the argmax.
    assert any(tokens[i] != argmax[i] for i in range(1, 40, 2))


def test_bfloat16_logits_accepted() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]], dtype=torch.bfloat16)
    assert sample(Sampler(CPU, seed=0), logits, [make_req(temperature=0.0)]) == [1]


# --------------------------------------------------------------------------------------------
# Truncation: top-k, top-p, min-p
# --------------------------------------------------------------------------------------------
def test_top_k_never_leaves_top_k() -> None:
    gen = torch.Generator().manual_seed(2)
    row = torch.randn(50, generator=gen)
    n, k = 2000, 5
    tokens = sample(Sampler(CPU, seed=0), row.expand(n, -1), make_reqs(n, top_k=k, temperature=1.5))
    top = set(row.topk(k).indices.tolist())
    assert set(tokens) == top  # inside the top k, and every one of them is reachable


def test_top_k_per_row_in_one_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(30, generator=gen) * 0.3  # near-flat: without top-k anything could come out
    ks = [1, 2, 3, 10, 0]
    per_k = 400
    reqs = [make_req(f"{k}-{i}", top_k=k) for k in ks for i in range(per_k)]
    tokens = sample(Sampler(CPU, seed=0), row.expand(len(reqs), -1), reqs)
    order = row.argsort(descending=True).tolist()
    for j, k in enumerate(ks):
        got = set(tokens[j * per_k:(j + 1) * per_k])
        if k == 0:
            assert len(got) > 20  # disabled: most of the vocabulary shows up
        else:
            assert got == set(order[:k])


def test_top_p_never_leaves_nucleus() -> None:
    probs = torch.tensor([0.05, 0.4, 0.02, 0.3, 0.2, 0.03])
    row = probs.log()
    n = 3000
    # Sorted: 0.4, 0.3, 0.2 | 0.05, 0.03, 0.02. Mass before 0.2 is 0.7 < 0.75, before 0.05 is 0.9.
    tokens = sample(Sampler(CPU, seed=0), row.expand(n, -1), make_reqs(n, top_p=0.75))
    assert set(tokens) == {1, 3, 4}
    # Inside the nucleus the relative probabilities are kept (renormalised 0.4 : 0.3 : 0.2).
    kept = torch.tensor([0.4, 0.3, 0.2]) / 0.9
    stat = chi2_stat([{1: 0, 3: 1, 4: 2}[t] for t in tokens], kept)
    assert chi2_sf(stat, 2) > ALPHA


def test_top_p_nucleus_is_smallest_set_reaching_p() -> None:
    """A token is dropped once the better tokens already hold mass >= top_p (exact binary fractions)."""
    row = torch.tensor([16.0, 8.0, 4.0, 2.0, 1.0, 1.0]).log()  # softmax: exactly 1/2, 1/4, ..., 1/32, 1/32
    n = 1000
    # (Cuts between the two equal last tokens are left out: which of a tie sorts first is unspecified.)
    cases = [(0.5, {0}), (0.5001, {0, 1}), (0.75, {0, 1}), (0.7501, {0, 1, 2}), (0.875, {0, 1, 2}),
             (0.8751, {0, 1, 2, 3}), (0.9375, {0, 1, 2, 3}), (0.97, set(range(6)))]
    for top_p, nucleus in cases:
        tokens = sample(Sampler(CPU, seed=0), row.expand(n, -1), make_reqs(n, top_p=top_p))
        assert set(tokens) == nucleus, top_p


def test_top_p_one_drops_nothing_on_a_large_vocab() -> None:
    """top_p == 1 means off: no tail token may be cut even when the float32 cumsum reaches 1 early.

    (Before the fix, a 128k vocabulary lost ~12k tail tokens per row whenever any row of the batch
    used top-k or top-p, so a seeded row's candidates depended on its neighbours.)
    """
    gen = torch.Generator().manual_seed(0)
    vocab = 128_256
    logits = torch.randn(4, vocab, generator=gen) * 3
    out = _top_k_top_p(logits.clone(), torch.tensor([0, 50, 0, 0]), torch.tensor([[1.0], [1.0], [0.9], [1.0]]))
    assert torch.equal(out[0], logits[0])  # nothing enabled for this row
    assert torch.equal(out[3], logits[3])
    assert int(torch.isfinite(out[1]).sum()) == 50  # exactly top-k, no top-p cut
    kept = torch.isfinite(out[2])
    assert 1 < int(kept.sum()) < vocab  # the top_p=0.9 row is really cut
    mass = torch.softmax(logits[2], dim=-1)[kept].sum().item()
    assert mass >= 0.9 - 1e-4


def test_top_p_keeps_at_least_the_top_token() -> None:
    row = torch.tensor([0.5, 2.0, 1.9, 0.1])
    n = 500
    tokens = sample(Sampler(CPU, seed=0), row.expand(n, -1), make_reqs(n, top_p=1e-6))
    assert set(tokens) == {1}


def test_top_k_then_top_p() -> None:
    probs = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.1])
    n = 2000
    # top_k=2 renormalises to 0.583 / 0.417; top_p=0.5 then keeps only the first.
    tokens = sample(Sampler(CPU, seed=0), probs.log().expand(n, -1), make_reqs(n, top_k=2, top_p=0.5))
    assert set(tokens) == {0}
    # top_k=3 -> 0.4375, 0.3125, 0.25; top_p=0.6 keeps two.
    tokens = sample(Sampler(CPU, seed=1), probs.log().expand(n, -1), make_reqs(n, top_k=3, top_p=0.6))
    assert set(tokens) == {0, 1}


def test_min_p_never_emits_below_threshold() -> None:
    probs = torch.tensor([0.02, 0.3, 0.08, 0.25, 0.1, 0.05, 0.2])
    n, min_p = 4000, 0.3
    threshold = min_p * probs.max()  # 0.09
    tokens = sample(Sampler(CPU, seed=0), probs.log().expand(n, -1), make_reqs(n, min_p=min_p))
    allowed = {i for i, p in enumerate(probs.tolist()) if p >= threshold}
    assert allowed == {1, 3, 4, 6}
    assert set(tokens) == allowed


def test_min_p_uses_temperature_scaled_distribution() -> None:
    # At temperature 2 the distribution flattens: p ~ sqrt(probs), so more tokens pass min_p.
    probs = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05])
    n, min_p = 3000, 0.4
    scaled = torch.softmax(probs.log() / 2.0, dim=-1)
    allowed = {i for i, p in enumerate(scaled.tolist()) if p >= min_p * scaled.max().item()}
    assert allowed == {0, 1, 2, 3}
    tokens = sample(Sampler(CPU, seed=0), probs.log().expand(n, -1), make_reqs(n, min_p=min_p, temperature=2.0))
    assert set(tokens) == allowed


# --------------------------------------------------------------------------------------------
# Seeds and reproducibility
# --------------------------------------------------------------------------------------------
def _seeded_run(sampler_seed: int, layout: str, steps: int = 8) -> list[int]:
    """Sample a seed=42 request for several steps inside batches of different makeup."""
    gen = torch.Generator().manual_seed(123)
    target_logits = [torch.randn(200, generator=gen) * 0.5 for _ in range(steps)]
    noise_gen = torch.Generator().manual_seed(sampler_seed + 1000)
    target = make_req("target", seed=42, temperature=1.0)
    others: list[RunnerRequest]
    if layout == "alone":
        others, pos = [], 0
    elif layout == "middle":
        others = [make_req("u1"), make_req("u2", top_k=5), make_req("g", temperature=0.0), make_req("u3")]
        pos = 2
    elif layout == "first_with_other_seeds":
        others = [make_req("s7", seed=7), make_req("u1", temperature=0.3), make_req("s42b", seed=42, top_p=0.5)]
        pos = 0
    elif layout == "last_big":
        others = make_reqs(37, temperature=0.9)
        pos = 37
    else:
        raise AssertionError(layout)
    sampler = Sampler(CPU, seed=sampler_seed)
    out = []
    for t in range(steps):
        batch = list(others)
        batch.insert(pos, target)
        logits = torch.randn(len(batch), 200, generator=noise_gen)
        logits[pos] = target_logits[t]
        rows = sampler(logits, batch)
        out.append(rows[pos].token_id)
        target.append_token(rows[pos].token_id)
        for r, row in zip(batch, rows):
            if r is not target:
                r.append_token(row.token_id)
    return out


def test_seeded_request_independent_of_batch() -> None:
    ref = _seeded_run(0, "alone")
    assert len(set(ref)) > 3  # really sampled, not a constant
    for sampler_seed, layout in [(0, "middle"), (5, "first_with_other_seeds"), (9, "last_big"), (77, "alone")]:
        assert _seeded_run(sampler_seed, layout) == ref, layout


def test_different_seeds_give_different_sequences() -> None:
    logits = torch.zeros(1, 1000)
    a, b, a2 = make_req("a", seed=1), make_req("b", seed=2), make_req("a2", seed=1)
    sampler = Sampler(CPU, seed=0)

    def run(req: RunnerRequest) -> list[int]:
        out = []
        for _ in range(10):
            out.append(sample(sampler, logits, [req])[0])
            req.append_token(out[-1])  # the next draw of the request
        return out

    seq_a, seq_b, seq_a2 = run(a), run(b), run(a2)
    assert seq_a == seq_a2
    assert seq_a != seq_b
    assert len(set(seq_a)) > 5  # each draw differs: not one number repeated


def test_unseeded_sampling_reproducible_with_sampler_seed() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 300, 100, generator=gen) * 0.5

    def run(seed: int) -> list[list[int]]:
        sampler = Sampler(CPU, seed=seed)
        reqs = make_reqs(300, temperature=1.0)
        return [sample(sampler, logits[s], reqs) for s in range(5)]

    first = run(0)
    assert run(0) == first
    assert run(1) != first
    assert first[0] != first[1]  # the generator advances between steps


# --------------------------------------------------------------------------------------------
# The sampled distribution
# --------------------------------------------------------------------------------------------
LOGITS8 = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.0, 1.5, 0.2])
N_DRAWS = 20000


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_distribution_matches_softmax(temperature: float) -> None:
    tokens = sample(Sampler(CPU, seed=0), LOGITS8.expand(N_DRAWS, -1), make_reqs(N_DRAWS, temperature=temperature))
    expected = torch.softmax(LOGITS8.double() / temperature, dim=-1)
    stat = chi2_stat(tokens, expected)
    assert stat < CHI2_CRIT_DF7_ALPHA_1E4, (stat, torch.bincount(torch.tensor(tokens)).tolist())
    assert chi2_sf(stat, 7) > ALPHA
    # The test has power: the same draws are far from the distribution at another temperature.
    for wrong_t in (1.0, 0.5, 2.0):
        if wrong_t != temperature:
            wrong = torch.softmax(LOGITS8.double() / wrong_t, dim=-1)
            assert chi2_stat(tokens, wrong) > 10 * CHI2_CRIT_DF7_ALPHA_1E4


def test_seeded_rows_distribution_matches_softmax() -> None:
    """Seeded rows (one generator each) draw from the same distribution as the shared generator."""
    n = 8000
    reqs = [make_req(f"s{i}", seed=i, temperature=1.0) for i in range(n)]
    tokens = sample(Sampler(CPU, seed=0), LOGITS8.expand(n, -1), reqs)
    stat = chi2_stat(tokens, torch.softmax(LOGITS8.double(), dim=-1))
    assert chi2_sf(stat, 7) > ALPHA, stat


# --------------------------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------------------------
def test_logprobs_are_raw_log_softmax_with_rank_and_top_n() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 40, generator=gen) * 2
    reqs = [
        make_req("a", temperature=0.5, logprobs=5),
        make_req("b", temperature=0.0, logprobs=3),
        make_req("c", temperature=1.3, top_k=4, logprobs=0),
        make_req("d", temperature=1.0),  # no logprobs
        make_req("e", temperature=0.7, logprobs=1, repetition_penalty=1.5, presence_penalty=1.0),
        make_req("f", temperature=2.0, logprobs=7),
    ]
    reqs[4].append_token(int(logits[4].argmax()))
    rows = Sampler(CPU, seed=0)(logits.clone(), reqs)
    raw = torch.log_softmax(logits, dim=-1)
    for i, (req, row) in enumerate(zip(reqs, rows)):
        n = req.sampling_params.logprobs
        if n is None:
            assert row.logprob is None and row.rank is None and row.top_ids is None
            continue
        t = row.token_id
        assert row.logprob == pytest.approx(raw[i, t].item(), abs=1e-5)
        assert row.rank == 1 + int((raw[i] > raw[i, t]).sum())
        assert row.top_ids == raw[i].topk(n).indices.tolist()
        assert row.top_logprobs == pytest.approx(raw[i].topk(n).values.tolist(), abs=1e-5)
        assert len(row.top_ids) == n
    # Not the temperature-scaled distribution.
    scaled = torch.log_softmax(logits[0] / 0.5, dim=-1)
    assert abs(rows[0].logprob - scaled[rows[0].token_id].item()) > 1e-3
    assert rows[1].rank == 1  # greedy picks the top token


def test_logprob_rank_of_unlikely_token() -> None:
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    n = 400
    rows = Sampler(CPU, seed=0)(probs.log().expand(n, -1).clone(), make_reqs(n, logprobs=2))
    ranks = {row.token_id: row.rank for row in rows}
    assert ranks == {0: 1, 1: 2, 2: 3, 3: 4}
    for row in rows:
        assert row.logprob == pytest.approx(math.log(probs[row.token_id].item()), abs=1e-5)
        assert row.top_ids == [0, 1]


def test_logprobs_ignore_min_tokens_mask() -> None:
    """The raw logprob of eos is reported even while min_tokens keeps it from being sampled."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.5]])
    req = make_req(eos={1}, temperature=0.0, min_tokens=2, logprobs=2)
    row = Sampler(CPU, seed=0)(logits.clone(), [req])[0]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert row.token_id == 2
    assert row.rank == 2
    assert row.top_ids == [1, 2]
    assert row.top_logprobs[0] == pytest.approx(raw[1].item(), abs=1e-5)


# --------------------------------------------------------------------------------------------
# min_tokens
# --------------------------------------------------------------------------------------------
def test_min_tokens_masks_eos_until_reached() -> None:
    eos = 3
    logits = torch.tensor([[0.0, 1.0, 0.5, 10.0, -1.0]])
    req = make_req(eos={eos}, temperature=0.0, min_tokens=3, max_tokens=10)
    sampler = Sampler(CPU, seed=0)
    produced = []
    for _ in range(4):
        t = sample(sampler, logits, [req])[0]
        produced.append(t)
        req.append_token(t)
    assert produced == [1, 1, 1, eos]


def test_min_tokens_masks_stop_token_ids_and_all_eos_ids() -> None:
    logits = torch.tensor([[5.0, 6.0, 7.0, 0.0, 1.0]])
    req = make_req(eos={1, 2}, temperature=0.0, min_tokens=1, stop_token_ids=[0], max_tokens=5)
    assert sample(Sampler(CPU, seed=0), logits, [req]) == [4]
    req.append_token(4)
    assert sample(Sampler(CPU, seed=0), logits, [req]) == [2]


def test_min_tokens_masks_eos_when_sampling() -> None:
    n = 2000
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0]).expand(n, -1)
    sp = SamplingParams(min_tokens=1, temperature=1.0)
    reqs = [runner_request(f"r{i}", [0], sp, eos_token_ids={2}) for i in range(n)]
    tokens = sample(Sampler(CPU, seed=0), logits, reqs)
    assert set(tokens) == {0, 1, 3}


def test_min_tokens_does_not_touch_other_rows() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    a = make_req("a", eos={1}, temperature=0.0, min_tokens=2)
    b = make_req("b", eos={1}, temperature=0.0)
    assert sample(Sampler(CPU, seed=0), logits, [a, b]) == [2, 1]


def test_ignore_eos_leaves_nothing_for_min_tokens_to_mask() -> None:
    # With ignore_eos the eos token is an ordinary token: min_tokens has nothing to mask.
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    req = make_req(eos={1}, temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sample(Sampler(CPU, seed=0), logits, [req]) == [1]


# --------------------------------------------------------------------------------------------
# Penalties
# --------------------------------------------------------------------------------------------
def greedy_pick(logits: list[float], prompt: list[int], output: list[int] = (), **params) -> int:
    req = make_req(prompt=prompt, temperature=0.0, **params)
    for t in output:
        req.append_token(t)
    return sample(Sampler(CPU, seed=0), torch.tensor([logits]), [req])[0]


def test_repetition_penalty_divides_positive_logits() -> None:
    logits = [2.0, 1.5, -5.0, -5.0]
    assert greedy_pick(logits, prompt=[0]) == 0
    assert greedy_pick(logits, prompt=[0], repetition_penalty=1.2) == 0  # 2/1.2 = 1.67 > 1.5
    assert greedy_pick(logits, prompt=[0], repetition_penalty=1.4) == 1  # 2/1.4 = 1.43 < 1.5
    assert greedy_pick(logits, prompt=[2], repetition_penalty=2.0) == 0  # token 0 not seen
    # Seen in the output counts too (and only once: it is not a frequency penalty).
    assert greedy_pick(logits, prompt=[3], output=[0], repetition_penalty=1.4) == 1
    assert greedy_pick(logits, prompt=[3], output=[0, 0, 0], repetition_penalty=1.2) == 0


def test_repetition_penalty_multiplies_negative_logits() -> None:
    logits = [-1.0, -1.5, -9.0]
    assert greedy_pick(logits, prompt=[0], repetition_penalty=1.4) == 0  # -1.4 > -1.5
    assert greedy_pick(logits, prompt=[0], repetition_penalty=1.6) == 1  # -1.6 < -1.5


def test_repetition_penalty_below_one_rewards_repeats() -> None:
    logits = [1.0, 1.5, -9.0]
    assert greedy_pick(logits, prompt=[0], repetition_penalty=0.5) == 0  # 1/0.5 = 2 > 1.5
    assert greedy_pick(logits, prompt=[0], repetition_penalty=0.8) == 1  # 1.25 < 1.5


def test_presence_penalty_output_tokens_only() -> None:
    logits = [1.0, 0.8, -9.0]
    assert greedy_pick(logits, prompt=[0], presence_penalty=0.5) == 0  # prompt tokens are not penalised
    assert greedy_pick(logits, prompt=[2], output=[0], presence_penalty=0.1) == 0  # 0.9 > 0.8
    assert greedy_pick(logits, prompt=[2], output=[0], presence_penalty=0.3) == 1  # 0.7 < 0.8
    # Presence is counted once however often the token appeared.
    assert greedy_pick(logits, prompt=[2], output=[0] * 5, presence_penalty=0.1) == 0
    # Negative presence penalty encourages repeats.
    assert greedy_pick([0.8, 1.0, -9.0], prompt=[2], output=[0], presence_penalty=-0.3) == 0


def test_frequency_penalty_scales_with_count() -> None:
    logits = [1.0, 0.75, -9.0]
    # 1.0 - 0.1 * count vs 0.75: two repeats still win, three do not.
    assert greedy_pick(logits, prompt=[0, 0, 0, 0], frequency_penalty=0.1) == 0  # prompt not counted
    assert greedy_pick(logits, prompt=[2], output=[0, 0], frequency_penalty=0.1) == 0
    assert greedy_pick(logits, prompt=[2], output=[0, 0, 0], frequency_penalty=0.1) == 1
    assert greedy_pick(logits, prompt=[2], output=[0, 2, 0, 2, 0], frequency_penalty=0.1) == 1


def test_presence_and_frequency_combine() -> None:
    logits = [1.0, 0.55, -9.0]
    # 1.0 - 0.2 (presence) - 0.1 * 2 (frequency) = 0.6 > 0.55; one more repeat: 0.5 < 0.55.
    assert greedy_pick(logits, prompt=[2], output=[0, 0], presence_penalty=0.2, frequency_penalty=0.1) == 0
    assert greedy_pick(logits, prompt=[2], output=[0, 0, 0], presence_penalty=0.2, frequency_penalty=0.1) == 1


def test_penalties_are_per_row() -> None:
    logits = torch.tensor([[2.0, 1.5, -5.0]] * 3)
    a = make_req("a", prompt=[0], temperature=0.0, repetition_penalty=2.0)
    b = make_req("b", prompt=[0], temperature=0.0)
    c = make_req("c", prompt=[1], temperature=0.0, frequency_penalty=1.0)
    c.append_token(0)
    assert sample(Sampler(CPU, seed=0), logits, [a, b, c]) == [1, 0, 1]


def test_penalties_shape_the_sampled_distribution() -> None:
    """Penalties apply to sampled rows too: a heavily penalised token all but disappears."""
    n = 2000
    sp = SamplingParams(temperature=1.0, presence_penalty=2.0, frequency_penalty=2.0)
    reqs = []
    for i in range(n):
        r = runner_request(f"r{i}", [1], sp, eos_token_ids=set())
        for _ in range(5):
            r.append_token(0)
        reqs.append(r)
    logits = torch.tensor([2.0, 0.0, 0.0, 0.0]).expand(n, -1)
    tokens = sample(Sampler(CPU, seed=0), logits, reqs)
    # Token 0's logit drops from 2 to 2 - 2 - 10 = -10: p ~ 1.5e-5 instead of 0.71.
    assert tokens.count(0) <= 2
    assert set(tokens) >= {1, 2, 3}


@pytest.mark.parametrize("path", ["kernel", "chunked"])
@pytest.mark.parametrize("vocab", [5, 50, 4096 + 7, 3 * 1024, 10_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torch_argmax(vocab, dtype, path, monkeypatch):
    """Both ways argmax_rows takes (cpu_kernels' one pass over contiguous rows, and the chunked amax
    it falls back to) give torch.argmax's answer: the first maximum, with ties across chunks, inside a
    chunk, across the kernel's 16 lanes (an earlier index in a later lane), in a short last chunk or
    tail, -0.0 against 0.0, rows of -inf, NaN (counted as the maximum), and rows strided in memory."""
    if path == "kernel":
        assert sampler_module.fused_kernels(torch.empty(1)) is not None, "the C++ kernels must build here"
    else:
        monkeypatch.setattr(sampler_module, "fused_kernels", lambda x: None)
    torch.manual_seed(vocab)
    x = torch.randn(12, vocab).round(decimals=1).to(dtype)  # coarse values: many ties
    x[1] = 0.0
    x[2, [5 % vocab, (1024 * 2 + 5) % vocab]] = 50.0
    x[3, -1] = 50.0
    x[4, -3:] = 50.0
    x[5] = float("-inf")
    x[6, [17 % vocab, 2 % vocab]] = 60.0  # lane 1 holds index 17, lane 2 index 2: the answer is 2
    x[7] = -1.0
    x[7, [3 % vocab, (vocab - 1)]] = torch.tensor([-0.0, 0.0], dtype=dtype)
    x[8, [vocab // 2, vocab - 1]] = float("nan")
    x[9, -1] = float("nan")
    x[10, 0] = float("inf")
    expected = x.argmax(dim=-1)
    assert torch.equal(argmax_rows(x), expected)
    wide = torch.full((12, vocab + 40), 99.0, dtype=dtype)
    wide[:, 7:7 + vocab] = x
    strided = wide[:, 7:7 + vocab]  # rows 40 apart in memory
    assert torch.equal(argmax_rows(strided), expected)


def test_sampler_leaves_the_callers_logits_alone():
    """Sampling works in place on its own float32 copy, never on the model's logits."""
    logits = torch.randn(3, 50)
    before = logits.clone()
    reqs = [make_req(temperature=0.7, min_tokens=2), make_req(temperature=0.0), make_req(temperature=1.0)]
    Sampler(CPU, seed=0)(logits, reqs)
    assert torch.equal(logits, before)


def test_vocab_major_logits_give_the_same_tokens():
    """The same logits laid out (vocab, rows), as the CPU LM head can produce them, sample the same
    tokens: greedy, temperature, seeded and min_tokens rows alike."""
    torch.manual_seed(1)
    vocab = 5000  # 4 full chunks and a short one
    logits = torch.randn(6, vocab) * 30.0  # a wide range: many logits more than 80 below the max
    vocab_major = logits.T.contiguous().T
    assert vocab_major.stride() == (1, 6)

    def reqs():
        return [make_req("g", temperature=0.0), make_req("t", temperature=0.8), make_req("s", temperature=1.0, seed=7),
                make_req("m", eos={int(logits[3].argmax())}, temperature=1.0, min_tokens=3),
                make_req("u", temperature=1.0), make_req("h", temperature=0.0)]

    assert Sampler.reads_any_layout(reqs())
    row_major_tokens = sample(Sampler(CPU, seed=3), logits, reqs())
    assert [r.token_id for r in Sampler(CPU, seed=3)(vocab_major, reqs())] == row_major_tokens
    assert row_major_tokens[3] != int(logits[3].argmax())
    assert not Sampler.reads_any_layout([make_req(temperature=1.0, top_p=0.9)])
    assert not Sampler.reads_any_layout([make_req(temperature=0.0, logprobs=1)])


def test_far_below_max_tokens_keep_a_tiny_mass_and_banned_ones_none():
    """Logits more than 80 below the max are raised to max - 80 before exp (a fast, normal float), so
    they could still be drawn with mass ~2e-35; a min_tokens ban stays exactly 0 even when the
    banned token holds the row's max."""
    n, vocab = 400, 2100
    logits = torch.full((n, vocab), -500.0)
    logits[:, 0] = 50.0  # eos: the max, banned by min_tokens
    logits[:, 1500] = -20.0  # the only other token within 80 of the max
    sp = SamplingParams(min_tokens=5, temperature=1.0)
    reqs = [runner_request(f"r{i}", [0], sp, eos_token_ids={0}) for i in range(n)]
    assert set(sample(Sampler(CPU, seed=0), logits, reqs)) == {1500}


def test_top_k_candidates_per_row_and_bans():
    """Every row with a top-k samples among torch.topk's candidates: each row stays inside its own
    top-k (k differs per row), a min_tokens-banned token is never drawn (the top-k is taken among the
    tokens left, as in vLLM), and every allowed candidate does come up."""
    torch.manual_seed(0)
    vocab, n = 3000, 600
    row = torch.randn(vocab)
    order = row.argsort(descending=True)
    best = order[:6].tolist()
    reqs = [make_req(f"a{i}", temperature=5.0, top_k=2) for i in range(n)]
    reqs += [make_req(f"b{i}", temperature=5.0, top_k=5, eos={best[0]}, min_tokens=1) for i in range(n)]
    tokens = sample(Sampler(CPU, seed=0), row.expand(2 * n, -1), reqs)
    assert set(tokens[:n]) == set(best[:2])
    assert set(tokens[n:]) == set(best[1:6])  # best[0] is banned first: the top 5 of the rest


def test_top_p_without_top_k_draws_among_candidates_inside_the_nucleus():
    """A top-p-only row on a large vocabulary samples among its 1024 best tokens when they hold more
    than top_p of the whole row's mass: the nucleus (measured against the whole vocabulary, not the
    candidates) is the same as the full sort's, and its tokens come up in their renormalised ratios."""
    gen = torch.Generator().manual_seed(0)
    vocab, n = 5000, 4000
    row = torch.randn(vocab, generator=gen) * 0.5 - 2
    row[:4] = torch.tensor([9.0, 8.5, 8.0, 7.0])  # 0.454, 0.275, 0.167, 0.061 of the whole row's mass
    top_p = 0.91
    best, _ = row[None].topk(1024, dim=-1)
    scale = _nucleus_coverage(row[None].clone(), best, [0], torch.tensor([0]), torch.tensor([[top_p]]))
    assert scale is not None and top_p < scale.item() < 0.99  # the tail past the candidates holds ~3%
    reference = torch.isfinite(_top_k_top_p(row[None].clone(), torch.tensor([0]), torch.tensor([[top_p]])))[0]
    nucleus = set(torch.nonzero(reference).flatten().tolist())
    # Mass before token 3 is 0.896 of the whole row (< 0.91: kept) but 0.92 of the candidates' mass:
    # a nucleus measured against the candidates alone would wrongly drop it.
    assert nucleus == {0, 1, 2, 3}
    reqs = [make_req(f"p{i}", top_p=top_p) for i in range(n)] + [make_req(f"k{i}", top_k=2) for i in range(n)]
    tokens = sample(Sampler(CPU, seed=0), row.expand(2 * n, -1), reqs)
    assert set(tokens[:n]) == nucleus
    kept = torch.softmax(row[:4].double(), dim=-1)
    assert chi2_sf(chi2_stat(tokens[:n], kept), 3) > ALPHA
    assert set(tokens[n:]) == {0, 1}  # the top-k row in the same batch keeps its own cut


def test_top_p_nucleus_wider_than_the_candidates_falls_back_to_the_full_sort():
    gen = torch.Generator().manual_seed(1)
    vocab, n = 5000, 1000
    row = torch.randn(vocab, generator=gen) * 0.05  # nearly flat: a 0.9 nucleus holds ~4,500 tokens
    best, _ = row[None].topk(1024, dim=-1)
    assert _nucleus_coverage(row[None].clone(), best, [0], torch.tensor([0]), torch.tensor([[0.9]])) is None
    nucleus = torch.isfinite(_top_k_top_p(row[None].clone(), torch.tensor([0]), torch.tensor([[0.9]])))[0]
    tokens = sample(Sampler(CPU, seed=0), row.expand(n, -1), make_reqs(n, top_p=0.9))
    assert all(nucleus[t] for t in tokens)
    rank = {t: r for r, t in enumerate(row.argsort(descending=True).tolist())}
    assert sum(rank[t] >= 1024 for t in tokens) > n // 2  # far past the candidates, as the nucleus is


@pytest.mark.parametrize("params", [dict(top_p=0.8), dict(top_k=20), dict(top_k=20, top_p=0.7, min_p=0.01)])
def test_seeded_row_draws_the_same_token_on_the_candidate_and_full_paths(params):
    """Alone, a top-k / top-p row samples among torch.topk's candidates; beside a row with neither,
    the batch takes the full-vocabulary path. A seeded row must not notice."""
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(3000, generator=gen) * 2
    differ = 0
    for seed in range(150):
        alone = sample(Sampler(CPU, seed=0), row[None], [make_req("s", seed=seed, **params)])
        batched = sample(Sampler(CPU, seed=0), row.expand(2, -1),
                         [make_req("s", seed=seed, **params), make_req("plain", temperature=1.0)])
        assert alone[0] == batched[0], seed
        differ += alone[0] != sample(Sampler(CPU, seed=0), row[None], [make_req("s", seed=seed + 1, **params)])[0]
    assert differ > 50  # the seeds really do draw different tokens


# --------------------------------------------------------------------------------------------
# Counter-based draws of seeded requests
# --------------------------------------------------------------------------------------------
def _splitmix64_uniform(seed: int, draw: int) -> float:
    """splitmix64 in Python's exact integers modulo 2^64: what seeded_uniform computes in int64 tensors."""
    mask = (1 << 64) - 1
    x = (seed + (draw + 1) * 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    return (x >> 11) * 2.0 ** -53


def test_seeded_uniform_is_splitmix64_with_64_bit_wraparound() -> None:
    from pagedllm.model_executor.sampler import _seed_bits, seeded_uniform

    seeds = [0, 1, 42, 2**31 - 1, 2**63 - 1, 2**64 - 1, -5, 12345678901234567890]
    draws = [0, 1, 7, 1000, 2**40]
    pairs = [(s, d) for s in seeds for d in draws]
    got = seeded_uniform(torch.tensor([_seed_bits(s) for s, _ in pairs]), torch.tensor([d for _, d in pairs]))
    assert got.dtype == torch.float64
    expected = [_splitmix64_uniform(s & ((1 << 64) - 1), d) for s, d in pairs]
    assert got.tolist() == expected
    assert all(0.0 <= u < 1.0 for u in expected) and len(set(expected)) == len(expected)


def test_seeded_draw_depends_only_on_seed_and_position() -> None:
    """The n-th token of a seeded request is drawn with the n-th number of its seed, whatever came
    before in the sampler (other steps, other requests): a request recomputed after preemption, or
    sent again, draws the same tokens."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(1, 500, generator=gen)
    fresh = make_req("a", seed=3, temperature=1.0)
    busy_sampler = Sampler(CPU, seed=0)
    for _ in range(5):  # the shared generator and other requests move on; the seeded draw does not
        sample(busy_sampler, torch.randn(4, 500, generator=gen), make_reqs(4, temperature=1.0))
    later = make_req("b", seed=3, temperature=1.0)
    for _ in range(3):
        t = sample(Sampler(CPU, seed=0), logits, [fresh])[0]
        assert sample(busy_sampler, logits, [later])[0] == t
        fresh.append_token(t)
        later.append_token(t)


@pytest.mark.parametrize("penalty", [5e-324, 1e-40, 1e-30, 1e30, 3.4e38])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_extreme_repetition_penalty_never_unmasks_a_token(penalty: float, temperature: float) -> None:
    """A structured output's mask sets forbidden logits to -inf before sampling. A penalty so small it is 0 in
    float32 (5e-324), or so large the division overflows, once turned -inf * 0 into nan and the allowed row
    into inf: the draw then picked a masked token (a guided_choice answered ""). Masked stays masked."""
    vocab = 64
    allowed = [5, 9]
    logits = torch.full((8, vocab), float("-inf"))
    logits[:, 5], logits[:, 9] = 3.0, -2.0
    reqs = []
    for i in range(8):
        r = runner_request(f"r{i}", list(range(vocab)), SamplingParams(temperature=temperature, seed=i,
                                                                       repetition_penalty=penalty))
        reqs.append(r)
    tokens = sample(Sampler(CPU, seed=0), logits, reqs)
    assert set(tokens) <= set(allowed), tokens
