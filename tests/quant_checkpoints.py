"""Quantized test checkpoints, written by each format's own library, and their dense references.

Every writer turns a dense checkpoint folder made by ``tests.helpers.make_tiny_model`` into a
quantized folder: the same config (plus ``quantization_config``), tokenizer and generation
config, and one ``model.safetensors`` holding the quantized tensors. Only the decoder-layer
projections are quantized (``model.layers.*`` q/k/v/o and gate/up/down, Mixtral's w1/w2/w3);
embeddings, ``lm_head``, norms and MoE routers stay dense, in the source dtype.

=====================  ==============================================================
writer                 made by
=====================  ==============================================================
write_compressed_...   compressed-tensors: scales from ``calculate_qparams`` /
                       ``compute_dynamic_scales_and_zp`` / ``generate_gparam``, tensors
                       from the format's compressor, config from ``ModelCompressor``
write_fp8_block        transformers' ``Fp8Quantize`` (the reverse op of its FP8 loader)
write_gptq / write_awq round-to-nearest per the GPTQ v1/v2 and AutoAWQ GEMM specs (their
                       libraries need CUDA); AWQ is checked by compressed-tensors'
                       ``AutoAWQConverter``
write_mxfp4_gpt_oss    compressed-tensors' MXFP4 scales and FP4 packing, laid out as gpt-oss
                       ships it; checked by transformers' ``convert_moe_packed_tensors``
write_modelopt         compressed-tensors' per-tensor FP8 / NVFP4, renamed as NVIDIA ModelOpt
                       ships them; read back by its ``ModelOptNvfp4Converter``
=====================  ==============================================================

``dequantized_state_dict(dst)`` gives the dense tensors a quantized folder stands for (each
format's library dequantizer, in float32) and ``dequantized_reference(dst)`` a float32
transformers model with those weights, for greedy references (``hf_greedy_reference``).
"""
from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

# Leaf names of the projections that get quantized (Mixtral's experts are w1/w2/w3).
QUANTIZED_LEAVES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                     "w1", "w2", "w3")
# MoE routers, which stay dense: Qwen3-MoE ``mlp.gate``, Mixtral ``block_sparse_moe.gate``, gpt-oss ``mlp.router``.
ROUTER_SUFFIXES: tuple[str, ...] = (".mlp.gate", ".block_sparse_moe.gate", ".mlp.router")
CT_SCHEMES: tuple[str, ...] = ("fp8-channel", "fp8-tensor", "fp8-block", "w4a16", "w4a16-asym", "nvfp4a16")
AWQ_ORDER: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p of an AWQ word holds column 8c + AWQ_ORDER[p]
MXFP4_NOT_CONVERTED: list[str] = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                  "lm_head"]


# ----------------------------------------------------------------------------------------------
# Checkpoint folder plumbing
# ----------------------------------------------------------------------------------------------

def read_tensors(path: Path | str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (single file or sharded), by name."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def read_quantization_config(path: Path | str) -> dict[str, Any] | None:
    """The ``quantization_config`` entry of ``path/config.json`` (None for a dense checkpoint)."""
    return json.loads((Path(path) / "config.json").read_text()).get("quantization_config")


def _copy_side_files(src: Path, dst: Path) -> None:
    """Copy config, tokenizer and generation config (everything but the weights) from src to dst."""
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.is_file() and not file.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(file, dst / file.name)


def _set_quantization_config(dst: Path, quantization_config: dict[str, Any] | None) -> None:
    """Write (or with None, remove) config.json's ``quantization_config``."""
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if quantization_config is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = quantization_config
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _write_checkpoint(src: Path, dst: Path, tensors: dict[str, torch.Tensor],
                      quantization_config: dict[str, Any] | None) -> Path:
    """Write ``dst`` = src's side files + ``tensors`` as one model.safetensors + the given config."""
    from safetensors.torch import save_file

    if dst.exists():
        for file in dst.glob("*.safetensors*"):  # never leave stale shards next to the new file
            file.unlink()
    _copy_side_files(src, dst)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    _set_quantization_config(dst, quantization_config)
    return dst


def quantized_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Module names whose 2-D ``.weight`` gets quantized: the decoder-layer projections."""
    names = []
    for key, value in tensors.items():
        module, _, param = key.rpartition(".")
        if (param == "weight" and value.ndim == 2 and module.startswith("model.layers.")
                and module.rpartition(".")[2] in QUANTIZED_LEAVES):
            names.append(module)
    return sorted(names)


def router_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Module names of the MoE routers in the checkpoint (kept dense)."""
    return sorted({k.rpartition(".")[0] for k in tensors if k.rpartition(".")[0].endswith(ROUTER_SUFFIXES)})


def _split_weights(src: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(``module -> weight`` of the modules to quantize, every other tensor by name), in the source dtype."""
    tensors = read_tensors(src)
    weights = {m: tensors.pop(f"{m}.weight") for m in quantized_modules(tensors)}
    return weights, tensors


# ----------------------------------------------------------------------------------------------
# compressed-tensors
# ----------------------------------------------------------------------------------------------

def ct_scheme(scheme: str, group_size: int = 128, block: tuple[int, int] = (128, 128)):
    """The compressed-tensors ``QuantizationScheme`` (weights only, targets ``Linear``) for a scheme name.

    Built from the library's presets: FP8_DYNAMIC's channel weights, FP8's per-tensor weights,
    FP8_BLOCK's block weights, W4A16 / W4A16_ASYM group weights, NVFP4A16; input activations
    dropped, so the dense reference is exactly the model with dequantized weights.
    """
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    presets = {"fp8-channel": ("FP8_DYNAMIC", {}), "fp8-tensor": ("FP8", {}),
               "fp8-block": ("FP8_BLOCK", {"block_structure": list(block)}),
               "w4a16": ("W4A16", {"group_size": group_size}), "w4a16-asym": ("W4A16_ASYM", {"group_size": group_size}),
               "nvfp4a16": ("NVFP4A16", {})}
    if scheme not in presets:
        raise ValueError(f"unknown compressed-tensors scheme {scheme!r}; expected one of {CT_SCHEMES}")
    preset, overrides = presets[scheme]
    weights = preset_name_to_scheme(preset, ["Linear"]).weights
    if overrides:
        weights = QuantizationArgs(**{**weights.model_dump(), **overrides})
    return QuantizationScheme(targets=["Linear"], weights=weights)


def _ct_check_shape(module: str, weight: torch.Tensor, args) -> None:
    """Group strategies need in_features divisible by the group (the library only warns, then fails)."""
    if args.group_size and weight.shape[-1] % args.group_size:
        raise ValueError(f"{module}: in_features {weight.shape[-1]} not divisible by group_size {args.group_size}")


def ct_qparams(weight: torch.Tensor, args) -> dict[str, torch.Tensor]:
    """Scale / zero point / global scale of one weight, computed by compressed-tensors (memoryless min-max).

    Shapes: tensor (1,), channel (out, 1), group and tensor_group (out, in/group), block
    (ceil(out/bn), ceil(in/bk)) over the zero-padded weight. tensor_group also gets a (1,)
    ``weight_global_scale`` from ``generate_gparam`` (the NVFP4 per-tensor scale).
    """
    from compressed_tensors.quantization import QuantizationStrategy as S
    from compressed_tensors.quantization.utils import (calculate_qparams, compute_dynamic_scales_and_zp,
                                                       generate_gparam, maybe_pad_tensor_for_block_quant)

    out: dict[str, torch.Tensor] = {}
    if args.strategy == S.CHANNEL:
        scale, zp = calculate_qparams(weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True), args)
    elif args.strategy == S.BLOCK:
        bn, bk = args.block_structure
        padded = maybe_pad_tensor_for_block_quant(weight, (bn, bk))
        tiles = padded.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk))  # (rows/bn, bn, cols/bk, bk)
        scale, zp = calculate_qparams(tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3)), args)
    else:  # tensor, group, tensor_group
        global_scale = None
        if args.strategy == S.TENSOR_GROUP:
            global_scale = generate_gparam(weight.min(), weight.max())
            out["weight_global_scale"] = global_scale
        scale, zp = compute_dynamic_scales_and_zp(weight, args, module=None, global_scale=global_scale)
    out["weight_scale"] = scale
    out["weight_zero_point"] = zp
    return out


def _ct_compress(src: Path, scheme: str, **options: Any):
    """(module -> its tensors from the scheme's compressor, every other tensor of src, the QuantizationScheme).

    Scales come from ct_qparams; ``format`` as in write_compressed_tensors.
    """
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format

    fmt = options.pop("format", "float-quantized" if scheme.startswith("fp8") else None)
    qscheme = ct_scheme(scheme, **options)
    qscheme.format = fmt or infer_module_format(torch.nn.Linear, qscheme).value
    compressor = BaseCompressor.get_value_from_registry(qscheme.format)
    weights, tensors = _split_weights(src)
    compressed = {}
    for module, weight in weights.items():
        _ct_check_shape(module, weight, qscheme.weights)
        compressed[module] = compressor.compress({"weight": weight, **ct_qparams(weight, qscheme.weights)}, qscheme)
    return compressed, tensors, qscheme


def write_compressed_tensors(src: Path | str, dst: Path | str, scheme: str, **options: Any) -> Path:
    """Write ``dst``: ``src`` quantized with compressed-tensors ``scheme`` (one of CT_SCHEMES), as llmcompressor saves.

    Options: ``group_size`` (w4a16*, default 128), ``block`` (fp8-block, default (128, 128)), ``format``
    (the compressor / config format; default ``float-quantized`` for fp8, as FP8 checkpoints carry, since
    compressed-tensors infers its byte-identical alias ``naive-quantized`` for weight-only FP8, else inferred).
    Per quantized module ``M`` (weight (out, in)), in the source dtype unless noted:

    * fp8-channel / fp8-tensor / fp8-block (format ``float-quantized``): ``M.weight`` float8_e4m3fn
      (out, in), ``M.weight_scale`` (out, 1) / (1,) / (ceil(out/bn), ceil(in/bk));
    * w4a16 / w4a16-asym (``pack-quantized``): ``M.weight_packed`` int32 (out, in/8) (8 int4 per word,
      column 8c+j in bits 4j..4j+3, stored as q+8), ``M.weight_scale`` (out, in/group),
      ``M.weight_shape`` int64 [out, in], asym also ``M.weight_zero_point`` int32 (out/8, in/group)
      (packed along out);
    * nvfp4a16 (``nvfp4-pack-quantized``): ``M.weight_packed`` uint8 (out, in/2) (E2M1, low nibble
      first), ``M.weight_scale`` float8_e4m3fn (out, in/16), ``M.weight_global_scale`` float32 (1,);
      the weight is ``fp4 * weight_scale / weight_global_scale``.

    config.json gets ``ModelCompressor.update_config``'s ``quantization_config`` (quant_method
    compressed-tensors, format, config_groups with targets ["Linear"], ignore = lm_head + routers).
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    src, dst = Path(src), Path(dst)
    compressed, tensors, qscheme = _ct_compress(src, scheme, **options)
    for module, parts in compressed.items():
        tensors.update({f"{module}.{name}": value for name, value in parts.items()})
    _write_checkpoint(src, dst, tensors, None)
    qconfig = QuantizationConfig(config_groups={"group_0": qscheme}, ignore=["lm_head", *router_modules(tensors)],
                                 format=qscheme.format, quantization_status=QuantizationStatus.COMPRESSED)
    ModelCompressor(quantization_config=qconfig).update_config(str(dst))
    return dst


def _ct_module_scheme(qcfg: dict[str, Any]):
    """The single config group of a compressed-tensors config written by write_compressed_tensors."""
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate({k: v for k, v in qcfg.items()
                                                if k not in ("version", "sparsity_config", "transform_config")})
    (scheme,) = config.config_groups.values()
    scheme.format = scheme.format or config.format
    return scheme


def _ct_dequantize(tensors: dict[str, torch.Tensor], qcfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Replace each compressed module's tensors with its float32 ``weight``, via the format's compressor.

    NVFP4 goes through the library's unpack + ``dequantize`` in float32 (its compressor's
    ``decompress`` works in bfloat16, which would round the product).
    """
    from compressed_tensors.compressors import BaseCompressor

    scheme = _ct_module_scheme(qcfg)
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    names = compressor.compression_param_names(scheme)
    for module in sorted({k.rpartition(".")[0] for k in tensors if k.endswith(".weight_scale")}):
        state = {n: tensors.pop(f"{module}.{n}") for n in names if f"{module}.{n}" in tensors}
        if scheme.format == "nvfp4-pack-quantized":
            tensors[f"{module}.weight"] = _nvfp4_dequantize(state, scheme.weights)
        else:
            state = {k: (v.float() if v.is_floating_point() and v.element_size() > 1 else v) for k, v in state.items()}
            tensors[f"{module}.weight"] = compressor.decompress(state, scheme)["weight"].float()
    return tensors


def _nvfp4_dequantize(state: dict[str, torch.Tensor], args) -> torch.Tensor:
    """NVFP4 (out, in/2) uint8 + fp8 scales + global scale -> float32 (out, in), with the library's functions."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    packed = state["weight_packed"]
    fp4 = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    return dequantize(fp4, state["weight_scale"].float(), args=args, dtype=torch.float32,
                      global_scale=state["weight_global_scale"].float())


# ----------------------------------------------------------------------------------------------
# FP8 with 2-D block scales (quant_method "fp8", DeepSeek / Qwen3-FP8)
# ----------------------------------------------------------------------------------------------

def _fp8_quantizer(block: tuple[int, int]):
    """transformers' ``Fp8Quantize`` op configured for ``block`` (it only reads the config)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    return Fp8Quantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=list(block))))


def write_fp8_block(src: Path | str, dst: Path | str, block: tuple[int, int] = (128, 128)) -> Path:
    """Write ``dst``: ``src`` with block-FP8 projections, as Qwen3-8B-FP8 / DeepSeek-V3 ship them.

    Per quantized module ``M`` (weight (out, in)): ``M.weight`` float8_e4m3fn (out, in) and
    ``M.weight_scale_inv`` float32 (ceil(out/bn), ceil(in/bk)); weight = fp8 * scale_inv per tile,
    scale_inv = tile amax / 448. Quantized by transformers' ``Fp8Quantize``; a weight whose dims are
    not multiples of the block is zero-padded for it (zeros do not change a tile's amax) and the
    fp8 result cropped back. config: {"quant_method": "fp8", "activation_scheme": "dynamic",
    "weight_block_size": [bn, bk], "fmt": "e4m3"}.
    """
    from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant

    src, dst = Path(src), Path(dst)
    quantizer = _fp8_quantizer(block)
    weights, tensors = _split_weights(src)
    for module, weight in weights.items():
        padded = maybe_pad_tensor_for_block_quant(weight, tuple(block))
        out = quantizer.convert({f"{module}.weight": padded})
        tensors[f"{module}.weight"] = out[f"{module}.weight"][: weight.shape[0], : weight.shape[1]]
        tensors[f"{module}.weight_scale_inv"] = out[f"{module}.weight_scale_inv"]
    qcfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block), "fmt": "e4m3"}
    return _write_checkpoint(src, dst, tensors, qcfg)


def _fp8_dequantize(tensors: dict[str, torch.Tensor], qcfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Block-FP8 -> float32 with compressed-tensors' ``FP8BlockDequantizer`` (it handles ragged edge tiles)."""
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    targets = [k.rpartition(".")[0] for k in tensors if k.endswith(".weight_scale_inv")]
    converter = FP8BlockDequantizer(targets=targets, weight_block_size=tuple(qcfg["weight_block_size"]),
                                    dtype=torch.float32)
    converter._checkpoint_targets = frozenset(targets)  # exact module names, as from_pretrained sets them
    return converter.process(tensors)


# ----------------------------------------------------------------------------------------------
# int4 helpers shared by GPTQ and AWQ
# ----------------------------------------------------------------------------------------------

def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """(R, C) values 0..15 -> int32 (R/8, C): value of row 8r+j in bits 4j..4j+3 of word [r, c] (GPTQ qweight)."""
    shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 8, 1)
    words = (q.to(torch.int64).unflatten(0, (-1, 8)) << shifts).sum(dim=1)
    return _as_int32(words)


def pack_int4_cols(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """(R, C) values 0..15 -> int32 (R, C/8): nibble p of word [r, c] holds column 8c + order[p]."""
    shifts = 4 * torch.arange(8, dtype=torch.int64)
    groups = q.to(torch.int64).unflatten(1, (-1, 8))[..., list(order)]  # (R, C/8, 8) in nibble order
    return _as_int32((groups << shifts).sum(dim=-1))


def unpack_int4_rows(words: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4_rows: int32 (R/8, C) -> int64 (R, C) values 0..15."""
    shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 8, 1)
    return ((words.to(torch.int64).unsqueeze(1) >> shifts) & 0xF).flatten(0, 1)


def unpack_int4_cols(words: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Inverse of pack_int4_cols: int32 (R, C/8) -> int64 (R, C) values 0..15."""
    shifts = 4 * torch.arange(8, dtype=torch.int64)
    nibbles = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF  # (R, C/8, 8) in nibble order
    inverse = [order.index(j) for j in range(8)]
    return nibbles[..., inverse].flatten(1)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret uint32 bit patterns held in int64 as int32 (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _group_minmax(wt: torch.Tensor, g_idx: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (group, out column) min and max of wt (in, out), grouping input rows by g_idx."""
    index = g_idx.view(-1, 1).expand_as(wt)
    lo = torch.zeros(groups, wt.shape[1]).scatter_reduce(0, index, wt, "amin", include_self=False)
    hi = torch.zeros(groups, wt.shape[1]).scatter_reduce(0, index, wt, "amax", include_self=False)
    return lo, hi


# ----------------------------------------------------------------------------------------------
# GPTQ (AutoGPTQ / GPTQModel format, round to nearest)
# ----------------------------------------------------------------------------------------------

def gptq_g_idx(in_features: int, group_size: int, desc_act: bool, seed: int = 0) -> torch.Tensor:
    """int32 (in,) group of each input channel: i // group_size, or with desc_act as act-order assigns it
    (channels taken in a random permutation ``perm``; channel perm[k] belongs to group k // group_size)."""
    if not desc_act:
        return (torch.arange(in_features) // group_size).to(torch.int32)
    perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(in_features, dtype=torch.int64)
    g_idx[perm] = torch.arange(in_features) // group_size
    return g_idx.to(torch.int32)


def _gptq_params(wt: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's quantizer (find_params) per group: (scales float16 (groups, out), zeros int64 (groups, out))."""
    lo, hi = _group_minmax(wt, g_idx, groups)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = torch.where(lo < 0, -hi, lo)
    flat = (lo == 0) & (hi == 0)
    lo, hi = torch.where(flat, -1.0, lo), torch.where(flat, 1.0, hi)
    scales = ((hi - lo) / 15).half()  # stored in fp16; quantize with the stored value
    zeros = torch.full_like(lo, 8, dtype=torch.int64) if sym else torch.round(-lo / scales.float()).to(torch.int64)
    return scales, zeros


def gptq_quantize(weight: torch.Tensor, group_size: int, sym: bool, desc_act: bool, seed: int = 0
                  ) -> dict[str, torch.Tensor]:
    """One Linear weight (out, in) -> unpacked GPTQ pieces: q int64 (in, out) 0..15, zeros int64 (groups, out),
    scales float16 (groups, out), g_idx int32 (in,).
    Dequantized: w[o, i] = scales[g_idx[i], o] * (q[i, o] - zeros[g_idx[i], o])."""
    out_features, in_features = weight.shape
    group_size = in_features if group_size == -1 else group_size
    if in_features % group_size or in_features % 8 or out_features % 8:
        raise ValueError(f"GPTQ int4 needs in ({in_features}) % group_size ({group_size}) == 0 and in, out % 8 == 0")
    groups = in_features // group_size
    g_idx = gptq_g_idx(in_features, group_size, desc_act, seed)
    wt = weight.float().t()
    scales, zeros = _gptq_params(wt, g_idx.long(), groups, sym)
    if not sym:
        zeros = zeros.clamp(1, 15)  # v1 stores zero - 1 in a nibble, so 0 is not representable
    g = g_idx.long()
    q = torch.clamp(torch.round(wt / scales.float()[g]) + zeros[g], 0, 15).to(torch.int64)
    return {"q": q, "zeros": zeros, "scales": scales, "g_idx": g_idx}


def write_gptq(src: Path | str, dst: Path | str, group_size: int = 128, sym: bool = True, desc_act: bool = False,
               checkpoint_format: str = "gptq", seed: int = 0) -> Path:
    """Write ``dst``: ``src`` with 4-bit GPTQ projections (round to nearest), byte-compatible with AutoGPTQ.

    Per quantized module ``M`` (weight (out, in), G = in / group_size; group_size -1 = one group):
    ``M.qweight`` int32 (in/8, out) (input row 8r+j in bits 4j..4j+3 of [r, o]), ``M.qzeros`` int32
    (G, out/8) (column 8c+j in bits 4j..4j+3; holds zero-1 for checkpoint_format "gptq" (v1), zero for
    "gptq_v2"), ``M.scales`` float16 (G, out), ``M.g_idx`` int32 (in,), and ``M.bias`` float16 if the
    module has one. Symmetric: zero = 8 everywhere. config: {"quant_method": "gptq", "bits": 4,
    "group_size", "desc_act", "sym", "checkpoint_format", "true_sequential": true,
    "damp_percent": 0.01, "static_groups": false}.
    """
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format must be 'gptq' or 'gptq_v2', got {checkpoint_format!r}")
    src, dst = Path(src), Path(dst)
    weights, tensors = _split_weights(src)
    zero_offset = 1 if checkpoint_format == "gptq" else 0
    for module, weight in weights.items():
        parts = gptq_quantize(weight, group_size, sym, desc_act, seed)
        tensors[f"{module}.qweight"] = pack_int4_rows(parts["q"])
        tensors[f"{module}.qzeros"] = pack_int4_cols(parts["zeros"] - zero_offset)
        tensors[f"{module}.scales"] = parts["scales"]
        tensors[f"{module}.g_idx"] = parts["g_idx"]
        if f"{module}.bias" in tensors:
            tensors[f"{module}.bias"] = tensors[f"{module}.bias"].half()
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": checkpoint_format, "true_sequential": True, "damp_percent": 0.01,
            "static_groups": False}
    return _write_checkpoint(src, dst, tensors, qcfg)


def gptq_dequantize_module(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                           checkpoint_format: str = "gptq") -> torch.Tensor:
    """GPTQ tensors of one module -> float32 weight (out, in), per the spec (v1 zeros are stored minus one)."""
    q = unpack_int4_rows(qweight)  # (in, out)
    zeros = unpack_int4_cols(qzeros) + (1 if checkpoint_format == "gptq" else 0)  # (groups, out)
    g = g_idx.long()
    return ((q - zeros[g]).float() * scales.float()[g]).t().contiguous()


def _gptq_dequantize(tensors: dict[str, torch.Tensor], qcfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Replace every GPTQ module's tensors by its float32 weight (and bias back to float32)."""
    for module in sorted(k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight")):
        pieces = [tensors.pop(f"{module}.{n}") for n in ("qweight", "qzeros", "scales", "g_idx")]
        tensors[f"{module}.weight"] = gptq_dequantize_module(*pieces, checkpoint_format=qcfg["checkpoint_format"])
        if f"{module}.bias" in tensors:
            tensors[f"{module}.bias"] = tensors[f"{module}.bias"].float()
    return tensors


# ----------------------------------------------------------------------------------------------
# AWQ (AutoAWQ GEMM format, round to nearest)
# ----------------------------------------------------------------------------------------------

def awq_quantize(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """AutoAWQ's asymmetric pseudo-quantizer on one weight (out, in): q int64 (in, out) 0..15,
    zeros int64 (groups, out) 0..15, scales float16 (groups, out); weight = (q - zeros) * scales."""
    out_features, in_features = weight.shape
    if in_features % group_size or out_features % 8:
        raise ValueError(f"AWQ int4 needs in ({in_features}) % group_size ({group_size}) == 0 and out % 8 == 0")
    wt = weight.float().t()  # (in, out)
    g = torch.arange(in_features) // group_size
    lo, hi = _group_minmax(wt, g, in_features // group_size)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    zeros = (-torch.round(lo / scales.float())).clamp(0, 15).to(torch.int64)
    q = torch.clamp(torch.round(wt / scales.float()[g]) + zeros[g], 0, 15).to(torch.int64)
    return {"q": q, "zeros": zeros, "scales": scales}


def write_awq(src: Path | str, dst: Path | str, group_size: int = 128) -> Path:
    """Write ``dst``: ``src`` with 4-bit AWQ projections (round to nearest, no activation-aware search).

    Per quantized module ``M`` (weight (out, in), G = in / group_size): ``M.qweight`` int32 (in, out/8)
    and ``M.qzeros`` int32 (G, out/8), nibble p of word [r, c] holding column 8c + [0,2,4,6,1,3,5,7][p];
    ``M.scales`` float16 (G, out); ``M.bias`` float16 if the module has one. Asymmetric: weight =
    (q - zero) * scale. config: {"quant_method": "awq", "bits": 4, "group_size", "zero_point": true,
    "version": "gemm", "modules_to_not_convert": null}.
    """
    src, dst = Path(src), Path(dst)
    weights, tensors = _split_weights(src)
    for module, weight in weights.items():
        parts = awq_quantize(weight, group_size)
        tensors[f"{module}.qweight"] = pack_int4_cols(parts["q"], AWQ_ORDER)
        tensors[f"{module}.qzeros"] = pack_int4_cols(parts["zeros"], AWQ_ORDER)
        tensors[f"{module}.scales"] = parts["scales"]
        if f"{module}.bias" in tensors:
            tensors[f"{module}.bias"] = tensors[f"{module}.bias"].half()
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}
    return _write_checkpoint(src, dst, tensors, qcfg)


def awq_dequantize_module(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM tensors of one module -> float32 weight (out, in), per the spec."""
    q, zeros = unpack_int4_cols(qweight, AWQ_ORDER), unpack_int4_cols(qzeros, AWQ_ORDER)
    group_size = q.shape[0] // zeros.shape[0]
    g = torch.arange(q.shape[0]) // group_size
    return ((q - zeros[g]).float() * scales.float()[g]).t().contiguous()


def awq_library_dequantize(tensors: dict[str, torch.Tensor], qcfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """AWQ -> float32 with compressed-tensors: ``AutoAWQConverter`` to pack-quantized, then its decompressor.

    Scales are widened to float32 before decompressing, so the product is exact.
    """
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter

    converter = AutoAWQConverter.from_autoawq_config(qcfg)
    scheme = converter._build_quant_config().config_groups["config_group_0"]
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    modules = sorted(k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight"))
    tensors = converter.process(dict(tensors))
    for module in modules:
        state = {n: tensors.pop(f"{module}.{n}") for n in compressor.compression_param_names(scheme)}
        state["weight_scale"] = state["weight_scale"].float()
        tensors[f"{module}.weight"] = compressor.decompress(state, scheme)["weight"].float()
        if f"{module}.bias" in tensors:
            tensors[f"{module}.bias"] = tensors[f"{module}.bias"].float()
    return tensors


# ----------------------------------------------------------------------------------------------
# MXFP4 experts (gpt-oss)
# ----------------------------------------------------------------------------------------------

def mxfp4_quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, K) float -> (blocks uint8 (R, K/32, 16), scales uint8 (R, K/32)) with compressed-tensors' MXFP4.

    Scales are E8M0 exponents (2**(s-127)) from the library's ``generate_mx_scales`` (via
    ``compute_dynamic_scales_and_zp``); element 32g+2b of a row is the low nibble of
    blocks[r, g, b], element 32g+2b+1 the high nibble (FP4 E2M1, sign in bit 3).
    """
    from compressed_tensors.compressors import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    if rows.shape[-1] % 32:
        raise ValueError(f"MXFP4 needs the reduced dim ({rows.shape[-1]}) to be a multiple of 32")
    args = preset_name_to_scheme("MXFP4A16", ["Linear"]).weights
    scale, _ = compute_dynamic_scales_and_zp(rows.float(), args, module=None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="mxfp4-pack-quantized")
    packed = MXFP4PackedCompressor.compress({"weight": rows.float(), "weight_scale": scale}, scheme)
    return packed["weight_packed"].unflatten(-1, (-1, 16)), packed["weight_scale"].to(torch.uint8)


def write_mxfp4_gpt_oss(src: Path | str, dst: Path | str) -> Path:
    """Write ``dst``: a gpt-oss ``src`` with MXFP4 experts, laid out as openai/gpt-oss-* ship them.

    The dense ``mlp.experts.gate_up_proj`` (E, hidden, 2*width) and ``down_proj`` (E, width, hidden)
    are x @ W; the checkpoint stores their transposes (E, out, in) as ``*_blocks`` uint8
    (E, out, in/32, 16) and ``*_scales`` uint8 (E, out, in/32) (E8M0, bias 127); the biases
    ``gate_up_proj_bias`` / ``down_proj_bias`` and all other tensors keep the source dtype.
    config: {"quant_method": "mxfp4", "modules_to_not_convert": [self_attn, router, embed_tokens, lm_head]}.
    """
    src, dst = Path(src), Path(dst)
    tensors = read_tensors(src)
    experts = sorted(k for k in tensors if k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")))
    if not experts:
        raise ValueError(f"{src} has no gpt-oss expert tensors (mlp.experts.gate_up_proj / down_proj)")
    for name in experts:
        dense = tensors.pop(name)
        rows = dense.transpose(1, 2).reshape(-1, dense.shape[1])  # (E*out, in)
        blocks, scales = mxfp4_quantize_rows(rows)
        tensors[f"{name}_blocks"] = blocks.unflatten(0, (dense.shape[0], -1))
        tensors[f"{name}_scales"] = scales.unflatten(0, (dense.shape[0], -1))
    qcfg = {"quant_method": "mxfp4", "modules_to_not_convert": list(MXFP4_NOT_CONVERTED)}
    return _write_checkpoint(src, dst, tensors, qcfg)


def _mxfp4_dequantize(tensors: dict[str, torch.Tensor], qcfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """gpt-oss MXFP4 experts -> dense float32 (E, in, out) x @ W tensors (transformers' convert_moe_packed_tensors)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    for name in sorted(k.removesuffix("_blocks") for k in tensors if k.endswith("_blocks")):
        blocks, scales = tensors.pop(f"{name}_blocks"), tensors.pop(f"{name}_scales")
        tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    return tensors


# ----------------------------------------------------------------------------------------------
# NVIDIA ModelOpt (nvidia/*-FP8, nvidia/*-FP4)
# ----------------------------------------------------------------------------------------------

def write_modelopt(src: Path | str, dst: Path | str, algo: str) -> Path:
    """Write ``dst``: ``src`` quantized as NVIDIA ModelOpt exports it in HF format (``algo`` "FP8" or "NVFP4").

    Values come from compressed-tensors (``fp8-tensor`` / ``nvfp4a16`` via ct_qparams and the
    compressor), renamed to ModelOpt's tensors. Per quantized module ``M`` (weight (out, in)):

    * FP8: ``M.weight`` float8_e4m3fn (out, in), ``M.weight_scale`` float32 () (= amax / 448),
      ``M.input_scale`` float32 () = 1.0; weight = fp8 * weight_scale;
    * NVFP4: ``M.weight`` uint8 (out, in/2) (E2M1, low nibble first), ``M.weight_scale``
      float8_e4m3fn (out, in/16), ``M.weight_scale_2`` float32 () = 1 / CT's weight_global_scale,
      ``M.input_scale`` float32 () = 1.0; weight = fp4 * weight_scale * weight_scale_2. This is
      the reverse of compressed-tensors' ``ModelOptNvfp4Converter``.

    input_scale is a placeholder static activation scale (weight-only use). config.json gets
    {"quant_method": "modelopt", "quant_algo": algo, ("group_size": 16 for NVFP4,)
    "kv_cache_quant_algo": null, "exclude_modules": ["lm_head", *routers]}.
    """
    src, dst = Path(src), Path(dst)
    schemes = {"FP8": "fp8-tensor", "NVFP4": "nvfp4a16"}
    if algo not in schemes:
        raise ValueError(f"unknown ModelOpt quant_algo {algo!r}; expected one of {sorted(schemes)}")
    compressed, tensors, _ = _ct_compress(src, schemes[algo])
    one = torch.tensor(1.0, dtype=torch.float32)
    for module, parts in compressed.items():
        if algo == "FP8":
            tensors[f"{module}.weight"] = parts["weight"]
            tensors[f"{module}.weight_scale"] = parts["weight_scale"].float().reshape(())
        else:
            tensors[f"{module}.weight"] = parts["weight_packed"]
            tensors[f"{module}.weight_scale"] = parts["weight_scale"]
            tensors[f"{module}.weight_scale_2"] = (1 / parts["weight_global_scale"].float()).reshape(())
        tensors[f"{module}.input_scale"] = one.clone()
    qcfg = {"quant_method": "modelopt", "quant_algo": algo, **({"group_size": 16} if algo == "NVFP4" else {}),
            "kv_cache_quant_algo": None, "exclude_modules": ["lm_head", *router_modules(tensors)]}
    return _write_checkpoint(src, dst, tensors, qcfg)


def _modelopt_dequantize(tensors: dict[str, torch.Tensor], qcfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """ModelOpt modules -> float32 ``weight``, input scales dropped, with compressed-tensors.

    NVFP4: ``ModelOptNvfp4Converter.process`` maps them to CT's nvfp4-pack-quantized tensors, then
    the library's unpack + ``dequantize`` (_nvfp4_dequantize). FP8: the per-tensor fp8 tensors go
    through CT's float-quantized compressor's ``decompress`` (fp8 * scale, float32).
    """
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters import ModelOptNvfp4Converter

    algo = qcfg["quant_algo"]
    modules = sorted(k.removesuffix(".input_scale") for k in tensors if k.endswith(".input_scale"))
    if algo == "NVFP4":
        converter = ModelOptNvfp4Converter(ignore=qcfg.get("exclude_modules") or ())
        args = converter._build_quant_config().config_groups["config_group_0"].weights
        tensors = converter.process(dict(tensors))
        for module in modules:
            del tensors[f"{module}.input_global_scale"]
            state = {n: tensors.pop(f"{module}.{n}") for n in ("weight_packed", "weight_scale", "weight_global_scale")}
            tensors[f"{module}.weight"] = _nvfp4_dequantize(state, args)
    elif algo == "FP8":
        scheme = ct_scheme("fp8-tensor")
        scheme.format = "float-quantized"
        compressor = BaseCompressor.get_value_from_registry(scheme.format)
        for module in modules:
            del tensors[f"{module}.input_scale"]
            weight, scale = tensors.pop(f"{module}.weight"), tensors.pop(f"{module}.weight_scale")
            if weight.dtype != torch.float8_e4m3fn or scale.numel() != 1:
                raise ValueError(f"{module}: ModelOpt FP8 wants an e4m3 weight and one scale, got {weight.dtype} "
                                 f"and scale shape {tuple(scale.shape)}")
            state = {"weight": weight, "weight_scale": scale.float().reshape(1)}
            tensors[f"{module}.weight"] = compressor.decompress(state, scheme)["weight"].float()
    else:
        raise ValueError(f"unknown ModelOpt quant_algo {algo!r}")
    return tensors


# ----------------------------------------------------------------------------------------------
# Dense references
# ----------------------------------------------------------------------------------------------

_DEQUANTIZERS = {"compressed-tensors": _ct_dequantize, "fp8": _fp8_dequantize, "gptq": _gptq_dequantize,
                 "awq": awq_library_dequantize, "mxfp4": _mxfp4_dequantize, "modelopt": _modelopt_dequantize}


def dequantized_state_dict(dst: Path | str) -> dict[str, torch.Tensor]:
    """The dense tensors (checkpoint names and layouts) a quantized folder stands for, quantized ones in float32.

    Dequantized by each format's library: compressed-tensors' compressors (and its AutoAWQConverter
    for AWQ, ModelOptNvfp4Converter for ModelOpt NVFP4, FP8BlockDequantizer for block FP8),
    transformers' convert_moe_packed_tensors for MXFP4;
    GPTQ by the spec dequantizer here.
    """
    qcfg = read_quantization_config(dst)
    if qcfg is None:
        raise ValueError(f"{dst} has no quantization_config")
    return _DEQUANTIZERS[qcfg["quant_method"]](read_tensors(dst), qcfg)


def _transformers_can_dequantize(dst: Path, qcfg: dict[str, Any]) -> bool:
    """Whether transformers' own loader dequantizes ``dst`` on CPU to exactly dequantized_state_dict."""
    method = qcfg["quant_method"]
    if method == "compressed-tensors":
        return _ct_transformers_can_dequantize(dst, qcfg)
    if method == "fp8":  # transformers' Fp8Dequantize needs whole tiles
        bn, bk = qcfg["weight_block_size"]
        tensors = read_tensors(dst)
        return all(tensors[k].shape[0] % bn == 0 and tensors[k].shape[1] % bk == 0
                   for k in tensors if k.endswith(".weight") and f"{k}_scale_inv" in tensors)
    return method == "mxfp4"


def _ct_transformers_can_dequantize(dst: Path, qcfg: dict[str, Any]) -> bool:
    """transformers 5 decompresses compressed-tensors modules exactly, except: NVFP4 (the library's decompress
    rounds to bf16) and, for MoE experts (its fused-experts path), asymmetric int4 (it drops the zero points)
    and FP8 block scales (it multiplies by the scale grid without expanding it to the tiles)."""
    weights = _ct_module_scheme(qcfg).weights
    if qcfg.get("format") == "nvfp4-pack-quantized":
        return False
    has_experts = any(".experts." in k and k.endswith(".weight_scale") for k in read_tensors(dst))
    return not has_experts or (weights.symmetric and weights.strategy != "block")


def load_with_transformers(dst: Path | str) -> Any:
    """Load a quantized folder with transformers' own quantizer, dequantizing to float32 on CPU (not cached)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config, Mxfp4Config

    qcfg = read_quantization_config(dst)
    override = {"compressed-tensors": lambda: CompressedTensorsConfig(dequantize=True),
                "fp8": lambda: FineGrainedFP8Config(weight_block_size=qcfg["weight_block_size"], dequantize=True),
                "mxfp4": lambda: Mxfp4Config(dequantize=True)}[qcfg["quant_method"]]()
    with warnings.catch_warnings():  # "the quantization_config from the model will be used", bar the dequantize flag
        warnings.simplefilter("ignore", UserWarning)
        model = AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32, quantization_config=override)
    return model.eval()


def _load_dense(dst: Path) -> Any:
    """Write dequantized_state_dict(dst) as a dense float32 folder in a temp dir and load it with transformers."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    tensors = dequantized_state_dict(dst)
    with tempfile.TemporaryDirectory(prefix="dequantized-") as tmp:
        dense = Path(tmp)
        _copy_side_files(dst, dense)
        _set_quantization_config(dense, None)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(dense / "model.safetensors"),
                  metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32)
    return model.eval()


_REFERENCE_MODELS: dict[str, Any] = {}


def dequantized_reference(dst: Path | str) -> Any:
    """A float32 transformers model (eval, cached per path) whose weights are the dequantized values of ``dst``.

    compressed-tensors (except NVFP4), block FP8 with whole tiles and MXFP4 are loaded by
    transformers itself from ``dst`` with its dequantizing config; GPTQ, AWQ (their transformers
    backends need gptqmodel / autoawq), NVFP4, ModelOpt (transformers skips quant_method modelopt
    and would load the raw codes) and ragged block FP8 are built from
    dequantized_state_dict(dst). Either way the weights equal dequantized_state_dict(dst).
    """
    key = str(Path(dst).resolve())
    if key not in _REFERENCE_MODELS:
        path = Path(key)
        qcfg = read_quantization_config(path)
        if qcfg is None:
            raise ValueError(f"{dst} has no quantization_config")
        model = load_with_transformers(path) if _transformers_can_dequantize(path, qcfg) else _load_dense(path)
        _REFERENCE_MODELS[key] = model
    return _REFERENCE_MODELS[key]


def hf_greedy_reference(dst: Path | str, prompt_token_ids: list[int], max_new_tokens: int,
                        ignore_eos: bool = True) -> tuple[list[int], list[float]]:
    """``tests.helpers.hf_greedy`` on dequantized_reference(dst): generated ids and their float32 logprobs."""
    from tests.helpers import greedy_generate

    return greedy_generate(dequantized_reference(dst), prompt_token_ids, max_new_tokens, ignore_eos)
