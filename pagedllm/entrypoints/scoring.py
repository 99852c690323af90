"""Scoring query/document pairs (LLM.score, /v1/score, /v1/rerank), as vLLM scores them: a cross-encoder (a
single-label classifier) reads each pair as one prompt; an embedding model embeds both sides and scores their
cosine similarity."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.errors import InvalidParameterError
from pagedllm.pooler_config import (
    QWEN3_RERANKER_INSTRUCTION,
    QWEN3_RERANKER_PREFIX,
    QWEN3_RERANKER_SUFFIX,
    PoolerConfig,
)

Text = str | list[int]  # a text, or its token ids


def score_pairs(first: Text | list[Text], second: Text | list[Text],
                names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[Text, Text]]:
    """vLLM's pairing: one first item against each second item, or the two lists item by item (same length)."""
    def as_list(items, name: str) -> list[Text]:
        if isinstance(items, str) or (isinstance(items, list) and items and all(isinstance(t, int) for t in items)):
            return [items]
        if not isinstance(items, list) or not items:
            raise InvalidParameterError(name, f"{name} must be a text, token ids, or a non-empty list of them.")
        return items

    firsts, seconds = as_list(first, names[0]), as_list(second, names[1])
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise InvalidParameterError(names[0], f"{names[0]} has {len(firsts)} items and {names[1]} {len(seconds)}: "
                                              f"give one {names[0]} for all, or as many as {names[1]}.")
    return list(zip(firsts, seconds))


def check_scores(pooler: PoolerConfig | None) -> None:
    """Scores need a pooling model that gives them: an embedding model, or a single-label classifier."""
    if pooler is None:
        raise InvalidParameterError("model", "scores need a pooling model (a cross-encoder, or an embedding model) "
                                             "served with --runner pooling; this one generates.")
    if not pooler.scores:
        raise InvalidParameterError("model", f"scores come from a single-label classifier (a cross-encoder) or an "
                                             f"embedding model; this one classifies into {pooler.num_labels} labels.")


def pair_prompt(tokenizer, pooler: PoolerConfig, query: Text, document: Text) -> dict:
    """One cross-encoder prompt of a pair: the tokenizer's own pair encoding (query, document), or Qwen3-Reranker's
    prompt (its model card's) for a model served with is_original_qwen3_reranker. Token-id sides are joined as
    given."""
    if isinstance(query, list) and isinstance(document, list):
        return {"prompt_token_ids": query + document}
    if tokenizer is None:
        raise InvalidParameterError("text_1", "this model has no tokenizer, so both sides of a pair must be token ids.")
    if not isinstance(query, str) or not isinstance(document, str):
        raise InvalidParameterError("text_1", "a pair is two texts or two lists of token ids, not one of each.")
    if pooler.qwen3_reranker:
        middle = f"<Instruct>: {QWEN3_RERANKER_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        ids = [i for part in (QWEN3_RERANKER_PREFIX, middle, QWEN3_RERANKER_SUFFIX)
               for i in tokenizer.encode(part, add_special_tokens=False)]
        return {"prompt": QWEN3_RERANKER_PREFIX + middle + QWEN3_RERANKER_SUFFIX, "prompt_token_ids": ids}
    ids = tokenizer(text=query, text_pair=document, add_special_tokens=True)["input_ids"]
    return {"prompt": None, "prompt_token_ids": list(ids)}


def cosine_scores(first: list[torch.Tensor], second: list[torch.Tensor]) -> list[float]:
    """The cosine similarity of each pair of embeddings."""
    return [float(F.cosine_similarity(a.float(), b.float(), dim=0)) for a, b in zip(first, second)]
