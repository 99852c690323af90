"""Checking drafts against the target model: one sampling row per draft position (and one after the last),
each under the request's own parameters as if the drafts before it were already its tokens (penalties,
min_tokens, a seeded request's draw counter), then the standard speculative-sampling rule (Leviathan et al.
2023; Chen et al. 2023), which keeps the target's distribution exactly:

- greedy rows: a draft is kept while it equals the target's own choice at its position; the first mismatch
  is replaced by that choice, and when all are kept the next position's choice is added;
- sampled rows: draft x (proposed with probability q(x)) is kept with probability min(1, p(x) / q(x)); the first
  rejected one is replaced by a draw from max(0, p - q) renormalised; when all are kept, a draw from the next
  position's p is added. An n-gram draft is certain (q is one-hot), so it is kept with probability p(x) and
  the replacement is drawn from p without x.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.step_input import TokenSequence

# Seeded requests draw their accept / reject numbers from their seed xor this (their token draws use the seed).
ACCEPT_SEED_SALT = 0x5DEECE66D


def speculates(request) -> bool:
    """Requests that get drafts: those generating text (a structured output's too: the engine masks each draft
    position's row by its grammar)."""
    return request.pooling_params is None and request.audio_state is None


class DraftPosition(TokenSequence):
    """A request as the sampler sees it at draft position j: its tokens followed by the first j drafts."""

    def __init__(self, request, drafts_before: list[int] | tuple[int, ...]) -> None:
        self.request_id = request.request_id
        self.sampling_params = request.sampling_params
        self.prompt_token_ids = request.prompt_token_ids
        self.num_prompt_tokens = request.num_prompt_tokens
        self.eos_token_ids = request.eos_token_ids
        self.all_token_ids = request.all_token_ids + list(drafts_before)


@dataclass
class VerifyGroup:
    """One request's rows in a step that checks drafts: logits rows first_row .. first_row + len(drafts)."""

    request: object
    first_row: int
    drafts: tuple[int, ...]

    @property
    def num_rows(self) -> int:
        return len(self.drafts) + 1


def positions(request, drafts: tuple[int, ...]) -> list:
    """The sampler's view of each of a request's rows (the request itself when it has no drafts)."""
    if not drafts:
        return [request]
    return [DraftPosition(request, drafts[:j]) for j in range(len(drafts) + 1)]


def greedy_chain(drafts: tuple[int, ...], target: list[int]) -> list[int]:
    """Kept drafts, then the target's token at the first mismatch (or after the last draft). `target`: the
    target's choice at each of the len(drafts) + 1 positions."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == target[kept]:
        kept += 1
    return list(drafts[:kept]) + [target[kept]]


def sampled_chain(probs: torch.Tensor, drafts: tuple[int, ...], accept_uniform: list[float],
                  draw_uniform: list[float], draft_probs: torch.Tensor | None = None) -> list[int]:
    """The speculative-sampling rule for one request. probs: (len(drafts) + 1, vocab) the target's processed
    distribution at each position; accept_uniform[j]: the number draft j is tested with; draw_uniform[j]: the
    number position j's replacement (or the bonus token) is drawn with; draft_probs: (len(drafts), vocab) the
    proposer's distributions, None for a certain (n-gram) draft."""
    from pagedllm.model_executor.sampler import sample_from_probs

    k = len(drafts)
    ids = torch.tensor(drafts, dtype=torch.long, device=probs.device)
    p_draft = probs[:k].gather(1, ids[:, None]).squeeze(1).double().tolist() if k else []
    q_draft = [1.0] * k if draft_probs is None else \
        draft_probs.gather(1, ids[:, None]).squeeze(1).double().tolist()
    for j in range(k):
        if accept_uniform[j] * q_draft[j] < p_draft[j]:  # u < p / q without dividing by a zero q
            continue
        residual = probs[j].double() - (_one_hot(drafts[j], probs) if draft_probs is None else draft_probs[j].double())
        residual = residual.clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q: nothing to correct toward (cannot reject with u < 1 then)
            residual = probs[j].double()
        token = int(sample_from_probs(residual[None], torch.tensor([draw_uniform[j]], dtype=torch.float64,
                                                                   device=probs.device))[0])
        return list(drafts[:j]) + [token]
    token = int(sample_from_probs(probs[k:k + 1].double(), torch.tensor([draw_uniform[k]], dtype=torch.float64,
                                                                        device=probs.device))[0])
    return list(drafts) + [token]


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(like.shape[-1], dtype=torch.float64, device=like.device)
    out[token] = 1.0
    return out
