"""Linear layers and how they multiply. A layer holds its weights; its LinearMethod (vLLM's name) computes the
product, chosen once per layer at load: the reference here (F.linear, any device), the CPU's packed layouts
(cpu_ops.py), int8 weights (quantization.py), fixed tiles for batch invariance (batch_invariant.py). A
model's forward is the same on every device; the seam a quantized or mixture-of-experts layer plugs into is
the method."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.layers import ActAndMul


class LinearMethod:
    """The reference: the layer's weight and bias as they are, in PyTorch ops."""

    name = "plain"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x @ weight^T + bias."""
        return F.linear(x, layer.weight, layer.bias)

    def apply_and_act(self, layer: GateUpLinear, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of a [gate | up] layer's product (a method may compute both in one pass)."""
        return layer.act_and_mul(self.apply(layer, x))

    def apply_logits(self, layer: LMHead, x: torch.Tensor, vocab_major: bool) -> torch.Tensor:
        """(rows, vocab) logits; with `vocab_major` the caller reads any layout, so a method may return the
        transposed view of a (vocab, rows) product when that orientation is faster."""
        return self.apply(layer, x)


UNQUANTIZED = LinearMethod()


class Linear(nn.Linear):
    """nn.Linear's weight (out, in) and bias, multiplied by `method`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.method: LinearMethod = UNQUANTIZED

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method={self.method.name}"


class GateUpLinear(Linear):
    """A gated MLP's gate and up projections stacked, (2 * width, in): its output is act(gate) * up, (rows,
    width). Computing the activation with the product lets a CPU engine's packed kernel give SiLU(gate) * up
    in one pass, never writing the (rows, 2 * width) product."""

    def __init__(self, in_features: int, width: int, bias: bool, hidden_act: str) -> None:
        super().__init__(in_features, 2 * width, bias=bias)
        self.act_and_mul = ActAndMul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply_and_act(self, x)


class LMHead(Linear):
    """The vocabulary projection (this rank's vocabulary rows under tensor parallelism)."""

    def logits(self, hidden: torch.Tensor, vocab_major: bool = False) -> torch.Tensor:
        return self.method.apply_logits(self, hidden, vocab_major)


class EmbeddingMethod:
    """How an embedding's rows are read: the reference, from its weight."""

    name = "plain"

    def apply(self, layer: Embedding, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight, layer.padding_idx, layer.max_norm, layer.norm_type,
                           layer.scale_grad_by_freq, layer.sparse)


PLAIN_EMBEDDING = EmbeddingMethod()


class Embedding(nn.Embedding):
    """nn.Embedding read through `method` (a CPU engine's tied LM head and embedding share one packed copy)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.method: EmbeddingMethod = PLAIN_EMBEDDING

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, ids)
