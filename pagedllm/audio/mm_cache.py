"""The multimodal preprocessor cache: reference audio already encoded, found again by its content.

Key: sha256 of the audio bytes and their declared format, so the same clip sent twice (a voice
preset, or a client resending a reference) is encoded once. Values are codes (frames, num_codebooks)
kept as int16 (codebook ids are < 2**15). Bounded by bytes (--mm-processor-cache-gb); the least
recently used entries go first. Lives in host memory; the server counts it in the plan where host
memory is the device's (CPU, unified memory).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import torch


def content_key(data: bytes, fmt: str | None) -> str:
    h = hashlib.sha256()
    h.update((fmt or "").lower().encode() + b"\0")
    h.update(data)
    return h.hexdigest()


class EncodedAudioCache:
    """LRU of codes by content key, at most `capacity_bytes`. Thread-safe (the event loop reads it,
    the codec thread fills it). `queries` and `hits` count lookups, as vLLM's mm cache metrics do."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the multimodal cache needs a positive size, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.queries = 0
        self.hits = 0

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            self.queries += 1
            codes = self._entries.get(key)
            if codes is None:
                return None
            self.hits += 1
            self._entries.move_to_end(key)
            return codes.long()

    def put(self, key: str, codes: torch.Tensor) -> None:
        stored = codes.to(torch.int16).contiguous()
        size = stored.numel() * stored.element_size()
        if size > self.capacity_bytes:
            return  # larger than the whole cache: not kept
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_bytes -= old.numel() * old.element_size()
            self._entries[key] = stored
            self.num_bytes += size
            while self.num_bytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.num_bytes -= evicted.numel() * evicted.element_size()

    def __len__(self) -> int:
        return len(self._entries)
