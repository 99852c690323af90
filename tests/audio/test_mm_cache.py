"""The cache of encoded reference audio: content keys, LRU by bytes, hit/query counts."""
from __future__ import annotations

import pytest
import torch

from pagedllm.audio.mm_cache import EncodedAudioCache, content_key


def codes(frames: int, value: int = 1) -> torch.Tensor:
    return torch.full((frames, 4), value, dtype=torch.long)  # int16 in the cache: frames x 4 x 2 bytes


def test_key_is_the_content_and_its_format():
    assert content_key(b"abc", "wav") == content_key(b"abc", "WAV")
    assert content_key(b"abc", "wav") != content_key(b"abd", "wav")
    assert content_key(b"abc", "wav") != content_key(b"abc", "mp3")


def test_hits_misses_and_values():
    cache = EncodedAudioCache(1 << 20)
    assert cache.get("a") is None
    cache.put("a", codes(10, 7))
    got = cache.get("a")
    assert got.dtype == torch.long and torch.equal(got, codes(10, 7))
    assert (cache.queries, cache.hits) == (2, 1)


def test_least_recently_used_goes_first_when_bytes_run_out():
    cache = EncodedAudioCache(3 * 80)  # three entries of 10 frames x 4 codebooks x 2 bytes
    for key in "abc":
        cache.put(key, codes(10))
    cache.get("a")  # a is now the most recent
    cache.put("d", codes(10))
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("d") is not None
    assert cache.num_bytes == 240 and len(cache) == 3
    cache.put("huge", codes(100))  # larger than the whole cache: not kept, nothing evicted
    assert cache.get("huge") is None and len(cache) == 3


def test_size_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        EncodedAudioCache(0)
