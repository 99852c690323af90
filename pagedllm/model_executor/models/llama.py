"""The Llama family: Llama, Mistral, Qwen2, Qwen3 (one decoder, a few config switches)."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagedllm.distributed.parallel_state import tp_group
from pagedllm.distributed.sharding import ShardLayout
from pagedllm.errors import UnsupportedModelError
from pagedllm.kv_layout import sliding_windows
from pagedllm.model_executor.attention import PagedAttention
from pagedllm.model_executor.kv_quant import kv_scale_target, scale_value
from pagedllm.model_executor.layers import RMSNorm, RotaryEmbedding, vocab_parallel_embed
from pagedllm.model_executor.linear import Embedding, GateUpLinear, Linear, LMHead
from pagedllm.model_executor.moe import EXPERT_TENSOR, PROJECTIONS, FusedMoE


class LlamaAttention(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        shards = ShardLayout.of(cfg)  # this tensor-parallel rank's heads (all of them on one device)
        self.num_heads = shards.heads
        self.num_kv_heads = shards.kv_heads
        self.head_dim = shards.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v projections stacked in one matmul (loaded from the checkpoint's three).
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # Queries and keys are adjacent columns: rotate them as one (tokens, heads + kv_heads, dim).
            qk = qkv[:, : self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = self.rotary(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q, k = qkv[:, : self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(n, self.num_heads, self.head_dim))  # (tokens, heads, dim)
            k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
            q, k = self.rotary(positions, q), self.rotary(positions, k)
        return self.o_proj(self.attn(q, k, v).reshape(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = ShardLayout.of(cfg).mlp_width  # this rank's columns
        # act(gate) * up of the stacked gate and up projections (loaded from the checkpoint's two).
        self.gate_up_proj = GateUpLinear(cfg.hidden_size, self.intermediate_size, bias, cfg.hidden_act)
        self.down_proj = Linear(self.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, rotary, qkv_bias, o_bias, qk_norm, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, qkv_bias, o_bias, qk_norm)
        self.mlp = mlp  # dense (LlamaMLP) or a mixture of experts (moe.SparseMoeBlock)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The layer on the residual stream as vLLM runs it: x is the previous layer's output, not yet
        added to `residual` (None for the first layer, whose x is the stream itself); returns this
        layer's output and the stream, so each residual add fuses with the norm after it. The stream
        tensor may be updated in place. Under tensor parallelism o_proj and down_proj give this rank's
        partial sums: one all-reduce after each."""
        tp = tp_group()
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = tp.all_reduce(self.self_attn(positions, x))
        x, residual = self.post_attention_layernorm(x, residual)
        return tp.all_reduce(self.mlp(x)), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, max_positions: int, qkv_bias, o_bias, qk_norm,
                 make_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = RotaryEmbedding(head_dim, max_positions, cfg.rope_parameters)
        self.embed_tokens = Embedding(ShardLayout.of(cfg).vocab_rows, cfg.hidden_size)  # this rank's rows
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, rotary, qkv_bias, o_bias, qk_norm, make_mlp(i)) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h, residual = vocab_parallel_embed(self.embed_tokens, input_ids), None  # (tokens, hidden)
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return self.norm(h) if residual is None else self.norm(h, residual)[0]


# The decoder's tensors in a checkpoint of the bare decoder (transformers' Qwen3Model, LlamaModel), whose names
# have no "model." in front.
BARE_DECODER_NAMES = ("embed_tokens.", "layers.", "norm.")
# Checkpoint tensor name piece -> (our stacked parameter, shard id)
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Causal LM over the Llama decoder. Subclasses flip the switches their checkpoints need."""

    qkv_bias_default = False
    qk_norm = False
    supports_tensor_parallel = True  # heads, MLP and vocabulary split across ranks (distributed/sharding.py)
    # What the runner reads of every model class (an audio model sets them otherwise):
    audio_spec = None  # multi-codebook frames in and out (audio_sampling.DelayPatternSpec); None: text
    logits_split_by_vocab = True  # each rank computes its vocabulary rows' logits (gathered by the runner)
    ignored_weight_names: frozenset[str] = frozenset()  # checkpoint tensors not even read

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        attention_bias = getattr(cfg, "attention_bias", self.qkv_bias_default)
        qkv_bias, o_bias = self._biases(attention_bias)
        self.model = LlamaModel(cfg, max_positions, qkv_bias, o_bias, self.qk_norm, self.make_mlp)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = LMHead(cfg.hidden_size, ShardLayout.of(cfg).vocab_rows, bias=False)  # this rank's rows
        self.tie_weights()
        for layer, window in zip(self.model.layers, sliding_windows(cfg)):
            layer.self_attn.attn.sliding_window = window

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after to_empty(), which unties them)."""
        if self.tie_word_embeddings and self.lm_head is not None:  # (a pooling model may have none)
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def _biases(attention_bias: bool) -> tuple[bool, bool]:
        return attention_bias, attention_bias

    def make_mlp(self, layer_index: int) -> nn.Module:
        """Layer `layer_index`'s MLP (a mixture-of-experts model returns its sparse block where it has one)."""
        return LlamaMLP(self.config, getattr(self.config, "mlp_bias", False))

    @classmethod
    def verify_config(cls, cfg, max_model_len: int) -> None:
        """Refuse, by name, config features this implementation would otherwise silently ignore."""
        kinds = set(getattr(cfg, "layer_types", None) or ())
        if not kinds <= {"sliding_attention", "full_attention"}:
            raise UnsupportedModelError(f"layer_types {sorted(kinds - {'sliding_attention', 'full_attention'})} are "
                                        f"not supported (sliding_attention and full_attention are).")
        for name, allowed in (("pretraining_tp", (None, 1)), ("attn_logit_softcapping", (None,))):
            if getattr(cfg, name, None) not in allowed:
                raise UnsupportedModelError(f"{name}={getattr(cfg, name)} is not supported.")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, vocab_major: bool = False) -> torch.Tensor:
        """(rows, vocab) logits (this rank's vocabulary rows under tensor parallelism: the runner gathers
        them). `vocab_major`: the caller reads any layout, so a transposed view may come back (a CPU
        engine's LM head uses that: cpu_ops.py)."""
        return self.lm_head.logits(hidden, vocab_major)

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def decoder_layers(self) -> nn.ModuleList:
        """The repeated blocks: what --quantization quantizes and --cpu-offload-gb offloads."""
        return self.model.layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters (stacking q/k/v and gate/up). Returns loaded names."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name.startswith(BARE_DECODER_NAMES):
                name = "model." + name  # a bare decoder's checkpoint (Qwen3Model: embedding models ship so)
            if name == "lm_head.weight" and (self.tie_word_embeddings or self.lm_head is None):
                continue
            if self._load_kv_scale(name, tensor):
                continue
            expert = EXPERT_TENSOR.match(name)
            if expert is not None:
                experts = self._param_owner(f"{expert['block']}.experts", name)
                part = experts.load_expert(int(expert["expert"]), PROJECTIONS[expert["proj"]], tensor, expert["kind"])
                loaded.add(f"{expert['block']}.experts{part}")
                continue
            piece = next((p for p in STACKED_PARAMS if f".{p}." in name), None)
            if piece is not None:
                target, shard = STACKED_PARAMS[piece]
                pname = name.replace(f".{piece}.", f".{target}.")
                param = self._param(params, pname, name)
                part = self._shard_slice(param, pname, shard)
                if part.shape == param.shape and loaded & {f"{pname}#{s}" for s in ("q", "k", "v", 0, 1)} \
                        and not torch.equal(part, tensor.to(part.dtype)):
                    raise ValueError(f"checkpoint tensor {name!r} differs from its fused siblings' (a Linear "
                                     f"holding them as one needs the same {pname.rsplit('.', 1)[1]})")
                part.copy_(tensor)
                loaded.add(f"{pname}#{shard}")
            else:
                param = self._param(params, name, name)
                if param.shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(param.shape)}")
                param.data.copy_(tensor)
                loaded.add(name)
        return loaded

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        """Set an fp8 KV-cache scale (vLLM's checkpoint names); False when `name` is not one."""
        target = kv_scale_target(name)
        if target is None:
            return False
        layer, which = target
        if layer >= len(self.model.layers):
            raise ValueError(f"checkpoint tensor {name!r} does not belong to this model")
        attn = self.model.layers[layer].self_attn.attn
        for kind in which:
            setattr(attn, f"{kind}_scale", scale_value(name, tensor))
        return True

    def expected_weight_names(self) -> set[str]:
        names = set()
        for prefix, module in self.named_modules():
            if isinstance(module, FusedMoE):
                names.update(f"{prefix}{part}" for part in module.expected_parts())
        for pname, _ in self.named_parameters():
            if ".experts.w" in pname:
                continue  # (named by expert above)
            target = pname.split(".")[-2]
            shards = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}.get(target)
            if shards:
                names.update(f"{pname}#{s}" for s in shards)
            else:
                names.add(pname)
        return names

    def _param_owner(self, path: str, ckpt_name: str) -> nn.Module:
        try:
            return self.get_submodule(path)
        except AttributeError:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} does not belong to this model") from None

    @staticmethod
    def _param(params: dict, pname: str, ckpt_name: str) -> nn.Parameter:
        if pname not in params:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} does not belong to this model")
        return params[pname]

    def _shard_slice(self, param: torch.Tensor, pname: str, shard) -> torch.Tensor:
        """The part of fused parameter `pname` (qkv_proj's or gate_up_proj's) that checkpoint part `shard` fills:
        its output rows; in a quantized Linear's parameter, the entries of those rows (an FP8 block scale has one
        per block of rows), or all of it for a parameter indexed by input column (row block None)."""
        module_name, leaf = pname.rsplit(".", 1)
        layer = self.get_submodule(module_name)
        if shard in ("q", "k", "v"):
            attn = self.get_submodule(module_name.rsplit(".", 1)[0])
            q, kv = attn.q_size, attn.kv_size
            start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
        else:
            size = layer.out_features // 2
            start = shard * size
        block = getattr(layer, "row_blocks", {}).get(leaf, 1)
        if block is None:
            return param.data
        if start % block or size % block:
            raise ValueError(f"{pname}: part {shard!r} holds rows {start}:{start + size}, not whole blocks of {block} "
                             f"rows; a checkpoint with block scales needs each fused part in whole blocks")
        return param.data.narrow(0, start // block, size // block)

    def checkpoint_names(self, module_name: str) -> list[str]:
        """The checkpoint modules whose weights module `module_name` holds: q_proj, k_proj and v_proj for a fused
        qkv_proj, gate_proj and up_proj for gate_up_proj, else the module itself."""
        parent, _, leaf = module_name.rpartition(".")
        parts = [piece for piece, (target, _) in STACKED_PARAMS.items() if target == leaf]
        return [f"{parent}.{p}" for p in parts] or [module_name]


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def _biases(attention_bias: bool) -> tuple[bool, bool]:
        return True, False  # Qwen2 always has q/k/v bias and never an o_proj bias


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
