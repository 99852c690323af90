"""config.json's `quantization_config` read as vLLM reads it: which format each checkpoint module is stored in.

quant_method         what pagedllm loads
fp8                  fp8 e4m3 weights, per-tensor scales, or `weight_block_size` block scales (`weight_scale_inv`)
compressed-tensors   float-quantized fp8 (tensor / channel / block), pack-quantized int4 (W4A16, group or channel,
                     symmetric or not, actorder), nvfp4-pack-quantized
modelopt             quant_algo FP8, NVFP4
gptq                 bits 4, any group size, sym or not, desc_act (checkpoint_format gptq or gptq_v2)
awq                  bits 4, version gemm
mxfp4                gpt-oss' experts
Anything else is refused at load, naming what is supported (SUPPORTED_FORMATS).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.errors import UnsupportedModelError
from pagedllm.model_executor.linear import Linear
from pagedllm.model_executor.moe import PROJECTIONS, FusedMoE, Router
from pagedllm.model_executor.quant.base import LinearFormat, make_quantized
from pagedllm.model_executor.quant.experts import make_quantized_experts
from pagedllm.model_executor.quant.fp8 import Fp8Format
from pagedllm.model_executor.quant.int4 import Int4Format
from pagedllm.model_executor.quant.mxfp4 import make_mxfp4_experts
from pagedllm.model_executor.quant.nvfp4 import Nvfp4Format

SUPPORTED_FORMATS = ("fp8 (per-tensor, per-channel or block scales: quant_method fp8, compressed-tensors, "
                     "modelopt FP8), nvfp4 (modelopt NVFP4, compressed-tensors nvfp4-pack-quantized), int4 W4A16 "
                     "(gptq, awq gemm, compressed-tensors pack-quantized), mxfp4 (gpt-oss experts)")


@dataclass(frozen=True)
class FormatGroup:
    """Checkpoint modules stored in `format`: those `targets` name ("Linear": every Linear; "re:<regex>"; a name)."""

    format: LinearFormat
    targets: tuple[str, ...] = ("Linear",)

    def covers(self, name: str) -> bool:
        return any(t == "Linear" or _matches(name, t) for t in self.targets)


@dataclass(frozen=True)
class CheckpointQuant:
    """How a checkpoint's modules are stored. `method`: its quant_method; `groups`: the decoder Linears' formats;
    `experts`: "mxfp4" when a mixture of experts' experts are MXFP4; `ignore`: modules left unquantized (names,
    globs, "re:" regexes, as the formats' configs write them)."""

    method: str
    groups: tuple[FormatGroup, ...] = ()
    experts: str | None = None
    ignore: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        parts = [g.format.describe() for g in self.groups] + (["mxfp4 experts"] if self.experts else [])
        return "; ".join(dict.fromkeys(parts))

    def format_of(self, checkpoint_names: list[str]) -> LinearFormat | None:
        """The format of a Linear holding these checkpoint modules (q, k and v for a fused qkv), or None (dense).
        The parts of a fused Linear must agree."""
        formats = {id(f): f for f in (self._format_of_one(n) for n in checkpoint_names)}
        if len(formats) > 1:
            raise UnsupportedModelError(f"checkpoint modules {checkpoint_names} are stored in different formats; "
                                        f"pagedllm multiplies them as one Linear and needs them in one")
        return next(iter(formats.values()))

    def _format_of_one(self, name: str) -> LinearFormat | None:
        if not name.startswith("model.layers.") or any(_matches(name, pattern) for pattern in self.ignore):
            return None
        return next((g.format for g in self.groups if g.covers(name)), None)

    def prepare(self, model: nn.Module) -> dict[str, LinearFormat]:
        """Give the model's quantized Linears and experts (on the meta device) their formats' parameters. Returns
        the format of each quantized checkpoint module, by its name (what the loader converts)."""
        quantized: dict[str, LinearFormat] = {}
        for name, module in model.named_modules():
            if isinstance(module, FusedMoE):
                quantized.update(self._prepare_experts(model, name, module))
            elif isinstance(module, Linear) and not isinstance(module, Router) and name.startswith("model.layers."):
                names = model.checkpoint_names(name)
                fmt = self.format_of(names)
                if fmt is not None:
                    make_quantized(module, fmt)
                    quantized.update(dict.fromkeys(names, fmt))
        return quantized

    def _prepare_experts(self, model: nn.Module, name: str, moe: FusedMoE) -> dict[str, LinearFormat]:
        """MXFP4 experts (gpt-oss), or every expert's projections in a Linear format: the checkpoint's per-expert
        modules (`experts.<e>.gate_proj`, Mixtral's `experts.<e>.w1`, ...) by name."""
        (ckpt,) = model.checkpoint_names(name)
        if any(_matches(ckpt, pattern) for pattern in self.ignore):
            return {}
        if self.experts == "mxfp4":
            make_mxfp4_experts(moe)
            return {}
        names = [f"{ckpt}.{e}.{proj}" for e in range(moe.num_experts) for proj in PROJECTIONS]
        fmt = self.format_of(names[:len(PROJECTIONS)])
        if fmt is None:
            return {}
        make_quantized_experts(moe, fmt)
        return dict.fromkeys(names, fmt)


def _matches(name: str, pattern: str) -> bool:
    """Whether checkpoint module `name` is, or is inside, the module(s) `pattern` names: an exact or dotted-suffix
    name ("lm_head", "mlp.gate"), a glob ("model.layers.*.self_attn"), or "re:<regex>" (compressed-tensors)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*"):
        return True
    return name.endswith("." + pattern) or ("." + pattern + ".") in ("." + name + ".")


def checkpoint_quant(hf_config) -> CheckpointQuant | None:
    """The checkpoint's quantization (None: unquantized). Raises UnsupportedModelError for what pagedllm cannot
    load, naming what it can."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    parse = _PARSERS.get(method)
    if parse is None:
        raise UnsupportedModelError(f"this checkpoint is quantized with quant_method {method!r}, which pagedllm "
                                    f"does not load. Supported: {SUPPORTED_FORMATS}.")
    return parse(qc)


def _unsupported(method: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"this {method} checkpoint uses {what}, which pagedllm does not load. "
                                 f"Supported: {SUPPORTED_FORMATS}.")


def _names(value) -> tuple[str, ...]:
    return tuple(value or ())


def _fp8(qc: dict) -> CheckpointQuant:
    block = qc.get("weight_block_size")
    if block is not None and len(block) != 2:
        raise _unsupported("fp8", f"weight_block_size {block}")
    fmt = Fp8Format(block=tuple(block) if block else None, scale_name="weight_scale_inv" if block else "weight_scale",
                    input_scale=qc.get("activation_scheme") == "static", per_tensor=block is None)
    return CheckpointQuant("fp8", (FormatGroup(fmt),), ignore=_names(qc.get("modules_to_not_convert")))


def _modelopt(qc: dict) -> CheckpointQuant:
    inner = qc.get("quantization") or qc
    algo = str(inner.get("quant_algo", "")).upper()
    if algo == "FP8":
        fmt = Fp8Format(scale_name="weight_scale", input_scale=True, per_tensor=True)
    elif algo == "NVFP4":
        fmt = Nvfp4Format("modelopt", input_scales=("input_scale",))
    else:
        raise _unsupported("modelopt", f"quant_algo {algo!r}")
    return CheckpointQuant("modelopt", (FormatGroup(fmt),), ignore=_names(inner.get("exclude_modules")))


def _gptq(qc: dict) -> CheckpointQuant:
    if qc.get("bits") != 4:
        raise _unsupported("gptq", f"{qc.get('bits')}-bit weights")
    layout = str(qc.get("checkpoint_format") or "gptq").lower()
    if layout not in ("gptq", "gptq_v2"):
        raise _unsupported("gptq", f"checkpoint_format {layout!r}")
    fmt = Int4Format(layout, qc.get("group_size"), bool(qc.get("sym", True)), bool(qc.get("desc_act", False)))
    return CheckpointQuant("gptq", (FormatGroup(fmt),), ignore=_names(qc.get("modules_to_not_convert")))


def _awq(qc: dict) -> CheckpointQuant:
    bits, version = qc.get("bits", qc.get("w_bit")), str(qc.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise _unsupported("awq", f"{bits}-bit weights, version {version!r}")
    fmt = Int4Format("awq", qc.get("group_size", qc.get("q_group_size")), not qc.get("zero_point", True))
    return CheckpointQuant("awq", (FormatGroup(fmt),), ignore=_names(qc.get("modules_to_not_convert")))


def _mxfp4(qc: dict) -> CheckpointQuant:
    return CheckpointQuant("mxfp4", experts="mxfp4", ignore=_names(qc.get("modules_to_not_convert")))


def _compressed_tensors(qc: dict) -> CheckpointQuant:
    groups = []
    for name, scheme in (qc.get("config_groups") or {}).items():
        weights = scheme.get("weights")
        if not weights:
            continue
        fmt = _compressed_tensors_format(weights, scheme.get("input_activations"), scheme.get("format")
                                         or qc.get("format"))
        groups.append(FormatGroup(fmt, _names(scheme.get("targets")) or ("Linear",)))
    if not groups:
        raise _unsupported("compressed-tensors", "no weight quantization in config_groups")
    return CheckpointQuant("compressed-tensors", tuple(groups), ignore=_names(qc.get("ignore")))


def _compressed_tensors_format(weights: dict, inputs: dict | None, fmt: str | None) -> LinearFormat:
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if kind == "float" and bits == 8 and fmt in ("float-quantized", "naive-quantized"):
        block = weights.get("block_structure") if strategy == "block" else None
        if strategy not in ("tensor", "channel", "block"):
            raise _unsupported("compressed-tensors", f"fp8 weights with strategy {strategy!r}")
        static_inputs = bool(inputs) and not inputs.get("dynamic", False)
        return Fp8Format(block=tuple(block) if block else None, input_scale=static_inputs,
                         per_tensor=strategy == "tensor")
    if kind == "float" and bits == 4 and fmt == "nvfp4-pack-quantized":
        return Nvfp4Format("compressed-tensors", input_scales=("input_global_scale",) if inputs else ())
    if kind == "int" and bits == 4 and fmt == "pack-quantized" and strategy in ("group", "channel"):
        group = weights.get("group_size") if strategy == "group" else None
        return Int4Format("compressed-tensors", group, bool(weights.get("symmetric", True)),
                          act_order=weights.get("actorder") == "group")
    raise _unsupported("compressed-tensors", f"format {fmt!r} with {bits}-bit {kind} weights ({strategy})")


_PARSERS = {"fp8": _fp8, "modelopt": _modelopt, "gptq": _gptq, "awq": _awq, "mxfp4": _mxfp4,
            "compressed-tensors": _compressed_tensors}


def convert_checkpoint(weights, quantized: dict[str, LinearFormat], dtype: torch.dtype):
    """Checkpoint (name, tensor) pairs -> the same with each quantized module's tensors converted to its Linear's
    parameters (named `<module>.<parameter>`, once the module's tensors are all read); other floating tensors cast
    to `dtype`."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        fmt = quantized.get(module)
        if fmt is None or leaf not in fmt.checkpoint_tensors():
            yield name, (tensor.to(dtype) if tensor.is_floating_point() and tensor.element_size() > 1 else tensor)
            continue
        parts = pending.setdefault(module, {})
        parts[leaf] = tensor
        if parts.keys() == fmt.checkpoint_tensors():
            del pending[module]
            for pname, value in fmt.convert(parts, dtype).items():
                yield f"{module}.{pname}", value
    if pending:
        module, parts = next(iter(pending.items()))
        missing = sorted(quantized[module].checkpoint_tensors() - parts.keys())
        raise ValueError(f"checkpoint module {module} ({quantized[module].describe()}) lacks {missing} "
                         f"({len(pending)} modules incomplete)")


def planned_quant(quantization: str | None) -> CheckpointQuant | None:
    """What `--quantization` makes of a 16/32-bit checkpoint's decoder Linears (and, in a plan, its experts), as
    a CheckpointQuant: fp8 at load (per-channel scales), or the checkpoint a plan sizes for int4 (W4A16, groups of
    128, as GPTQ / AWQ / compressed-tensors ship it) and nvfp4 (ModelOpt). None for int8 (quantization.py) and
    none."""
    from pagedllm.model_executor.quant.fp8 import FP8_PER_CHANNEL

    formats = {"fp8": FP8_PER_CHANNEL, "int4": Int4Format("gptq", 128, True), "nvfp4": Nvfp4Format("modelopt")}
    fmt = formats.get(quantization or "")
    return None if fmt is None else CheckpointQuant(quantization, (FormatGroup(fmt),))
