"""Test helpers: tiny random-weight HF checkpoints on disk and a transformers greedy reference.

The engine is checked against transformers on the same weights, so the helpers here write
folders that look like real hub checkpoints (config.json, safetensors, generation config,
tokenizer) for each supported architecture, with weights scaled so greedy argmax is stable.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from pagedllm.demo import build_tokenizer

TINY_TOKENIZER_VOCAB = 512
WEIGHT_STD = 0.15  # default init (0.02) gives near-uniform logits; this gives clear argmax margins
BIAS_STD = 0.1
NORM_STD = 0.1
FINAL_NORM_SCALE = 4.0  # scales the logits: std ~5 instead of ~1.2, so top-2 gaps dwarf float noise
SEED = 0

ARCHS: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
MOE_ARCHS: tuple[str, ...] = ("qwen3_moe", "mixtral", "gpt_oss")  # mixtures of experts

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
}

# Per-architecture defaults, chosen so each arch exercises a different feature of the loader.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    # Llama 3.1 style: untied lm_head, llama3 RoPE scaling (all three frequency bands are hit
    # with head_dim 16 and original_max_position_embeddings 128).
    "llama": {
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    },
    # Mistral: head_dim (32) != hidden_size / num_heads (16), no sliding window.
    "mistral": {
        "head_dim": 32,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "rope_scaling": None,
    },
    # Qwen2: q/k/v biases (always on in Qwen2), tied embeddings, multi-query attention.
    "qwen2": {
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "rope_theta": 10000.0,
        "rope_scaling": None,
    },
    # Qwen3: per-head RMSNorm on q and k, explicit head_dim, large rope_theta.
    "qwen3": {
        "head_dim": 32,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
    },
    # Qwen3-MoE: 8 experts of width 32, top-2 renormalized; layer 1 dense (mlp_only_layers), 0 and 2 sparse.
    "qwen3_moe": {
        "head_dim": 32,
        "num_hidden_layers": 3,
        "tie_word_embeddings": False,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "use_sliding_window": False,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
    },
    # gpt-oss: 4 experts of width 64 with biases, top-2; sliding window of 8 on layers 0 and 2, sinks, YaRN.
    "gpt_oss": {
        "head_dim": 16,
        "num_hidden_layers": 3,
        "max_position_embeddings": 2048,  # (YaRN's 32 x 64)
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "attention_bias": True,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False},
    },
    # Mixtral: 4 experts of width 128 (intermediate_size), top-2.
    "mixtral": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
    },
}


def _classes(arch: str) -> tuple[type, type]:
    import transformers as tf

    table = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
    }
    if arch not in table:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(table)}")
    return table[arch]


def _reinit_weights(model: torch.nn.Module, seed: int) -> None:
    """Re-draw all weights with larger scales so logits have clear margins (see WEIGHT_STD)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights are listed once
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name == "model.norm.weight":
                param.copy_(FINAL_NORM_SCALE * (1.0 + NORM_STD * noise))
            elif "norm" in name:
                param.copy_(1.0 + NORM_STD * noise)
            elif name.endswith(".bias"):
                param.copy_(BIAS_STD * noise)
            else:
                param.copy_(WEIGHT_STD * noise)


def _shard_safetensors(path: Path, shards: int) -> None:
    """Split model.safetensors into ``shards`` files plus model.safetensors.index.json (HF layout)."""
    from safetensors.torch import load_file, save_file

    single = path / "model.safetensors"
    tensors = load_file(str(single))
    names = sorted(tensors)
    if not 1 < shards <= len(names):
        raise ValueError(f"shards must be in [2, {len(names)}], got {shards}")
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total = sum(sizes)
    groups: list[list[str]] = [[] for _ in range(shards)]
    acc = 0
    for i, (name, size) in enumerate(zip(names, sizes)):
        # Contiguous split by cumulative size, but never leave a later shard empty.
        idx = min(acc * shards // total, shards - 1, i)
        idx = max(idx, shards - (len(names) - i))
        groups[idx].append(name)
        acc += size
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in group}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    single.unlink()


def _make_qwen_style_tokenizer(path: Path) -> None:
    """Give the tokenizer Qwen's normalizer / pre-tokenizer, as real Qwen checkpoints have.

    transformers 5 loads any ``model_type == "qwen2"`` folder with ``Qwen2Tokenizer``, which
    swaps in this pipeline (and would add an ``<|endoftext|>`` unk token unless unk is null).
    Writing the same pipeline into tokenizer.json keeps tokenizer.json and AutoTokenizer in
    agreement, so an engine reading either gets identical token ids.
    """
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.save(str(path / "tokenizer.json"))
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg["unk_token"] = None
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tiny_model(path: Path | str, arch: str, shards: int = 1, seed: int = SEED, **config_overrides: Any) -> Path:
    """Write a tiny random-weight checkpoint for ``arch`` to ``path`` and return the path.

    ``config_overrides`` replace config.json entries, e.g. ``num_hidden_layers=3``,
    ``tie_word_embeddings=True`` or ``rope_scaling={"type": "linear", "factor": 2.0}``.
    RoPE is written the way hub checkpoints do (top-level ``rope_theta`` plus ``rope_scaling``,
    null when unscaled); pass ``rope_parameters=...`` instead to get the transformers-5 layout.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config_cls, model_cls = _classes(arch)

    build_tokenizer(path, TINY_TOKENIZER_VOCAB)
    if arch in ("qwen2", "qwen3"):
        _make_qwen_style_tokenizer(path)
    tok = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    tok_vocab = len(tok["model"]["vocab"]) + sum(
        1 for t in tok["added_tokens"] if t["content"] not in tok["model"]["vocab"]
    )
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    bos_id, eos_id = special["<|begin_of_text|>"], special["<|end_of_text|>"]

    cfg: dict[str, Any] = {
        **_COMMON,
        **copy.deepcopy(_ARCH_DEFAULTS[arch]),
        "vocab_size": tok_vocab,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    v5_rope = "rope_parameters" in config_overrides
    if v5_rope:
        cfg.pop("rope_scaling", None)
        cfg.pop("rope_theta", None)
    cfg.update(copy.deepcopy(config_overrides))
    if cfg["vocab_size"] < tok_vocab:
        raise ValueError(f"vocab_size {cfg['vocab_size']} < tokenizer size {tok_vocab}")

    # transformers mutates the rope dict it is given, so hand it a copy.
    hf_config = config_cls(**copy.deepcopy(cfg))
    torch.manual_seed(seed)
    model = model_cls(hf_config).to(torch.float32)
    _reinit_weights(model, seed)
    model.generation_config.bos_token_id = bos_id
    model.generation_config.eos_token_id = eos_id
    model.save_pretrained(path, safe_serialization=True)

    # Rewrite config.json: keep what transformers wrote, but with RoPE keys as in hub checkpoints.
    cfg_path = path / "config.json"
    saved = json.loads(cfg_path.read_text())
    if not v5_rope:
        saved.pop("rope_parameters", None)
    saved.pop("dtype", None)
    saved.update({k: copy.deepcopy(v) for k, v in cfg.items() if k != "rope_parameters"})
    saved["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")

    if shards > 1:
        _shard_safetensors(path, shards)
    return path


_HF_MODELS: dict[str, Any] = {}


def load_hf_model(path: Path | str) -> Any:
    """Load (once per path) a checkpoint with transformers in float32, eval mode."""
    from transformers import AutoModelForCausalLM

    key = str(Path(path).resolve())
    if key not in _HF_MODELS:
        model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32)
        _HF_MODELS[key] = model.eval()
    return _HF_MODELS[key]


def hf_greedy(
    path: Path | str,
    prompt_token_ids: list[int],
    max_new_tokens: int,
    ignore_eos: bool = True,
) -> tuple[list[int], list[float]]:
    """Greedy-decode one prompt with transformers; return generated ids and their logprobs.

    Logprobs are log_softmax of the raw (unprocessed) float32 logits, matching what an engine
    reports for greedy sampling. With ``ignore_eos`` generation never stops early and eos is not
    masked either (like vLLM's ignore_eos): exactly ``max_new_tokens`` tokens come back.
    """
    return greedy_generate(load_hf_model(path), prompt_token_ids, max_new_tokens, ignore_eos)


def greedy_generate(model: Any, prompt_token_ids: list[int], max_new_tokens: int,
                    ignore_eos: bool = True) -> tuple[list[int], list[float]]:
    """hf_greedy on a transformers model already loaded."""
    input_ids = torch.tensor([prompt_token_ids], dtype=torch.long)
    kwargs: dict[str, Any] = {}
    if ignore_eos:
        kwargs["eos_token_id"] = None
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=model.generation_config.pad_token_id or 0,
            **kwargs,
        )
    new_ids = out.sequences[0, input_ids.shape[1] :].tolist()
    logprobs = [
        float(torch.log_softmax(step_logits[0].float(), dim=-1)[tok]) for step_logits, tok in zip(out.logits, new_ids)
    ]
    return new_ids, logprobs
