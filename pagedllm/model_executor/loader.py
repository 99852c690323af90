"""Building a model and filling its weights: safetensors checkpoints or dummy random weights."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from pagedllm.config import ModelConfig
from pagedllm.distributed.sharding import ShardLayout
from pagedllm.model_executor.cpu_isa import cpu_kernels
from pagedllm.model_executor.cpu_ops import install_cpu_ops
from pagedllm.model_executor.layers import RMSNorm, RotaryEmbedding, select_forwards
from pagedllm.model_executor.meta import on_meta_device
from pagedllm.model_executor.model_files import weight_files
from pagedllm.model_executor.moe import GROUPED, FusedMoE
from pagedllm.model_executor.models.registry import get_model_class
from pagedllm.model_executor.pooler import attach_pooling_head, finish_pooling_head
from pagedllm.model_executor.offload import HostLayer, LayerOffloader, offload_layers, offloaded_layer_indices
from pagedllm.model_executor.quant.config import checkpoint_quant, convert_checkpoint
from pagedllm.model_executor.quant.experts import init_dummy_experts
from pagedllm.model_executor.quant.mxfp4 import MXFP4_EXPERTS, init_dummy_mxfp4
from pagedllm.model_executor.quant.triton_gemm import triton_gemm
from pagedllm.model_executor.quantization import quantize_model

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """What load_model made: the model, with each layer's implementation chosen for this device, and how its
    weights are held."""

    model: nn.Module
    offloader: LayerOffloader | None  # the layers --cpu-offload-gb keeps in host memory (None: none)
    packed_weight_bytes: int  # weights held in a CPU packed layout by their layers' methods, not as parameters

    @property
    def offloads(self) -> list[HostLayer]:
        return [] if self.offloader is None else self.offloader.hosts

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights: parameters (shared ones once) plus those packed for the CPU kernels or oneDNN."""
        seen, total = set(), self.packed_weight_bytes
        for p in self.model.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total


def load_model(model_config: ModelConfig, device: torch.device) -> LoadedModel:
    """Construct the model on `device` in the configured dtype, then load (or invent) its weights, and choose
    each layer's implementation for the device. Layers --cpu-offload-gb keeps in host memory are built there
    directly: the device never holds them all at once."""
    _, model_cls = get_model_class(model_config.hf_config)
    model_cls.verify_config(model_config.hf_config, model_config.max_model_len)
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with on_meta_device():  # no time spent on an init we overwrite
            model = model_cls(model_config.hf_config, max_positions=model_config.max_model_len)
            if model_config.pooler is not None:
                attach_pooling_head(model, model_config.pooler)
    finally:
        torch.set_default_dtype(prev_dtype)
    # int8 weights are built in host memory: the device only ever holds their final form. Quantizing
    # replaces the Linears' parameters, so their layers' host buffers are made after it.
    # A quantized checkpoint's Linears and experts hold its formats' parameters from the start (quant/).
    stored = checkpoint_quant(model_config.hf_config)
    stored_formats = stored.prepare(model) if stored is not None else {}
    quantized = model_config.quantization is not None
    build_device = torch.device("cpu") if quantized and device.type != "cpu" else device
    hosts = _materialize(model, build_device, 0 if quantized else model_config.cpu_offload_bytes)
    model.tie_weights()
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_tables()  # to_empty left the tables uninitialised
    if model_config.load_format == "dummy":
        _init_dummy_weights(model, model_config.seed, device)
    else:
        _load_safetensors(model, model_config, stored_formats)
    if model_config.pooler is not None:
        finish_pooling_head(model, model_config.pooler)
    model.eval()
    return _place_weights(model, model_config, device, build_device, hosts)


def _materialize(model: nn.Module, device: torch.device, offload_bytes: int) -> dict[int, HostLayer]:
    """Give the meta model real (uninitialised) storage: the layers to offload in flat host buffers, the
    rest on `device`. Returns the host buffers by layer index."""
    layers = model.decoder_layers()
    offloaded = {id(m) for i in offloaded_layer_indices(layers, offload_bytes) for m in layers[i].modules()}
    for module in model.modules():
        if id(module) not in offloaded:
            module.to_empty(device=device, recurse=False)
            continue
        module.to_empty(device="cpu", recurse=False)  # untouched pages: no memory until written
        for name, buf in module.named_buffers(recurse=False):  # buffers are not offloaded
            setattr(module, name, torch.empty_like(buf, device=device))
    return {i: HostLayer.build(layers[i], copy_values=False) for i in offloaded_layer_indices(layers, offload_bytes)}


def _place_weights(model: nn.Module, model_config: ModelConfig, device: torch.device,
                   build_device: torch.device, hosts: dict[int, HostLayer]) -> LoadedModel:
    """Quantize, keep the offloaded layers in host memory, move the rest to `device`; choose the layers'
    implementations (on CPU: native ops, packed weights)."""
    if model_config.quantization is not None:
        quantize_model(model, model_config.quantization)
    _use_device_products(model, device)
    layers = model.decoder_layers()
    if build_device != device:  # staged in host memory: the offloaded layers' weights stay there
        hosts = {i: HostLayer.build(layers[i]) for i in offloaded_layer_indices(layers, model_config.cpu_offload_bytes)}
        kept = {id(p) for host in hosts.values() for p, _ in host.host}
        _move_to(model, device, kept)
    offloader = offload_layers(layers, model_config.cpu_offload_bytes, device, hosts)
    # Each op's forward and each Linear's method, once. Quantized layers keep their int8 method: packing leaves
    # them alone. The offload hooks swap plain parameters, so with offloaded layers (CPU tests) nothing is packed.
    native_cpu = select_forwards(model, device, model_config.dtype)
    packed = install_cpu_ops(model, native_cpu, pack=offloader is None) if device.type == "cpu" else 0
    if device.type == "cuda":
        from pagedllm.model_executor.fused_moe_triton import TRITON_FUSED

        for module in model.modules():
            if isinstance(module, FusedMoE):
                if module.method is GROUPED:  # (quantized experts keep their format's method)
                    module.method = TRITON_FUSED  # the experts in two fused launches, graph-capturable
    return LoadedModel(model, offloader, packed)


def _use_device_products(model: nn.Module, device: torch.device) -> None:
    """Quantized formats' faster products where the weights live: on a CPU the native kernels (quant_gemv.cpp),
    on CUDA the Triton dequant-GEMM kernels (quant/triton_gemm.py)."""
    if device.type == "cpu" and any(getattr(m, "method", None) is MXFP4_EXPERTS for m in model.modules()):
        MXFP4_EXPERTS.kernels = cpu_kernels()  # (gpt-oss' experts: quant_gemv.cpp's mxfp4_gemv)
    for fmt in {id(m.quant_format): m.quant_format for m in model.modules()
                if getattr(m, "quant_format", None) is not None}.values():
        if device.type == "cpu":
            fmt.kernels = cpu_kernels()
        elif device.type == "cuda":
            fmt.device_gemm = triton_gemm


def _move_to(model: nn.Module, device: torch.device, kept: set[int]) -> None:
    """Move parameters (except those whose id is in `kept`) and buffers to `device`."""
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in kept:
                p.data = p.data.to(device)
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                setattr(module, name, buf.to(device))


def _iter_safetensors(model_config: ModelConfig, ignored: frozenset[str] = frozenset()
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each checkpoint tensor this rank holds (its slice of it under tensor parallelism) as stored, but `ignored`
    ones (a head the model does not use), which are not read."""
    files = weight_files(model_config.path)
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_config.path}. pagedllm loads safetensors checkpoints; "
            f"use load_format='dummy' to run the model's shape with random weights."
        )
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    shards = ShardLayout.of(model_config.hf_config)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=total < 50) as bar:
        for handle in handles:
            for name in handle.keys():
                if name not in ignored:
                    yield name, _read_shard(handle, name, shards)
                bar.update(1)


def _read_shard(handle, name: str, shards: ShardLayout) -> torch.Tensor:
    """This tensor-parallel rank's part of checkpoint tensor `name`, read alone from the file
    (distributed/sharding.py says which part)."""
    split = shards.split_of(name)
    if split is None:
        return handle.get_tensor(name)
    kind, start, length = split
    tensor = handle.get_slice(name)
    if kind == "zero":  # a row-parallel bias: added once, by rank 0
        return torch.zeros(tensor.get_shape())
    if kind == "row":
        return tensor[:, start:start + length]
    part = tensor[start:start + length]
    if kind == "vocab" and part.shape[0] < length:  # the last shard of a vocabulary ranks do not divide
        part = torch.cat((part, part.new_zeros(length - part.shape[0], *part.shape[1:])))
    return part



def _load_safetensors(model: nn.Module, model_config: ModelConfig, stored_formats: dict) -> None:
    """Read the checkpoint into the model: floating tensors in the model's dtype, a quantized module's tensors
    converted to its Linear's parameters (quant/config.py)."""
    raw = _iter_safetensors(model_config, model.ignored_weight_names)
    with torch.no_grad():
        loaded = model.load_weights(convert_checkpoint(raw, stored_formats, model_config.dtype))
    missing = model.expected_weight_names() - loaded
    if missing:
        raise ValueError(
            f"checkpoint {model_config.path} lacks {len(missing)} weights the model needs, "
            f"e.g. {sorted(missing)[:5]}"
        )


def _init_dummy_weights(model: nn.Module, seed: int, device: torch.device) -> None:
    """Random weights from a fixed seed (norms at 1), for running a model's shape without its files.
    Drawn on `device` whatever memory a weight lives in (host-staged or offloaded ones are drawn there
    and copied), so the values do not depend on where the weights live, and drawing is fast on a GPU."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        stored = set()  # a quantized checkpoint's values: drawn by their format
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, FusedMoE) and getattr(module, "quant_format", None) is not None:
                init_dummy_experts(module, gen)
                stored.update(id(p) for n, p in module.named_parameters() if not n.endswith("bias"))
            elif getattr(module, "quant_format", None) is not None:
                module.quant_format.init_dummy(module, gen)
                stored.update(id(p) for n, p in module.named_parameters() if n != "bias")
            elif isinstance(module, FusedMoE) and module.method is MXFP4_EXPERTS:
                init_dummy_mxfp4(module, gen)
                stored.update(id(p) for n, p in module.named_parameters() if not n.endswith("bias"))
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or id(param) in stored:
                continue
            if name.endswith(".bias"):
                param.zero_()
            elif param.device.type == device.type:
                param.normal_(0.0, 0.02, generator=gen)
            else:
                param.copy_(torch.empty_like(param, device=device).normal_(0.0, 0.02, generator=gen))
