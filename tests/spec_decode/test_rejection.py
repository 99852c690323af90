"""The speculative-sampling rule on hand-made distributions: the first token it returns is distributed as the
target's p whatever the draft, for a certain (n-gram) draft and for a draft model's q; a rule with the classic
bug (the replacement drawn from p instead of the residual) fails the same test. Greedy: kept while equal."""
from __future__ import annotations

import torch

from pagedllm.spec_decode import verify
from pagedllm.spec_decode.verify import greedy_chain, sampled_chain
from tests.test_sampler import chi2_sf

DRAWS = 8_000
ALPHA = 1e-4


def _first_tokens(rule, p: torch.Tensor, drafts: tuple[int, ...], q: torch.Tensor | None, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    k = len(drafts)
    u = torch.rand(DRAWS, 2 * (k + 1), generator=g, dtype=torch.float64).tolist()
    probs = p.expand(k + 1, -1).contiguous()
    return [rule(probs, drafts, row[:k + 1], row[k + 1:], q)[0] for row in u]


def _p_value(tokens: list[int], p: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(p)).double()
    expected = p.double() * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04, 0.0, 0.0])
Q = torch.tensor([0.05, 0.05, 0.60, 0.05, 0.05, 0.05, 0.15, 0.0])  # a draft model that likes token 2 (and 6, which p never picks)


def test_an_ngram_draft_keeps_the_target_distribution_and_is_kept_with_its_probability():
    for draft in (0, 3, 6):  # likely, unlikely, impossible under p
        tokens = _first_tokens(sampled_chain, P, (draft, 1), None, seed=draft)
        assert _p_value(tokens, P) > ALPHA, draft


def test_a_draft_models_proposals_keep_the_target_distribution():
    """Drafts drawn from q, checked against p: the kept-or-replaced token is distributed as p."""
    g = torch.Generator().manual_seed(7)
    drafts = torch.multinomial(Q, DRAWS, replacement=True, generator=g).tolist()
    u = torch.rand(DRAWS, 4, generator=g, dtype=torch.float64).tolist()
    probs, q = P.expand(2, -1).contiguous(), Q[None]
    tokens = [sampled_chain(probs, (d,), row[:2], row[2:], q)[0] for d, row in zip(drafts, u)]
    assert _p_value(tokens, P) > ALPHA
    assert _p_value(drafts, Q) > ALPHA  # (the drafts themselves follow q, not p)


def test_a_biased_rule_fails_the_same_test():
    def biased(probs, drafts, accept_u, draw_u, draft_probs=None):
        """The classic bug: the replacement of a rejected draft drawn from p, not from p without the draft."""
        from pagedllm.model_executor.sampler import sample_from_probs
        if accept_u[0] < float(probs[0, drafts[0]]):
            return [drafts[0]]
        return [int(sample_from_probs(probs[:1].double(), torch.tensor([draw_u[0]], dtype=torch.float64))[0])]

    tokens = _first_tokens(biased, P, (0,), None, seed=11)
    assert _p_value(tokens, P) < 1e-6


def test_greedy_keeps_drafts_while_they_equal_the_targets_choice():
    assert greedy_chain((5, 6, 7), [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert greedy_chain((5, 6, 7), [5, 9, 7, 8]) == [5, 9]
    assert greedy_chain((5,), [4, 1]) == [4]
    assert greedy_chain((), [3]) == [3]


def test_drafts_after_a_rejection_are_not_looked_at():
    probs = torch.zeros(3, 4)
    probs[:, 1] = 1.0  # the target always says 1
    out = sampled_chain(probs, (1, 2), [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
    assert out == [1, 1]  # 1 kept (p = 1), 2 rejected (p = 0) and replaced by 1; nothing after
    assert verify.greedy_chain((1, 2), [1, 1, 3]) == [1, 1]
