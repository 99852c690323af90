"""Mixture-of-experts layers: a router that picks each token's top-k experts and their weights, and the experts'
gated MLPs held as stacked weights, (experts, 2 * width, hidden) and (experts, hidden, width), multiplied by a
MoEMethod chosen once at load, as a Linear's LinearMethod is: the reference groups the step's tokens by expert
and runs each chosen expert's two GEMMs once (a loop over experts, never over tokens); a CPU engine's packs each
expert for cpu_kernels (cpu_ops.py). Under tensor parallelism every rank holds every expert, its share of each
expert's width (vLLM's default): the block's output is a partial sum, all-reduced after it like a dense MLP's."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.layers import ActAndMul
from pagedllm.model_executor.linear import Linear


def num_experts(cfg) -> int:
    """Experts per sparse layer as config.json names them (num_experts, num_local_experts); 0: a dense model."""
    return getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0


def expert_width(cfg) -> int:
    """Each expert's MLP width (Qwen3-MoE's moe_intermediate_size; Mixtral's and gpt-oss' experts are
    intermediate_size wide); a dense model's MLP width."""
    return getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size


def is_sparse_layer(cfg, index: int) -> bool:
    """Whether decoder layer `index` is a mixture of experts: every layer of a MoE model but Qwen3-MoE's
    `mlp_only_layers` and those off its `decoder_sparse_step`."""
    if not num_experts(cfg) or index in (getattr(cfg, "mlp_only_layers", None) or []):
        return False
    return (index + 1) % (getattr(cfg, "decoder_sparse_step", None) or 1) == 0


def experts_summary(cfg) -> str:
    """What a plan says of a mixture of experts' weights ("" for a dense model): all experts are held, a few read
    per token."""
    if not num_experts(cfg):
        return ""
    return f"every expert held: {num_experts(cfg)} per sparse layer, {cfg.num_experts_per_tok} used per token"


@dataclass(frozen=True)
class Routing:
    """How router logits become each token's experts and their weights.

    Default (Qwen3-MoE, Mixtral): softmax over all experts in fp32, the top-k probabilities, divided by their sum
    when `renormalize`, in the logits' dtype (Mixtral's stay fp32: `fp32_weights`, as transformers keeps them).
    topk_then_softmax (gpt-oss): the top-k logits, softmax over them."""

    top_k: int
    renormalize: bool = True
    topk_then_softmax: bool = False
    fp32_weights: bool = False

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), each (tokens, top_k)."""
        if self.topk_then_softmax:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return (top if self.fp32_weights else top.to(logits.dtype)), ids


class Router(Linear):
    """The gate: (tokens, hidden) -> each token's top-k experts and weights."""

    def __init__(self, hidden_size: int, num_experts: int, routing: Routing, bias: bool = False) -> None:
        super().__init__(hidden_size, num_experts, bias=bias)
        self.routing = routing

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.routing(self(x))


class MoEMethod:
    """The reference: each expert that has tokens this step multiplies them all at once, from its slice of
    the stacked weights.

    The step's tokens are gathered once in expert order, each expert reads its run of them and writes its
    weighted output to the same run, and one index_add_ sums every token's experts (in expert order, as
    transformers' loop does): a handful of ops per expert, which a decode step of Qwen3-30B-A3B's shape at
    batch 32 runs ~112 times per layer."""

    name = "grouped"

    def apply(self, layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        groups = ExpertGroups.of(ids, layer.num_experts)
        xs = x[groups.rows]
        ws = weights.flatten()[groups.order, None]
        ys = torch.empty_like(xs)
        for expert, start, end in groups.runs():
            ys[start:end] = self.expert_forward(layer, expert, xs[start:end]) * ws[start:end]
        return torch.zeros_like(x).index_add_(0, groups.rows, ys)

    def expert_forward(self, layer: FusedMoE, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's gated MLP on its tokens."""
        b13 = None if layer.w13_bias is None else layer.w13_bias[expert]
        b2 = None if layer.w2_bias is None else layer.w2_bias[expert]
        return F.linear(layer.act_and_mul(F.linear(x, layer.w13_weight[expert], b13)), layer.w2_weight[expert], b2)


@dataclass(frozen=True)
class ExpertGroups:
    """The step's (token, slot) pairs in expert order: `order` the flat slots (token * top_k + j) sorted by expert,
    `rows` their tokens, `counts` the pairs of each expert. One sort and one host read of the counts per layer."""

    order: torch.Tensor
    rows: torch.Tensor
    counts: list[int]

    @classmethod
    def of(cls, ids: torch.Tensor, num_experts: int) -> ExpertGroups:
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        return cls(order, order // ids.shape[1], torch.bincount(flat, minlength=num_experts).tolist())

    def runs(self):
        """(expert, start, end) of each expert chosen at least once: its pairs are order[start:end]."""
        start = 0
        for expert, count in enumerate(self.counts):
            if count:
                yield expert, start, start + count
                start += count


GROUPED = MoEMethod()


class FusedMoE(nn.Module):
    """`num_experts` gated MLPs of width `width` (this rank's share) as stacked weights: w13 is each expert's
    [gate | up] (rows), w2 its down projection. forward(x, weights, ids): sum over each token's experts of
    weight * expert(x)."""

    def __init__(self, num_experts: int, hidden_size: int, width: int, act_and_mul: nn.Module,
                 bias: bool = False) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.width = num_experts, hidden_size, width
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * width, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, width), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * width), requires_grad=False) if bias else None
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False) if bias else None
        self.act_and_mul = act_and_mul
        self.method: MoEMethod = GROUPED

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, weights, ids)

    # -- checkpoint loading: one tensor per expert and projection, as transformers saves them ----------------
    def load_expert(self, expert: int, projection: str, tensor: torch.Tensor, part: str = "weight") -> str:
        """Copy one expert's projection ("gate", "up" or "down"; this rank's slice) into the stacked `part`
        ("weight", "bias", or "scale" of quantized experts: quant/mxfp4.py). Returns the loaded part's name (for the
        loader's completeness check)."""
        stacked = "w2" if projection == "down" else "w13"
        target = getattr(self, f"{stacked}_{part}")
        dest = target.data[expert]
        block = getattr(self, "row_blocks", {}).get(part, 1)  # (quantized experts: quant/experts.py)
        if projection != "down" and block is not None:  # (None: indexed by input column, gate's and up's alike)
            rows = self.width // block
            dest = dest.narrow(0, 0 if projection == "gate" else rows, rows)
        if dest.shape != tensor.shape:
            raise ValueError(f"expert {expert}'s {projection} projection has shape {tuple(tensor.shape)}, the model "
                             f"expects {tuple(dest.shape)}")
        dest.copy_(tensor)
        return f"#{expert}.{projection}{'' if part == 'weight' else '.' + part}"

    def expected_parts(self) -> set[str]:
        stacked = [name[len("w13_"):] for name, _ in self.named_parameters(recurse=False) if name.startswith("w13_")]
        parts = ["" if name == "weight" else f".{name}" for name in stacked]
        return {f"#{e}.{p}{b}" for e in range(self.num_experts) for p in ("gate", "up", "down") for b in parts}

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, width={self.width}, method={self.method.name}"


# A checkpoint's per-expert tensor: `<block>.experts.<e>.<projection>.weight` (Qwen3-MoE: gate_proj / up_proj /
# down_proj; Mixtral: w1 / w3 / w2), `.bias`, or a quantized format's parameter (`.weight_scale`, ...).
EXPERT_TENSOR = re.compile(r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+?)\.(?P<kind>[a-z_]+)$")
PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP as a mixture of experts: route, then the experts. `act`: a hidden_act name (the
    [gate | up] activation of ActAndMul) or the activation module (gpt-oss' clamped SwiGLU); `bias`: the router
    and the experts have biases (gpt-oss)."""

    def __init__(self, hidden_size: int, num_experts: int, width: int, routing: Routing, act: str | nn.Module,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate = Router(hidden_size, num_experts, routing, bias=bias)
        act_and_mul = ActAndMul(act) if isinstance(act, str) else act
        self.experts = FusedMoE(num_experts, hidden_size, width, act_and_mul, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate.route(x)
        return self.experts(x, weights, ids)
