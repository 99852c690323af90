"""Which part of each weight a tensor-parallel rank holds (Megatron-style), and which sizes work.

- Column-parallel: q/k/v and gate/up (each expert's too) split by output rows. Query heads are split
  evenly; KV heads too when there are at least as many as ranks, else each KV head is replicated on the
  ranks whose query heads read it (ranks / kv_heads of them).
- Row-parallel: o_proj and down_proj split by input columns; their partial products are summed by one
  all-reduce each. A bias there is added once: rank 0 holds it, the others hold zeros.
- Vocab-parallel: embedding and LM head split by vocabulary rows, ceil(vocab / ranks) each, the last
  shard padded with zero rows (their logits are cut off after the gather).
- Attention sinks (gpt-oss) split with their query heads. Everything else (norms, rotary tables, KV-cache
  scales, MoE routers) is replicated; stacked expert tensors are read whole and sliced by the model.
Each rank reads only its slice of a checkpoint tensor (safetensors' get_slice): no rank reads the
whole checkpoint into memory."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.model_executor.moe import expert_width
from pagedllm.utils import cdiv

# How a checkpoint tensor is split, by the name of the module it belongs to (`model.layers.0.mlp.up_proj.weight`:
# up_proj): "column" (dim 0), "row" (dim 1; its bias on rank 0 only), "vocab" (dim 0, padded). Other modules
# (norms; Higgs Audio's audio embedding and audio head) are replicated.
_SPLITS = {
    "q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "column", "up_proj": "column",
    "o_proj": "row", "down_proj": "row", "embed_tokens": "vocab", "lm_head": "vocab",
    "w1": "column", "w3": "column", "w2": "row",  # Mixtral's experts: gate, up, down
}
ROW_PARALLEL = frozenset(m for m, kind in _SPLITS.items() if kind == "row")  # their all-reduce follows


def _attention_sizes(hf_config) -> tuple[int, int, int, int]:
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads, kv_heads, head_dim, hf_config.intermediate_size


def tensor_parallel_sizes(hf_config) -> list[int]:
    """The tensor-parallel sizes a model splits into: dividing its query heads and its MLP (and experts')
    width, and dividing or divided by its KV heads."""
    heads, kv_heads, _, intermediate = _attention_sizes(hf_config)
    experts = expert_width(hf_config)
    return [n for n in range(1, heads + 1) if heads % n == 0 and intermediate % n == 0 and experts % n == 0
            and (kv_heads % n == 0 or n % kv_heads == 0)]


def verify_tensor_parallel_size(hf_config, size: int) -> None:
    """Refuse a size the model cannot be split into, naming the sizes that work."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {size}.")
    able = tensor_parallel_sizes(hf_config)
    if size in able:
        return
    heads, kv_heads, _, intermediate = _attention_sizes(hf_config)
    experts = expert_width(hf_config)
    why = (f"the model has {heads} attention heads" if size > heads or heads % size else
           f"its MLP width {intermediate} is not divisible by {size}" if intermediate % size else
           f"its experts' width {experts} is not divisible by {size}" if experts % size else
           f"its {kv_heads} KV heads neither divide nor are divided by {size}")
    raise ValueError(f"--tensor-parallel-size {size} cannot split this model: {why}. Sizes that work: "
                     f"{', '.join(map(str, able))}.")


@dataclass(frozen=True)
class ShardLayout:
    """One rank's share of a model's heads, MLP width and vocabulary."""

    rank: int
    size: int
    num_heads: int  # the model's, all ranks together
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    expert_width: int  # each expert's MLP width, all ranks together (a dense model: intermediate_size)

    @classmethod
    def of(cls, hf_config, rank: int | None = None, size: int | None = None) -> ShardLayout:
        """The layout of `rank` of `size` (default: this process's rank of its tensor-parallel group)."""
        from pagedllm.distributed.parallel_state import tp_group

        group = tp_group()
        heads, kv_heads, head_dim, intermediate = _attention_sizes(hf_config)
        return cls(group.rank if rank is None else rank, group.size if size is None else size, heads, kv_heads,
                   head_dim, intermediate, hf_config.vocab_size, expert_width(hf_config))

    @property
    def heads(self) -> int:
        """Query heads on this rank."""
        return self.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        """KV heads on this rank (1, replicated, when there are fewer KV heads than ranks)."""
        return max(1, self.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        if self.num_kv_heads >= self.size:
            return self.rank * self.kv_heads
        return self.rank * self.num_kv_heads // self.size  # the KV head this rank's query heads read

    @property
    def mlp_width(self) -> int:
        return self.intermediate_size // self.size

    @property
    def moe_width(self) -> int:
        """Each expert's width on this rank."""
        return self.expert_width // self.size

    @property
    def vocab_rows(self) -> int:
        """Vocabulary rows per rank (the last rank's padded)."""
        return cdiv(self.vocab_size, self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def split_of(self, name: str) -> tuple[str, int, int] | None:
        """How this rank reads checkpoint tensor `name`: (kind, start, length) along its split dimension
        ("column" and "vocab": dim 0; "row": dim 1; "zero": a row-parallel bias off rank 0), or None: whole."""
        if self.size == 1:
            return None
        parts = name.split(".")
        kind = _SPLITS.get(parts[-2]) if len(parts) >= 2 else None
        d = self.head_dim
        if parts[-1] == "sinks":  # gpt-oss' attention sinks: one per query head
            return "column", self.rank * self.heads, self.heads
        if kind == "q":
            return "column", self.rank * self.heads * d, self.heads * d
        if kind == "kv":
            return "column", self.first_kv_head * d, self.kv_heads * d
        mlp = self.moe_width if "experts" in parts else self.mlp_width
        if kind == "column":
            return "column", self.rank * mlp, mlp
        if kind == "row":
            if name.endswith(".bias"):
                return None if self.rank == 0 else ("zero", 0, 0)
            width = self.heads * d if parts[-2] == "o_proj" else mlp
            return "row", self.rank * width, width
        if kind == "vocab":
            return "vocab", self.vocab_start, self.vocab_rows
        return None
