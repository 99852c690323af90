"""Markers in a reply that is still being written: a stream holds back the tail that may still become one."""
from __future__ import annotations


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` are a proper prefix of `marker` (they may become it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
