"""The pooling runner's end of a forward: a request's token states pooled across its prompt's chunks (last, mean or
first token), then its head: an embedding (cut to a Matryoshka size, normalised) or a classifier's probabilities.
Also the model's head for pooling, set up around the weights' load (attach_pooling_head, finish_pooling_head)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.pooler_config import PoolerConfig
from pagedllm.pooling_params import PoolingParams


def attach_pooling_head(model: nn.Module, config: PoolerConfig) -> None:
    """Before the weights are loaded: an embedding model and a checkpoint's classifier have no use for the LM head
    (it is not even read); a classifier gets its (num_labels, hidden) `score` matrix, as transformers names it."""
    if config.head != "tokens":
        model.lm_head = None
        model.ignored_weight_names = frozenset(model.ignored_weight_names | {"lm_head.weight"})
    if config.head == "score":
        model.score = nn.Linear(model.config.hidden_size, config.num_labels, bias=False)


@torch.no_grad()
def finish_pooling_head(model: nn.Module, config: PoolerConfig) -> None:
    """After the weights are loaded: a classifier from label tokens is the LM head's rows of those tokens (for
    Qwen3-Reranker one row, yes minus no: sigmoid(yes - no) is softmax(no, yes)[yes]); the LM head then goes."""
    if config.head != "tokens":
        return
    weight = model.lm_head.weight
    rows = weight[torch.tensor(config.label_token_ids, device=weight.device)]
    if config.qwen3_reranker:
        rows = (rows[1] - rows[0])[None]
    score = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    score.weight.copy_(rows)
    model.score = score
    model.lm_head = None


@dataclass
class PoolingState:
    """A pooling request's pool so far in the runner, across the chunks of its prompt."""

    total: torch.Tensor | None = None  # MEAN: the sum of the states so far, in float32
    count: int = 0
    first: torch.Tensor | None = None  # CLS: the first token's state


class Pooler:
    def __init__(self, config: PoolerConfig, score: nn.Module | None) -> None:
        self.config = config
        self.score = score  # a classifier's head (None for an embedding model)

    def add(self, state: PoolingState, start: int, hidden: torch.Tensor) -> None:
        """The states of prompt positions start .. start + len(hidden) - 1. A slice from position 0 starts the pool
        over (a request preempted by recompute computes its prompt again)."""
        if start == 0:
            state.total, state.count, state.first = None, 0, None
        kind = self.config.pooling_type
        if kind == "MEAN":
            part = hidden.float().sum(0)
            state.total = part if state.total is None else state.total + part
            state.count += len(hidden)
        elif kind == "CLS" and start == 0:
            state.first = hidden[0]

    def pooled(self, state: PoolingState, last: torch.Tensor) -> torch.Tensor:
        """The request's pooled state, once its last prompt token's state (`last`) is computed."""
        kind = self.config.pooling_type
        if kind == "MEAN":
            return (state.total / state.count).to(last.dtype)
        if kind == "CLS":
            return state.first
        return last

    def outputs(self, pooled: torch.Tensor, params: list[PoolingParams]) -> list[torch.Tensor]:
        """Each finished request's output (float32, on the host) from its pooled state (a row of `pooled`)."""
        c = self.config
        if c.task == "embed":
            out = []
            for row, p in zip(pooled.float(), params):
                if p.dimensions is not None:
                    row = row[:p.dimensions]
                if c.normalize if p.normalize is None else p.normalize:
                    row = F.normalize(row, p=2, dim=-1)
                out.append(row.cpu())
            return out
        logits = self.score(pooled).float()
        out = []
        for row, p in zip(logits, params):
            if c.use_activation if p.use_activation is None else p.use_activation:
                row = torch.sigmoid(row) if len(row) == 1 else torch.softmax(row, dim=-1)
            out.append(row.cpu())
        return out
