"""The CPU's native ops (cpu_kernels), installed on a CPU engine's model once at load: the op table of
the `cpu` backend outside attention. The model files and layers.py hold only the PyTorch reference;
`install_cpu_ops` re-binds the forwards of the modules the kernels serve (norms, rotary embedding, the
MLP's SiLU-and-multiply, the LM head's few-row products) and re-lays the Linears' weights for the CPU's
vector / matrix units. Nothing in a hot function asks which device it runs on.
"""
from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.cpu_isa import cpu_isa, machine_cpu_isa, onednn_bf16
from pagedllm.model_executor.cpu_kernels import cpu_kernels
from pagedllm.model_executor.layers import RMSNorm, RotaryEmbedding
from pagedllm.model_executor.models.llama import LlamaMLP

logger = logging.getLogger(__name__)

NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the element-wise kernels and the GEMV take


def install_cpu_ops(model: nn.Module, pack: bool = True) -> int:
    """Bind the native forwards where cpu_kernels built, and (with `pack`) re-lay the Linears' weights
    (pack_linear_weights). Returns the bytes held in packed form."""
    kernels = cpu_kernels()
    dtype = next(model.parameters()).dtype
    isa = cpu_isa()
    logger.info("CPU path: %s%s", isa, "" if isa == machine_cpu_isa() else
                f" (forced by PAGEDLLM_CPU_ISA; this machine has {machine_cpu_isa()})")
    if kernels is not None and dtype in NATIVE_DTYPES:
        native = {RMSNorm: ("forward", _native_rms_norm), RotaryEmbedding: ("rotate", _native_rotate),
                  LlamaMLP: ("forward", _native_mlp)}
        for module in model.modules():
            if type(module) in native:
                method, fn = native[type(module)]
                setattr(module, method, types.MethodType(fn, module))
        if hasattr(model, "lm_head"):
            model.compute_logits = types.MethodType(_cpu_compute_logits, model)
    return pack_linear_weights(model) if pack else 0


def _native_rms_norm(self: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None):
    """One pass (the residual add updates `residual` in place), the reference's rounding."""
    if x.dim() == 2 and x.stride(-1) == 1 and self.weight.dtype == x.dtype \
            and (residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1)):
        out = cpu_kernels().rms_norm(x, residual, self.weight, self.eps)
        return out if residual is None else (out, residual)
    return RMSNorm.forward(self, x, residual)


def _native_rotate(self: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x rotated in place, the reference's rounding."""
    if x.stride(-1) == 1 and self.cos.dtype == torch.float32 and positions.dtype == torch.long \
            and positions.is_contiguous():
        cpu_kernels().rotary_embedding(x, positions, self.cos, self.sin)
        return x
    return RotaryEmbedding.rotate(self, positions, x)


def _native_mlp(self, x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up in one pass: straight from the packed gate / up product's blocks when the weight
    was packed with them alternating (pack_linear_weights), else over the product (the same rounding)."""
    fused = getattr(self.gate_up_proj, "fused_silu_and_mul", None)
    if fused is not None:
        return self.down_proj(fused(x))
    gate_up = self.gate_up_proj(x)
    if self.act is F.silu and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return self.down_proj(cpu_kernels().silu_and_mul(gate_up))
    gate, up = gate_up.chunk(2, dim=-1)
    return self.down_proj(self.act(gate) * up)


def _cpu_compute_logits(self, hidden: torch.Tensor, vocab_major: bool = False) -> torch.Tensor:
    """(rows, vocab) logits. With vocab_major, a plain bf16 LM head (a tied embedding that
    pack_linear_weights could not pack, e.g. without AMX) computes W @ hidden^T and returns that
    (vocab, rows) array's transposed view: ~1.6x faster than hidden @ W^T at 64-128 rows, for a caller
    that reads any layout. (Up to GEMV_MAX_ROWS rows the head's own forward runs a GEMV, faster still;
    on a CPU without bf16 arithmetic the head's forward multiplies many rows in fp32.)"""
    w = self.lm_head.weight
    upcasts = hasattr(self.lm_head, "plain_forward") and hidden.shape[0] >= UPCAST_MIN_ROWS
    if vocab_major and not upcasts and hidden.dim() == 2 and hidden.shape[0] > GEMV_MAX_ROWS \
            and w.dtype == torch.bfloat16 and w.numel() > 0 and self.lm_head.bias is None:
        return (w @ hidden.T).T
    return self.lm_head(hidden)


def fused_kernels(x: torch.Tensor):
    """cpu_kernels for x when it is float32 or bfloat16 on CPU (what the elementwise kernels and the
    GEMV take), else None. (The sampler's argmax asks it per call: its logits may live anywhere.)"""
    if x.device.type != "cpu" or x.dtype not in NATIVE_DTYPES:
        return None
    return cpu_kernels()


def _packed_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def _kernel_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return cpu_kernels().packed_linear(x, self.packed_weight, self.packed_bias)


def _kernel_gate_up_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The plain [gate | up] product from a weight packed with gate and up blocks alternating."""
    out = cpu_kernels().packed_linear(x, self.packed_weight, self.packed_bias)
    return out.unflatten(-1, (-1, 2, 16)).transpose(-3, -2).flatten(-3)


def _kernel_silu_and_mul(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of this gate / up Linear's product in one pass (see pack_linear_weights)."""
    return cpu_kernels().packed_linear_silu_mul(x, self.packed_weight, self.packed_bias)


def _kernel_embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    return cpu_kernels().packed_embedding(ids, self.packed_weight)


# Up to this many rows, a plain bf16 weight is multiplied by cpu_kernels' GEMV: it streams the weight
# once for all rows (a 151,936 x 896 LM head at one row: 26 ms against torch.mv's 34 ms here).
GEMV_MAX_ROWS = 4


def _shared_weight_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """For a bf16 weight that must keep its plain layout (a tied LM head): with few rows,
    W @ x^T (a GEMV over W's contiguous rows) runs ~1.5x faster on CPU than x @ W^T."""
    if x.dim() != 2 or x.shape[0] > 32:
        return F.linear(x, self.weight, self.bias)
    kernels = cpu_kernels() if x.shape[0] <= GEMV_MAX_ROWS and x.dtype == torch.bfloat16 else None
    if kernels is not None:
        out = kernels.gemv_bf16(x, self.weight)
    else:
        out = torch.mv(self.weight, x[0]).unsqueeze(0) if x.shape[0] == 1 else (self.weight @ x.T).T
    return out if self.bias is None else out + self.bias


# From this many rows, on a CPU with no bf16 arithmetic (no AMX, no AVX512-BF16: PyTorch's bf16 matmul
# then runs at ~20 GFLOP/s against ~160 in fp32), a bf16 Linear converts its weight to fp32 a slice at
# a time and multiplies in fp32. 2-core AMD EPYC (Zen 3, AVX2), 896 x 4864 weight: 16 rows 5.2 vs
# 7.4 ms, 64 rows 7.9 vs 27.6, 256 rows 18.9 vs 113.7; a 151,936 x 896 LM head at 64 rows 155 vs 879.
# Below it the bf16 product (a GEMV that streams the half-size weight) is faster: 1 row 0.5 vs 1.3 ms.
UPCAST_MIN_ROWS = 16
_UPCAST_SLICE_ROWS = 512  # weight rows converted at a time: 1.8 MB of fp32 at K = 896, cache-sized


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias for bf16 x and weight, summed in fp32 over fp32 copies of weight slices."""
    x32 = x.reshape(-1, x.shape[-1]).float()
    out = torch.empty(x32.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    for n0 in range(0, weight.shape[0], _UPCAST_SLICE_ROWS):
        n1 = min(n0 + _UPCAST_SLICE_ROWS, weight.shape[0])
        b = None if bias is None else bias[n0:n1].float()
        out[:, n0:n1] = F.linear(x32, weight[n0:n1].float(), b)
    return out.view(*x.shape[:-1], weight.shape[0])


def _upcast_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Many rows in fp32; 2-4 rows through cpu_kernels' GEMV (the weight read once for all rows: 896 x
    1152 at 4 rows 0.25 vs 0.44 ms, 4864 x 896 0.70 vs 1.90, LM head 46 vs 105, same machine); one row,
    or 5-15, the plain bf16 product (at one row as fast as the GEMV)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.dtype == torch.bfloat16 and rows >= UPCAST_MIN_ROWS:
        return upcast_linear(x, self.weight, self.bias)
    kernels = cpu_kernels() if 2 <= rows <= GEMV_MAX_ROWS and x.dtype == torch.bfloat16 else None
    if kernels is not None and self.weight.is_contiguous():
        out = kernels.gemv_bf16(x.reshape(rows, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)
        return out if self.bias is None else out + self.bias
    return self.plain_forward(x)


# The batch size oneDNN picks the packed layout for. Measured on a 2-core AMX Xeon, 24 layers of the
# Qwen2.5-0.5B Linears: with hint 1, 76 / 122 ms at 64 / 128 rows; with any hint >= 16, 63 / 98 ms;
# equal (37-40 ms) at 1-16 rows.
_PACKING_BATCH_HINT = 128


def _kernel_packable(w: torch.Tensor) -> bool:
    """cpu_kernels' packed layout takes whole 16-column blocks and 32-element K tiles."""
    return w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0


def cpu_has_bf16_arithmetic() -> bool:
    """AMX / AVX512-BF16 (our kernels) or oneDNN's bf16 support (cpu_isa). Without either, PyTorch's bf16
    matmul on CPU is a slow fallback (a 2048^3 product: 59 s on a 2-core Zen 3, 0.1 s in fp32)."""
    return cpu_isa() in ("amx", "avx512_bf16")


def pack_linear_weights(model: nn.Module) -> int:
    """On CPU in bfloat16, re-lay every Linear's weight once for the CPU's vector / matrix units; the
    plain weight is freed. Returns the bytes now held in packed form. The path is cpu_isa()'s (the
    machine's best, or a lower one PAGEDLLM_CPU_ISA forces).

    `amx`: cpu_kernels' AMX / AVX512-BF16 kernels (packed_linear.cpp) take the weight:
    one layout serves every batch size, read at memory bandwidth at one row (24 layers of
    Qwen2.5-0.5B: 39-42 ms against oneDNN's 78-84 ms here) and faster than oneDNN at 64-512 rows.
    A weight shared by a Linear and an Embedding (a tied LM head) is packed once for both: the
    embedding reads its rows back out of the packed layout. A Linear marked `feeds_silu_and_mul`
    (an MLP's [gate | up]) is packed with its gate and up blocks alternating and gains
    `fused_silu_and_mul(x)`: SiLU(gate) * up computed as each block pair leaves the matrix units
    (no (rows, 2 * intermediate) product written and read back); its forward still gives the product.
    `avx512_bf16` (oneDNN bf16, AVX-512 without AMX): oneDNN's blocked format, 2-3x faster than the
    plain bf16 product at one row and ~1.4x at 64; a tied weight then stays plain (one copy) and
    multiplies in the orientation that is faster for decode. `avx2` (no bf16 arithmetic), the same
    packed layout as `amx` (tied head and fused SiLU included) goes to the kernels' AVX2 / FMA path,
    which widens bf16 to fp32 in registers (24 layers at 1 row: 24 ms, 30 GB/s, where PyTorch's bf16
    product took 65 ms; at 64 rows ~135 GFLOP/s against ~20 for PyTorch's bf16 matmul); a weight not in
    whole blocks multiplies UPCAST_MIN_ROWS rows or more in fp32 (upcast_linear). `none` (no kernels):
    every bf16 Linear multiplies UPCAST_MIN_ROWS rows or more in fp32.
    """
    isa = cpu_isa()
    kernels = cpu_kernels()
    own_kernels = isa in ("amx", "avx2") and kernels is not None  # packed_linear.cpp takes whole-block weights
    fma = isa == "avx2" and own_kernels
    onednn = isa in ("amx", "avx512_bf16") and onednn_bf16()  # (on amx: the weights not in whole blocks)
    if not (own_kernels or onednn):
        _use_fp32_arithmetic(model)
        return 0
    sharers: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            sharers.setdefault(id(param), []).append(module)
    packed_bytes = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        w = module.weight
        if w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.numel() == 0:
            continue
        others = [m for m in sharers[id(w)] if m is not module]
        if others:
            embedding = others[0]
            if own_kernels and _kernel_packable(w) and len(others) == 1 and isinstance(embedding, nn.Embedding) \
                    and embedding.max_norm is None:
                _pack_for_kernels(module, kernels)
                embedding.packed_weight = module.packed_weight
                embedding.weight = module.weight
                embedding.forward = _kernel_embedding_forward.__get__(embedding)
                packed_bytes += w.numel() * w.element_size()
            elif fma:
                _upcast_many_rows(module, tied=True)
            else:
                module.forward = _shared_weight_forward.__get__(module)
            continue
        if own_kernels and _kernel_packable(w):
            gate_up = getattr(module, "feeds_silu_and_mul", False) and w.shape[0] % 32 == 0  # gate, up: whole blocks
            _pack_for_kernels(module, kernels, gate_up=gate_up)
        elif onednn:
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACKING_BATCH_HINT)
            module.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
            module.forward = _packed_linear_forward.__get__(module)
        else:
            if fma:
                _upcast_many_rows(module, tied=False)
            continue
        packed_bytes += w.numel() * w.element_size()
    return packed_bytes


def _use_fp32_arithmetic(model: nn.Module) -> None:
    """No bf16 arithmetic on this CPU and no kernels to pack for: every bf16 Linear on CPU multiplies
    UPCAST_MIN_ROWS rows or more in fp32 (upcast_linear); fewer rows keep the bf16 product (a tied LM
    head its GEMV)."""
    tied = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.numel() == 0:
            continue
        _upcast_many_rows(module, tied=id(w) in tied)


def _upcast_many_rows(module: nn.Linear, tied: bool) -> None:
    """Products of UPCAST_MIN_ROWS rows or more run in fp32 (upcast_linear); fewer keep the plain bf16
    forward (a weight tied to an embedding: its shared-weight forward)."""
    plain = _shared_weight_forward if tied else type(module).forward
    module.plain_forward = plain.__get__(module)
    module.forward = _upcast_linear_forward.__get__(module)


def _pack_for_kernels(module: nn.Linear, kernels, gate_up: bool = False) -> None:
    w = module.weight.detach()
    bias = None if module.bias is None else module.bias.detach().float()
    if gate_up:  # rows [gate | up] -> gate 0-15, up 0-15, gate 16-31, ...: each pair in one pass
        def alternate(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(0, (2, -1, 16)).transpose(0, 1).flatten(0, 2)
        w, bias = alternate(w), None if bias is None else alternate(bias)
        module.forward = _kernel_gate_up_forward.__get__(module)
        module.fused_silu_and_mul = _kernel_silu_and_mul.__get__(module)
    else:
        module.forward = _kernel_linear_forward.__get__(module)
    module.packed_weight = kernels.pack_linear_weight(w)
    module.packed_bias = None if bias is None else bias.contiguous()
    module.weight = nn.Parameter(torch.empty(0, dtype=module.weight.dtype), requires_grad=False)
