"""gpt-oss (OpenAI's open-weight mixture of experts): a Llama-shaped decoder with biases on q/k/v/o, attention
sinks (a learned logit per head in each softmax's denominator), sliding-window (128) and full attention layers
alternating (config.layer_types), YaRN rope, and in every layer experts with biases and a clamped SwiGLU, routed
by a softmax over the top-k router logits.

Its checkpoints hold each layer's experts as stacked tensors, x @ W layout, gate and up interleaved by column:
`mlp.experts.gate_up_proj` (experts, hidden, 2 * width), `..._bias` (experts, 2 * width), `mlp.experts.down_proj`
(experts, width, hidden), `..._bias` (experts, hidden). They are read into FusedMoE's layout ([gate | up] rows,
(out, in) per expert), this rank's share of the width under tensor parallelism."""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.distributed.sharding import ShardLayout
from pagedllm.model_executor.layers import ClampedSwigluAndMul
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.model_executor.moe import FusedMoE, Routing, SparseMoeBlock

_STACKED_EXPERTS = re.compile(
    r"^(?P<block>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)(?:_(?P<kind>bias|blocks|scales))?$")


class GptOssForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, max_positions)  # (windows: config.layer_types)
        for layer in self.model.layers:
            layer.self_attn.attn.enable_sinks()

    def make_mlp(self, layer_index: int) -> nn.Module:
        cfg = self.config
        return SparseMoeBlock(cfg.hidden_size, cfg.num_local_experts, ShardLayout.of(cfg).moe_width,
                              Routing(cfg.num_experts_per_tok, topk_then_softmax=True),
                              ClampedSwigluAndMul(cfg.swiglu_alpha, cfg.swiglu_limit), bias=True)

    def checkpoint_names(self, module_name: str) -> list[str]:
        return [module_name.replace(".mlp.gate", ".mlp.router")] if module_name.endswith(".mlp.gate") \
            else super().checkpoint_names(module_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The router is `mlp.router` (our `mlp.gate`), the sinks the attention's, the experts stacked (see above)."""
        shards = ShardLayout.of(self.config)
        loaded: set[str] = set()

        def rest():
            for name, tensor in weights:
                stacked = _STACKED_EXPERTS.match(name)
                if stacked is not None:
                    experts: FusedMoE = self._param_owner(f"{stacked['block']}.experts", name)
                    load = _load_stacked if stacked["kind"] in (None, "bias") else _load_mxfp4
                    parts = load(experts, stacked["proj"], stacked["kind"], tensor, shards)
                    loaded.update(f"{stacked['block']}.experts{p}" for p in parts)
                    continue
                yield name.replace(".mlp.router.", ".mlp.gate.").replace(".self_attn.sinks", ".self_attn.attn.sinks"), \
                    tensor

        return super().load_weights(rest()) | loaded


def _load_stacked(experts: FusedMoE, proj: str, kind: str | None, tensor: torch.Tensor, shards: ShardLayout
                  ) -> list[str]:
    """One stacked checkpoint tensor into `experts`: gate/up de-interleaved, (out, in) per expert, this rank's
    share of the width (a row-parallel bias on rank 0 only)."""
    bias = kind == "bias"
    part = "bias" if bias else "weight"
    width, start = experts.width, shards.rank * experts.width
    parts = []
    for e in range(experts.num_experts):
        t = tensor[e]
        if proj == "gate_up_proj":  # (hidden, 2 * width) columns gate0, up0, gate1, ... (bias: (2 * width,))
            gate, up = t[..., 0::2], t[..., 1::2]
            gate, up = gate[..., start:start + width], up[..., start:start + width]
            if not bias:
                gate, up = gate.T, up.T
            parts.append(experts.load_expert(e, "gate", gate, part))
            parts.append(experts.load_expert(e, "up", up, part))
        else:  # down: (width, hidden) -> (hidden, width); its bias (hidden,) added once, by rank 0
            down = (t if shards.rank == 0 else torch.zeros_like(t)) if bias else t[start:start + width].T
            parts.append(experts.load_expert(e, "down", down, part))
    return parts


def _load_mxfp4(experts: FusedMoE, proj: str, kind: str, tensor: torch.Tensor, shards: ShardLayout) -> list[str]:
    """One MXFP4 checkpoint tensor (quant/mxfp4.py) into `experts`: `*_blocks` (experts, out, in / 32, 16) as
    (out, in / 2) bytes per expert, `*_scales` (experts, out, in / 32); gate and up rows de-interleaved."""
    if shards.size > 1:
        raise ValueError("MXFP4 experts under tensor parallelism are not supported yet")
    part = "weight" if kind == "blocks" else "scale"
    parts = []
    for e in range(experts.num_experts):
        t = tensor[e].reshape(tensor.shape[1], -1)  # (out, in / 2) bytes or (out, in / 32) exponents
        if proj == "gate_up_proj":
            parts.append(experts.load_expert(e, "gate", t[0::2], part))
            parts.append(experts.load_expert(e, "up", t[1::2], part))
        else:
            parts.append(experts.load_expert(e, "down", t, part))
    return parts


