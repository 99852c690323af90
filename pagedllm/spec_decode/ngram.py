"""N-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of the sequence's
last n tokens, for n from prompt_lookup_max down to prompt_lookup_min (vLLM's ngram method). No model runs:
summaries, code edits and extraction repeat spans of their prompt, and those spans come back as drafts."""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: list[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens continuing `tokens`: after the last n tokens' latest earlier occurrence (the longest n in
    [min_n, max_n] that has one). Empty when none occurs."""
    seq = np.asarray(tokens, dtype=np.int64)
    total = len(seq)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = seq[total - n:]
        # Candidate starts: positions i < total - n where seq[i:i + n] == suffix, found from the last token of
        # the pattern (one vectorised compare), then checked whole, latest first.
        ends = np.flatnonzero(seq[n - 1:total - 1] == suffix[-1]) + n - 1  # end index of each candidate
        for end in ends[::-1]:
            start = end - n + 1
            if np.array_equal(seq[start:end + 1], suffix):
                return seq[end + 1:end + 1 + k].tolist()
    return []
