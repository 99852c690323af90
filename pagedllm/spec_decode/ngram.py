"""N-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of the sequence's
last n tokens, for n from prompt_lookup_max down to prompt_lookup_min (vLLM's ngram method). No model runs:
summaries, code edits and extraction repeat spans of their prompt, and those spans come back as drafts."""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: list[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens continuing `tokens`: after the last n tokens' latest earlier occurrence (the longest n in
    [min_n, max_n] that has one). Empty when none occurs.

    One pass over the sequence finds the earlier positions holding its last token; each of those candidates'
    match is then extended backwards a token at a time, all candidates at once (max_n small array operations),
    and the longest match, the latest among equals, wins."""
    seq = np.asarray(tokens, dtype=np.int64)
    total = len(seq)
    max_n = min(max_n, total - 1)
    if max_n < min_n:
        return []
    ends = np.flatnonzero(seq[:total - 1] == seq[-1])  # where earlier occurrences would end
    ends = ends[ends >= min_n - 1]
    if not len(ends):
        return []
    length = np.ones(len(ends), dtype=np.int64)  # each candidate's match, up to max_n tokens
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, max_n):
        alive &= ends - back >= 0
        alive[alive] = seq[ends[alive] - back] == seq[total - 1 - back]
        length += alive
    best = int(length.max())
    if best < min_n:
        return []
    end = ends[np.flatnonzero(length == best)[-1]]
    return seq[end + 1:end + 1 + k].tolist()
