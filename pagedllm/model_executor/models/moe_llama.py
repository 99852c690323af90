"""Llama-family decoders whose MLPs are mixtures of experts: Qwen3-MoE (Qwen3's attention; sparse layers every
`decoder_sparse_step`, dense ones in `mlp_only_layers`) and Mixtral (Mistral's attention, every layer sparse)."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.distributed.sharding import ShardLayout
from pagedllm.model_executor.models.llama import LlamaMLP, MistralForCausalLM, Qwen3ForCausalLM
from pagedllm.model_executor.moe import Routing, SparseMoeBlock, is_sparse_layer, num_experts


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, layer_index: int) -> nn.Module:
        cfg = self.config
        if not is_sparse_layer(cfg, layer_index):
            return LlamaMLP(cfg, False)
        routing = Routing(cfg.num_experts_per_tok, renormalize=bool(getattr(cfg, "norm_topk_prob", False)))
        return SparseMoeBlock(cfg.hidden_size, num_experts(cfg), ShardLayout.of(cfg).moe_width, routing,
                              cfg.hidden_act)


class MixtralForCausalLM(MistralForCausalLM):
    def make_mlp(self, layer_index: int) -> nn.Module:
        cfg = self.config
        return SparseMoeBlock(cfg.hidden_size, num_experts(cfg), ShardLayout.of(cfg).moe_width,
                              Routing(cfg.num_experts_per_tok, fp32_weights=True), cfg.hidden_act)

    def checkpoint_names(self, module_name: str) -> list[str]:
        return [name.replace(".mlp.", ".block_sparse_moe.") for name in super().checkpoint_names(module_name)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Mixtral's checkpoints name the sparse block `block_sparse_moe` (its experts' projections w1, w3, w2)."""
        return super().load_weights((name.replace(".block_sparse_moe.", ".mlp."), t) for name, t in weights)

