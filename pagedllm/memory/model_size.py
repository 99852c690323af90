"""Sizes read from files alone: weight bytes (safetensors headers or config shapes), KV bytes per
token, and an activation estimate for dry-run plans. Nothing here loads a weight."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from pagedllm.model_executor.kv_quant import kv_scale_target
from pagedllm.model_executor.quantization import (
    int8_weight_bytes,
    is_quantized_weight_name,
)
from pagedllm.utils import cdiv

_SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                         "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def _skipped(name: str, tied: bool) -> bool:
    """Checkpoint tensors the engine does not keep in memory (KV-cache scales become Python floats)."""
    return ("rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight") or kv_scale_target(name) is not None
            or name == "text_lm_head.weight")  # Higgs Audio v2's optional text head, unused for generation


def weight_bytes_from_headers(files: list[Path], dtype: torch.dtype, tied: bool, quantization: str | None = None,
                              prefix: str = "") -> int:
    """Exact bytes the weights take once loaded in `dtype` (floating tensors are cast to it) and
    quantized by `quantization`; only the tensors whose names start with `prefix`."""
    total = 0
    for f in files:
        for name, info in safetensors_header(f).items():
            if _skipped(name, tied) or not name.startswith(prefix):
                continue
            shape = info["shape"]
            if quantization == "int8" and is_quantized_weight_name(name):
                total += int8_weight_bytes(shape[0], shape[1], dtype)
                continue
            numel = 1
            for d in shape:
                numel *= d
            is_float = info["dtype"] in ("F64", "F32", "F16", "BF16")
            total += numel * (dtype.itemsize if is_float else _SAFETENSORS_ITEMSIZE[info["dtype"]])
    return total


def layer_weight_bytes_from_headers(files: list[Path], dtype: torch.dtype, quantization: str | None = None) -> int:
    """Bytes of one decoder layer's weights (all layers of the Llama family have the same shapes)."""
    return weight_bytes_from_headers(files, dtype, False, quantization, prefix="model.layers.0.")


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _decoder_linear_shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's Linear weights: fused qkv, o_proj, fused gate_up, down_proj."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, _head_dim(cfg)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return [((heads + 2 * kv_heads) * d, h), (h, heads * d), (2 * i, h), (h, i)]


def layer_weight_bytes_from_config(cfg, dtype: torch.dtype, quantization: str | None = None) -> int:
    """Bytes of one decoder layer's weights in `dtype`, with its Linears quantized by `quantization`."""
    total = _layer_params(cfg) * dtype.itemsize
    if quantization == "int8":
        for out, inp in _decoder_linear_shapes(cfg):
            total += int8_weight_bytes(out, inp, dtype) - out * inp * dtype.itemsize
    return total


def weight_bytes_from_config(cfg, dtype: torch.dtype, quantization: str | None = None) -> int:
    """Bytes of all weights from config shapes: embeddings, LM head and final norm stay in `dtype`."""
    layers = cfg.num_hidden_layers
    rest = num_params_from_config(cfg) - layers * _layer_params(cfg)
    return rest * dtype.itemsize + layers * layer_weight_bytes_from_config(cfg, dtype, quantization)


def num_params_from_config(cfg) -> int:
    """Parameter count of a Llama-family model from its config (what our implementation allocates)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    head = 0 if tied else v * h
    if _is_dual_ffn(cfg):  # no text LM head: audio code embeddings and the audio head instead
        head = 2 * cfg.num_codebooks * cfg.codebook_size * h
    return v * h + cfg.num_hidden_layers * _layer_params(cfg) + h + head


def logits_per_row(cfg) -> int:
    """Logits of one sampled row: the text vocabulary, or num_codebooks x codebook_size for an audio
    model (Higgs Audio v2 has no text head: every sampled row is an audio frame)."""
    return cfg.num_codebooks * cfg.codebook_size if _is_dual_ffn(cfg) else cfg.vocab_size


def _is_dual_ffn(cfg) -> bool:
    """Higgs Audio v2: every layer also has an audio MLP and two audio norms."""
    return getattr(cfg, "model_type", "") == "higgs_audio_v2"


def _layer_params(cfg) -> int:
    """Parameters of one decoder layer: projections (and their biases) and norms."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    d = _head_dim(cfg)
    model_type = getattr(cfg, "model_type", "")
    attention_bias = getattr(cfg, "attention_bias", False)
    qkv_bias = True if model_type == "qwen2" else attention_bias
    o_bias = False if model_type == "qwen2" else attention_bias
    mlp_bias = getattr(cfg, "mlp_bias", False)
    qkv = h * (heads + 2 * kv_heads) * d + (heads + 2 * kv_heads) * d * qkv_bias
    o = heads * d * h + h * o_bias
    mlp = 3 * h * i + (2 * i + h) * mlp_bias
    norms = 2 * h + (2 * d if model_type == "qwen3" else 0)
    audio_path = mlp + 2 * h if _is_dual_ffn(cfg) else 0
    return qkv + o + mlp + norms + audio_path


def kv_bytes_per_token(cfg, kv_dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """2 (K and V) x layers x kv heads x head_dim x size of the KV cache dtype, per tensor-parallel rank.

    KV heads are split across ranks; with fewer KV heads than ranks each rank keeps a replica.
    """
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    per_rank = max(1, cdiv(kv_heads, tensor_parallel_size))
    return 2 * cfg.num_hidden_layers * per_rank * _head_dim(cfg) * kv_dtype.itemsize


def estimate_activation_bytes(cfg, dtype: torch.dtype, num_tokens: int, max_num_seqs: int,
                              tensor_parallel_size: int = 1) -> int:
    """Peak transient memory of one forward of `num_tokens` tokens plus sampling, from shapes.

    The live set at the peak of a layer: residual, normed input, q/k/v, attention output, the
    gate/up projection and its product (x1.5 for the temporaries around them), plus the attention
    mask and scores of the longest query block; then per sampled row the logits in the model dtype,
    about five float32 copies (logits, probabilities, the sorted values of top-p/top-k) and the
    int64 sort indices. Checked against peaks the engine measured on this project's CPU machine
    (demo model 2048 tokens: 64.6 MiB measured; Qwen2.5-0.5B bf16, 2048 tokens, 256 rows:
    1215 MiB measured). Used for dry runs; the engine measures.
    """
    v = logits_per_row(cfg)
    attention = num_tokens * num_tokens * 5  # boolean mask and its float scores for one block row
    rows = min(num_tokens, max_num_seqs)
    sampling = rows * v * (dtype.itemsize + 5 * 4 + 8)
    return _layer_activation_bytes(cfg, dtype, num_tokens, tensor_parallel_size) + attention + sampling


def _layer_activation_bytes(cfg, dtype: torch.dtype, num_tokens: int, tensor_parallel_size: int = 1) -> int:
    """The live set at the peak of a decoder layer for `num_tokens` tokens (see estimate_activation_bytes)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    d = _head_dim(cfg)
    tp = tensor_parallel_size
    per_token = (3 * h + 2 * (heads + 2 * kv_heads) * d // tp + 3 * i // tp) * dtype.itemsize
    return int(num_tokens * per_token * 1.5)


def estimate_graph_pool_bytes(cfg, dtype: torch.dtype, max_batch_size: int, tensor_parallel_size: int = 1) -> int:
    """Memory the CUDA graphs of decode steps keep: one forward of the largest captured size (the graphs
    share one pool, each capture reusing what the one before freed; logits and sampling run outside
    them), its output, and the split-K partials of attention (float32, per query head, up to 64
    partitions) of the largest size that splits: fewer sequences x KV heads than twice the SMs, taken
    as an H100/H200's 132. Used for dry runs; the engine measures."""
    heads = cfg.num_attention_heads // tensor_parallel_size
    kv_heads = max(1, (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) // tensor_parallel_size)
    split_seqs = min(max_batch_size, (2 * 132 - 1) // kv_heads)
    split_k = split_seqs * heads * 64 * (_head_dim(cfg) + 2) * 4
    hidden = max_batch_size * cfg.hidden_size * dtype.itemsize
    return _layer_activation_bytes(cfg, dtype, max_batch_size, tensor_parallel_size) + split_k + hidden
