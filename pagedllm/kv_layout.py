"""How a model's layers share the paged KV cache: groups of layers with one block table each (vLLM's hybrid
KV cache manager, in small).

A model whose layers all attend over the whole sequence has one group: every layer's K/V of a block lives
under one block id, as before. A model with sliding-window layers (gpt-oss alternates windowed and full
layers; Mistral windows every layer) keeps a window group's blocks only while they are inside the window:
the blocks a request's queries can no longer see go back to the pool, and its table points there to the
null block, which is never written. So a gpt-oss request of 8k tokens holds 128 tokens of K/V in its
windowed layers, not 8k.

Every group has the same number of layers, so a block id means the same bytes in every group: the cache
is one tensor of `num_slots` layers, and slot j holds the j-th layer of every group (layer `groups[g].layers[j]`
reads and writes slot j through group g's table). Layers of each kind are cut into groups of gcd(counts)
layers: gpt-oss-20b's 12 windowed and 12 full layers make two groups of 12.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd

from pagedllm.utils import cdiv

NULL_BLOCK = 0  # where a window group's table points below the window (reserved from the pool, never written)


def sliding_windows(hf_config) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers reads the config: the layers config.layer_types names
    sliding_attention (Qwen2, Qwen3, gpt-oss), or every layer where there are no layer_types and a
    sliding_window is set (Mistral, Mixtral, Qwen3-MoE: transformers clears it when use_sliding_window is
    false). None: full attention."""
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    layers = hf_config.num_hidden_layers
    if window is None or types is None:
        return (window,) * layers
    return tuple(window if types[i] == "sliding_attention" else None for i in range(layers))


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table per request, and the window they all attend over (None: all keys)."""

    layers: tuple[int, ...]
    window: int | None = None

    def first_needed_block(self, num_computed_tokens: int, block_size: int) -> int:
        """The first block a query at position `num_computed_tokens` (or later) still reads: the ones before it
        hold keys out of every future query's window. 0 for a full-attention group."""
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window + 1) // block_size

    def max_blocks_held(self, num_tokens: int, block_size: int, num_new_tokens: int = 1) -> int:
        """The most blocks a request holds in this group on its way to `num_tokens` tokens, computing up to
        `num_new_tokens` a step (decoding: 1): all of them for full attention; otherwise the blocks a step's
        keys span, from its first query's window start to its last token: w + n - 1 positions, one block
        more where they do not start on a block's first position."""
        total = cdiv(num_tokens, block_size)
        if self.window is None:
            return total
        return min(total, cdiv(self.window + num_new_tokens - 2, block_size) + 1)


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVGroup, ...]

    @classmethod
    def of(cls, windows: Sequence[int | None]) -> KVCacheLayout:
        """Group layers by window: one group when every layer has the same; otherwise each kind's layers (in
        order) cut into groups of gcd(the kinds' layer counts)."""
        by_window: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            by_window.setdefault(window, []).append(layer)
        size = 0
        for layers in by_window.values():
            size = gcd(size, len(layers))
        return cls(tuple(KVGroup(tuple(layers[i:i + size]), window)
                         for window, layers in by_window.items() for i in range(0, len(layers), size)))

    @classmethod
    def of_config(cls, hf_config) -> KVCacheLayout:
        return cls.of(sliding_windows(hf_config))

    @property
    def num_slots(self) -> int:
        """Layers per group: the KV cache tensor's layer count."""
        return len(self.groups[0].layers)

    @property
    def has_windows(self) -> bool:
        """Some group drops blocks below its window: the pool then reserves NULL_BLOCK for their tables."""
        return any(g.window is not None for g in self.groups)

    @property
    def reserved_blocks(self) -> int:
        return int(self.has_windows)

    def slot_of(self, layer: int) -> tuple[int, int]:
        """(group, slot) of a model layer."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise IndexError(f"layer {layer} is in no KV group")

    def blocks_per_sequence(self, num_tokens: int, block_size: int, num_new_tokens: int = 1) -> int:
        """The most pool blocks one request holds (every group's table together) on its way to `num_tokens`
        tokens, computing up to `num_new_tokens` a step."""
        return sum(g.max_blocks_held(num_tokens, block_size, num_new_tokens) for g in self.groups)

    def describe(self) -> str:
        """E.g. '2 groups of 12 layers: 12 full, 12 with a 128-token window' (the plan's and the log's words)."""
        full = sum(len(g.layers) for g in self.groups if g.window is None)
        windows = sorted({g.window for g in self.groups if g.window is not None})
        windowed = sum(len(g.layers) for g in self.groups if g.window is not None)
        parts = ([f"{full} full-attention"] if full else []) + (
            [f"{windowed} with a {'/'.join(map(str, windows))}-token window"] if windowed else [])
        return f"{len(self.groups)} groups of {self.num_slots} layers: {', '.join(parts)}"
