"""Sizes read from files alone: weight bytes (safetensors headers or config shapes), KV bytes per
token, and an activation estimate for dry-run plans. Nothing here loads a weight."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from pagedllm.model_executor.kv_quant import kv_scale_target
from pagedllm.model_executor.moe import expert_width, is_sparse_layer, num_experts
from pagedllm.model_executor.quant import checkpoint_quant, planned_quant
from pagedllm.model_executor.quant.mxfp4 import mxfp4_expert_bytes
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
                              prefix: str = "", stored=None) -> int:
    """Exact bytes the weights take once loaded in `dtype` (floating tensors are cast to it) and
    quantized by `quantization`; only the tensors whose names start with `prefix`. `stored`: a quantized
    checkpoint's CheckpointQuant (its modules' bytes as their formats hold them)."""
    headers = [(name, info) for f in files for name, info in safetensors_header(f).items()
               if not _skipped(name, tied) and name.startswith(prefix)]
    total, stored_names = _stored_module_bytes(headers, dtype, stored) if stored is not None else (0, set())
    planned = planned_quant(quantization)
    planned = None if planned is None else planned.groups[0].format  # the format --quantization makes
    for name, info in headers:
        if name in stored_names:
            continue
        shape = info["shape"]
        if planned is not None and is_quantized_weight_name(name):
            total += planned.weight_bytes(shape[0], shape[1], dtype)
            continue
        if quantization == "int8" and is_quantized_weight_name(name):
            total += int8_weight_bytes(shape[0], shape[1], dtype)
            continue
        numel = 1
        for d in shape:
            numel *= d
        is_float = info["dtype"] in ("F64", "F32", "F16", "BF16")
        total += numel * (dtype.itemsize if is_float else _SAFETENSORS_ITEMSIZE[info["dtype"]])
    return total


def _stored_module_bytes(headers: list[tuple[str, dict]], dtype: torch.dtype, stored) -> tuple[int, set[str]]:
    """(bytes, tensor names) of the checkpoint modules stored in a quantized format: those with every tensor
    their format stores, counted as the format holds them (quant/)."""
    modules: dict[str, dict[str, list[int]]] = {}
    for name, info in headers:
        module, _, leaf = name.rpartition(".")
        modules.setdefault(module, {})[leaf] = info["shape"]
    total, names = 0, set()
    for module, shapes in modules.items():
        fmt = stored.format_of([module])
        if fmt is None or not fmt.checkpoint_tensors() <= shapes.keys():
            continue
        total += fmt.weight_bytes(*fmt.checkpoint_shape(shapes), dtype)
        names.update(f"{module}.{leaf}" for leaf in fmt.checkpoint_tensors())
    return total, names


def layer_weight_bytes_from_headers(files: list[Path], dtype: torch.dtype, quantization: str | None = None,
                                    stored=None) -> int:
    """Bytes of one decoder layer's weights (all layers of the Llama family have the same shapes)."""
    return weight_bytes_from_headers(files, dtype, False, quantization, prefix="model.layers.0.", stored=stored)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _decoder_linear_shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's Linear weights: fused qkv, o_proj, fused gate_up, down_proj."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, _head_dim(cfg)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return [((heads + 2 * kv_heads) * d, h), (h, heads * d), (2 * i, h), (h, i)]


def layer_weight_bytes_from_config(cfg, dtype: torch.dtype, quantization: str | None = None,
                                   index: int | None = None) -> int:
    """Bytes of decoder layer `index`'s weights in `dtype` (None: the largest layer, a mixture of experts' sparse
    one), with its Linears quantized by `quantization`."""
    if index is None:
        index = max(range(cfg.num_hidden_layers), key=lambda i: _layer_params(cfg, i))
    total = _layer_params(cfg, index) * dtype.itemsize
    if quantization == "int8":
        for out, inp in _decoder_linear_shapes(cfg):
            total += int8_weight_bytes(out, inp, dtype) - out * inp * dtype.itemsize
    stored = checkpoint_quant(cfg) or planned_quant(quantization)
    if stored is not None:
        total += _stored_bytes_saved(cfg, dtype, stored, index)
    return total


def _stored_bytes_saved(cfg, dtype: torch.dtype, stored, index: int) -> int:
    """Bytes layer `index` holds in a quantized checkpoint's formats less the same weights in `dtype` (negative):
    each quantized Linear's format bytes (quant/), MXFP4 experts' values and scales."""
    h, d = cfg.hidden_size, _head_dim(cfg)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    prefix = f"model.layers.{index}."
    linears = [([f"{prefix}self_attn.{p}_proj" for p in "qkv"], (heads + 2 * kv_heads) * d, h),
               ([f"{prefix}self_attn.o_proj"], h, heads * d)]
    if not is_sparse_layer(cfg, index):
        i = cfg.intermediate_size
        linears += [([f"{prefix}mlp.gate_proj", f"{prefix}mlp.up_proj"], 2 * i, h), ([f"{prefix}mlp.down_proj"], h, i)]
    saved = 0
    for names, out, inp in linears:
        fmt = stored.format_of(names)
        if fmt is not None:
            saved += fmt.weight_bytes(out, inp, dtype) - out * inp * dtype.itemsize
    if is_sparse_layer(cfg, index):
        e, w = num_experts(cfg), expert_width(cfg)
        fmt = stored.format_of([f"{prefix}mlp.experts.0.gate_proj"])
        if stored.experts == "mxfp4":
            saved += mxfp4_expert_bytes(e, h, w) - e * 3 * h * w * dtype.itemsize
        elif fmt is not None:  # (a plan's int4 / fp8 / nvfp4 checkpoint quantizes the experts too)
            held = fmt.weight_bytes(2 * w, h, dtype) + fmt.weight_bytes(h, w, dtype)
            saved += e * (held - 3 * h * w * dtype.itemsize)
    return saved


def weight_bytes_from_config(cfg, dtype: torch.dtype, quantization: str | None = None) -> int:
    """Bytes of all weights from config shapes (every expert of a mixture of experts: all of them are held);
    embeddings, LM head and final norm stay in `dtype`."""
    layers = range(cfg.num_hidden_layers)
    rest = num_params_from_config(cfg) - sum(_layer_params(cfg, i) for i in layers)
    return rest * dtype.itemsize + sum(layer_weight_bytes_from_config(cfg, dtype, quantization, i) for i in layers)


def num_params_from_config(cfg) -> int:
    """Parameter count of a Llama-family model from its config (what our implementation allocates)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    head = 0 if tied else v * h
    if _is_dual_ffn(cfg):  # no text LM head: audio code embeddings and the audio head instead
        head = 2 * cfg.num_codebooks * cfg.codebook_size * h
    return v * h + sum(_layer_params(cfg, i) for i in range(cfg.num_hidden_layers)) + h + head


def logits_per_row(cfg) -> int:
    """Logits of one sampled row: the text vocabulary, or num_codebooks x codebook_size for an audio
    model (Higgs Audio v2 has no text head: every sampled row is an audio frame)."""
    return cfg.num_codebooks * cfg.codebook_size if _is_dual_ffn(cfg) else cfg.vocab_size


def _is_dual_ffn(cfg) -> bool:
    """Higgs Audio v2: every layer also has an audio MLP and two audio norms."""
    return getattr(cfg, "model_type", "") == "higgs_audio_v2"


def _layer_params(cfg, index: int = 0) -> int:
    """Parameters of decoder layer `index`: projections (and their biases), norms, and a sparse layer's router
    and experts."""
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
    norms = 2 * h + (2 * d if model_type in ("qwen3", "qwen3_moe") else 0)
    audio_path = mlp + 2 * h if _is_dual_ffn(cfg) else 0
    if is_sparse_layer(cfg, index):  # the experts and the router's rows (gpt-oss: their biases too)
        experts, w, biased = num_experts(cfg), expert_width(cfg), model_type == "gpt_oss"
        mlp = experts * (3 * h * w + h) + biased * experts * (2 * w + h + 1)
    sinks = heads if model_type == "gpt_oss" else 0
    return qkv + o + mlp + norms + audio_path + sinks


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


def expert_params_from_config(cfg) -> int:
    """Parameters in the experts of every sparse layer (0 for a dense model): the share of the weights a decode
    step reads only in part."""
    h = cfg.hidden_size
    sparse = sum(is_sparse_layer(cfg, i) for i in range(cfg.num_hidden_layers))
    biased = getattr(cfg, "model_type", "") == "gpt_oss"
    per_expert = 3 * h * expert_width(cfg) + biased * (2 * expert_width(cfg) + h)
    return sparse * num_experts(cfg) * per_expert


def decode_active_share(cfg, batch: int) -> tuple[float, float]:
    """(share of the weights one decode step of `batch` tokens reads, share of the parameters each token
    multiplies by). A step reads every weight but an untied embedding table (a row per token) and the experts
    its tokens do not choose: a token chooses top_k of E, and a batch E (1 - (1 - top_k / E)^batch) distinct
    experts per layer, expected under independent, uniform routing, so a batch reads more experts as it grows.
    Each token multiplies by every parameter but the embedding table and the experts it does not choose."""
    total, experts = num_params_from_config(cfg), expert_params_from_config(cfg)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    table = 0 if tied or _is_dual_ffn(cfg) else cfg.vocab_size * cfg.hidden_size
    if not experts:
        return (total - table) / total, (total - table) / total
    e, k = num_experts(cfg), cfg.num_experts_per_tok
    read = 1 - (1 - k / e) ** batch
    return (total - table - experts + experts * read) / total, (total - table - experts + experts * k / e) / total


def _layer_activation_bytes(cfg, dtype: torch.dtype, num_tokens: int, tensor_parallel_size: int = 1) -> int:
    """The live set at the peak of a decoder layer for `num_tokens` tokens (see estimate_activation_bytes)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    if num_experts(cfg):  # a token's top-k experts' gate/up products (and any dense layer's)
        sparse = [is_sparse_layer(cfg, k) for k in range(cfg.num_hidden_layers)]
        i = max(i if not all(sparse) else 0, cfg.num_experts_per_tok * expert_width(cfg))
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
