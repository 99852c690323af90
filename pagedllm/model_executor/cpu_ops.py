"""The CPU's native ops (cpu_kernels) for a CPU engine, chosen once at load: the op table of the `cpu` backend
outside attention. Norms, rotary embeddings and SiLU-and-multiply choose their `forward_cpu` (layers.py,
select_forwards); here, each Linear gets the LinearMethod that multiplies its weight fastest on this CPU's vector /
matrix units (its weight re-laid once where that pays), and an LM head that may compute its logits in the
other orientation. Nothing in a hot function asks which device it runs on.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.cpu_isa import (
    cpu_isa,
    cpu_kernels,
    expected_cpu_isas,
    forced_cpu_isa,
    machine_cpu_isa,
    onednn_bf16,
)
from pagedllm.model_executor.layers import NATIVE_DTYPES
from pagedllm.model_executor.linear import (
    UNQUANTIZED,
    Embedding,
    EmbeddingMethod,
    GateUpLinear,
    Linear,
    LinearMethod,
    LMHead,
)
from pagedllm.model_executor.moe import GROUPED, FusedMoE, MoEMethod

logger = logging.getLogger(__name__)


def install_cpu_ops(model: nn.Module, native: bool, pack: bool = True) -> int:
    """Each Linear's method on this CPU (with `pack`: pack_linear_weights), and with `native` (the CPU's kernels
    serve the ops: layers.select_forwards) an LM head that may compute its logits vocab-major. Returns the
    bytes held in packed form."""
    isa = cpu_isa()
    logger.info("CPU path: %s%s", isa, "" if isa == machine_cpu_isa() else
                f" (forced by PAGEDLLM_CPU_ISA; this machine has {machine_cpu_isa()})")
    packed = pack_linear_weights(model, vocab_major=native) if pack else 0
    if native:
        for head in model.modules():
            if isinstance(head, LMHead) and head.method is UNQUANTIZED:
                head.method = CpuLinear(vocab_major=True)
    return packed


class CpuLinear(LinearMethod):
    """A plain weight on a CPU. As an LM head with `vocab_major`, a bf16 weight computes W @ hidden^T and returns
    that (vocab, rows) array's transposed view: ~1.6x faster than hidden @ W^T at 64-128 rows, for a caller
    that reads any layout (up to GEMV_MAX_ROWS rows the head's own product runs a GEMV, faster still)."""

    name = "cpu-plain"

    def __init__(self, vocab_major: bool = False) -> None:
        self.vocab_major = vocab_major

    def apply_logits(self, layer, x: torch.Tensor, vocab_major: bool) -> torch.Tensor:
        w = layer.weight
        if vocab_major and self.vocab_major and self._orientation_pays(x) and x.dim() == 2 \
                and x.shape[0] > GEMV_MAX_ROWS and w.dtype == torch.bfloat16 and w.numel() > 0 and layer.bias is None:
            return (w @ x.T).T
        return self.apply(layer, x)

    def _orientation_pays(self, x: torch.Tensor) -> bool:
        return True


def fused_kernels(x: torch.Tensor):
    """cpu_kernels for x when it is float32 or bfloat16 on CPU (what the elementwise kernels and the
    GEMV take), else None. (The sampler's argmax asks it per call: its logits may live anywhere.)"""
    if x.device.type != "cpu" or x.dtype not in NATIVE_DTYPES:
        return None
    return cpu_kernels()


# Up to this many rows, a plain bf16 weight is multiplied by cpu_kernels' GEMV: it streams the weight
# once for all rows (a 151,936 x 896 LM head at one row: 26 ms against torch.mv's 34 ms here).
GEMV_MAX_ROWS = 4


class SharedWeightLinear(CpuLinear):
    """A bf16 weight that must keep its plain layout (a tied LM head, on oneDNN): with few rows,
    W @ x^T (a GEMV over W's contiguous rows) runs ~1.5x faster on CPU than x @ W^T."""

    name = "cpu-shared-weight"

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] > 32:
            return F.linear(x, layer.weight, layer.bias)
        kernels = cpu_kernels() if x.shape[0] <= GEMV_MAX_ROWS and x.dtype == torch.bfloat16 else None
        if kernels is not None:
            out = kernels.gemv_bf16(x, layer.weight)
        else:
            out = torch.mv(layer.weight, x[0]).unsqueeze(0) if x.shape[0] == 1 else (layer.weight @ x.T).T
        return out if layer.bias is None else out + layer.bias


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


class UpcastLinear(CpuLinear):
    """On a CPU with no bf16 arithmetic: many rows in fp32 (upcast_linear); 2-4 rows through cpu_kernels' GEMV
    (the weight read once for all rows: 896 x 1152 at 4 rows 0.25 vs 0.44 ms, 4864 x 896 0.70 vs 1.90, LM head
    46 vs 105, same machine); one row, or 5-15, `plain` (the bf16 product, at one row as fast as the GEMV; a
    tied weight's GEMV orientation)."""

    name = "cpu-upcast"

    def __init__(self, plain: CpuLinear) -> None:
        super().__init__(plain.vocab_major)
        self.plain = plain

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if x.dtype == torch.bfloat16 and rows >= UPCAST_MIN_ROWS:
            return upcast_linear(x, layer.weight, layer.bias)
        kernels = cpu_kernels() if 2 <= rows <= GEMV_MAX_ROWS and x.dtype == torch.bfloat16 else None
        if kernels is not None and layer.weight.is_contiguous():
            out = kernels.gemv_bf16(x.reshape(rows, x.shape[-1]), layer.weight).view(*x.shape[:-1], -1)
            return out if layer.bias is None else out + layer.bias
        return self.plain.apply(layer, x)

    def _orientation_pays(self, x: torch.Tensor) -> bool:
        return x.shape[0] < UPCAST_MIN_ROWS  # from there its fp32 product is the faster one


class OneDnnPackedLinear(LinearMethod):
    """oneDNN's blocked bf16 layout (AVX-512 without AMX); the plain weight is freed."""

    name = "onednn-packed"

    def __init__(self, packed_weight: torch.Tensor) -> None:
        self.packed_weight = packed_weight

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, layer.bias, "none", [], "")


class KernelPackedLinear(LinearMethod):
    """cpu_kernels' packed layout (packed_linear.cpp: AMX, or AVX2 / FMA widening bf16 in registers); the plain
    weight is freed."""

    name = "kernel-packed"

    def __init__(self, packed_weight: torch.Tensor, packed_bias: torch.Tensor | None) -> None:
        self.packed_weight = packed_weight
        self.packed_bias = packed_bias

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels().packed_linear(x, self.packed_weight, self.packed_bias)


class KernelPackedGateUp(KernelPackedLinear):
    """A [gate | up] weight packed with its gate and up blocks alternating (gate 0-15, up 0-15, gate 16-31, ...):
    SiLU(gate) * up is computed as each block pair leaves the matrix units, no (rows, 2 * width) product
    written and read back. Its plain product is still there (un-interleaved) for what asks for it."""

    name = "kernel-packed-gate-up"

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        out = cpu_kernels().packed_linear(x, self.packed_weight, self.packed_bias)
        return out.unflatten(-1, (-1, 2, 16)).transpose(-3, -2).flatten(-3)

    def apply_and_act(self, layer, x: torch.Tensor) -> torch.Tensor:
        if layer.act_and_mul.hidden_act != "silu":
            return super().apply_and_act(layer, x)
        return cpu_kernels().packed_linear_silu_mul(x, self.packed_weight, self.packed_bias)


class PackedRowsEmbedding(EmbeddingMethod):
    """An embedding whose weight a tied LM head packed (one copy for both): rows read back out of the layout."""

    name = "kernel-packed-rows"

    def __init__(self, packed_weight: torch.Tensor) -> None:
        self.packed_weight = packed_weight

    def apply(self, layer, ids: torch.Tensor) -> torch.Tensor:
        return cpu_kernels().packed_embedding(ids, self.packed_weight)


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


def pack_linear_weights(model: nn.Module, vocab_major: bool = False) -> int:
    """On CPU in bfloat16, re-lay every Linear's weight once for the CPU's vector / matrix units; the
    plain weight is freed. Returns the bytes now held in packed form. The path is cpu_isa()'s (the
    machine's best, or a lower one PAGEDLLM_CPU_ISA forces).

    `amx`: cpu_kernels' AMX / AVX512-BF16 kernels (packed_linear.cpp) take the weight:
    one layout serves every batch size, read at memory bandwidth at one row (24 layers of
    Qwen2.5-0.5B: 39-42 ms against oneDNN's 78-84 ms here) and faster than oneDNN at 64-512 rows.
    A weight shared by a Linear and an Embedding (a tied LM head) is packed once for both: the
    embedding reads its rows back out of the packed layout. An MLP's [gate | up] (GateUpLinear) is
    packed with its gate and up blocks alternating (KernelPackedGateUp): SiLU(gate) * up computed as each
    block pair leaves the matrix units (no (rows, 2 * intermediate) product written and read back).
    `avx512_bf16` (oneDNN bf16, AVX-512 without AMX): oneDNN's blocked format, 2-3x faster than the
    plain bf16 product at one row and ~1.4x at 64; a tied head gets a packed copy beside the embedding's
    plain table (two copies, as vLLM's CPU backend holds them: the head is the largest single read of a
    small model's decode step). `avx2` (no bf16 arithmetic), the same
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
        _use_fp32_arithmetic(model, vocab_major)
        return 0
    sharers: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            sharers.setdefault(id(param), []).append(module)
    packed_bytes = 0
    pack_expert = (lambda layer: _pack_for_kernels(layer, kernels)) if own_kernels else _pack_for_onednn
    packed_bytes += sum(_pack_experts(moe, pack_expert) for moe in model.modules()
                        if _experts_packable(moe, whole_blocks=own_kernels))
    for module in model.modules():
        if not _packable(module):
            continue
        w = module.weight
        others = [m for m in sharers[id(w)] if m is not module]
        if others:
            embedding = others[0]
            if own_kernels and _kernel_packable(w) and len(others) == 1 and isinstance(embedding, Embedding) \
                    and embedding.max_norm is None:
                method = _pack_for_kernels(module, kernels)
                embedding.method = PackedRowsEmbedding(method.packed_weight)
                embedding.weight = module.weight
                packed_bytes += w.numel() * w.element_size()
            elif fma:
                module.method = UpcastLinear(SharedWeightLinear(vocab_major))
            elif onednn and not own_kernels:
                # oneDNN's layout beside the embedding's plain table, as vLLM's CPU backend keeps it: the head is
                # read every step (Qwen2.5-0.5B's at one row 3.8-6.0 ms against 7-9 ms for its plain rows here).
                _pack_for_onednn(module, keep_weight=True)
                packed_bytes += w.numel() * w.element_size()
            else:
                module.method = SharedWeightLinear(vocab_major)
            continue
        if own_kernels and _kernel_packable(w):
            _pack_for_kernels(module, kernels)
        elif onednn:
            _pack_for_onednn(module)
        else:
            if fma:
                module.method = UpcastLinear(CpuLinear(vocab_major))
            continue
        packed_bytes += w.numel() * w.element_size()
    return packed_bytes


def _packable(module: nn.Module) -> bool:
    """A Linear still multiplying its plain bf16 weight in host memory (not int8, not packed, not empty)."""
    if not isinstance(module, nn.Linear) or getattr(module, "method", UNQUANTIZED) is not UNQUANTIZED:
        return False
    w = module.weight
    return w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.numel() > 0


class PackedExpertsMoE(MoEMethod):
    """Each expert's [gate | up] and down projections as Linear layers packed as a dense MLP's are (cpu_kernels'
    layout with SiLU(gate) * up fused into the first product, or oneDNN's); the stacked weights are freed."""

    name = "packed-experts"

    def __init__(self, gate_up: list[GateUpLinear], down: list[Linear]) -> None:
        self.gate_up, self.down = gate_up, down

    def expert_forward(self, layer, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self.down[expert](self.gate_up[expert](x))


def _experts_packable(module: nn.Module, whole_blocks: bool) -> bool:
    """Stacked bf16 experts in host memory (for cpu_kernels' layout: whose projections are whole kernel blocks)."""
    if not isinstance(module, FusedMoE) or module.method is not GROUPED:
        return False
    w13, w2 = module.w13_weight, module.w2_weight
    if not (w13.dtype == torch.bfloat16 and w13.device.type == "cpu" and w13.numel() > 0):
        return False
    return not whole_blocks or (_kernel_packable(w13[0]) and w13.shape[1] % 32 == 0 and _kernel_packable(w2[0]))


def _pack_experts(moe: FusedMoE, pack: Callable[[nn.Linear], object]) -> int:
    """Pack `moe`'s experts one by one with `pack` (cpu_kernels' layout, or oneDNN's on AVX-512 BF16 without AMX:
    one expert's few rows of a decode step, Qwen3-30B-A3B's expert shape, 35-43 GB/s where the plain bf16
    product read 25 GB/s); returns the bytes now held packed (PackedExpertsMoE)."""
    packed = sum(w.numel() * w.element_size() for w in (moe.w13_weight, moe.w2_weight))
    gate_ups, downs = [], []
    for e in range(moe.num_experts):
        with torch.device("meta"):
            gate_up = GateUpLinear(moe.hidden_size, moe.width, moe.w13_bias is not None, "silu")
            down = Linear(moe.width, moe.hidden_size, bias=moe.w2_bias is not None)
        gate_up.act_and_mul = moe.act_and_mul
        for layer, weight, bias in ((gate_up, moe.w13_weight, moe.w13_bias), (down, moe.w2_weight, moe.w2_bias)):
            layer.weight = nn.Parameter(weight[e], requires_grad=False)
            layer.bias = None if bias is None else nn.Parameter(bias[e], requires_grad=False)
            pack(layer)
        gate_ups.append(gate_up)
        downs.append(down)
    moe.method = PackedExpertsMoE(gate_ups, downs)
    for name in ("w13_weight", "w2_weight"):
        setattr(moe, name, nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False))
    return packed


def _use_fp32_arithmetic(model: nn.Module, vocab_major: bool) -> None:
    """No bf16 arithmetic on this CPU and no kernels to pack for: every bf16 Linear on CPU multiplies
    UPCAST_MIN_ROWS rows or more in fp32 (upcast_linear); fewer rows keep the bf16 product (a tied LM
    head its GEMV)."""
    tied = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    for module in model.modules():
        if _packable(module):
            plain = SharedWeightLinear(vocab_major) if id(module.weight) in tied else CpuLinear(vocab_major)
            module.method = UpcastLinear(plain)


def _pack_for_onednn(module: nn.Linear, keep_weight: bool = False) -> OneDnnPackedLinear:
    """The weight in oneDNN's blocked bf16 layout; the plain weight freed unless `keep_weight` (a table an
    embedding reads). Returns the layer's new method."""
    w = module.weight
    module.method = OneDnnPackedLinear(torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACKING_BATCH_HINT))
    if not keep_weight:
        module.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
    return module.method


def tied_head_copy_bytes(hf_config, dtype: torch.dtype) -> int:
    """What pack_linear_weights will add on this machine for `hf_config`'s LM head, before any weight is loaded:
    a tied bf16 head on the avx512_bf16 path gets oneDNN's copy beside the embedding's table (for dry-run plans;
    the path read from the CPU's flags and PAGEDLLM_CPU_ISA, the kernels not built)."""
    if dtype != torch.bfloat16 or not getattr(hf_config, "tie_word_embeddings", False) \
            or getattr(hf_config, "model_type", "") == "higgs_audio_v2":  # (no text head)
        return 0
    path = forced_cpu_isa() or expected_cpu_isas()[0]
    return hf_config.vocab_size * hf_config.hidden_size * dtype.itemsize if path == "avx512_bf16" else 0


def _pack_for_kernels(module: nn.Linear, kernels) -> KernelPackedLinear:
    """The weight in cpu_kernels' layout (a [gate | up] weight whose gate and up are whole 16-row blocks with its
    blocks alternating); the plain weight freed. Returns the layer's new method."""
    w = module.weight.detach()
    bias = None if module.bias is None else module.bias.detach().float()
    gate_up = isinstance(module, GateUpLinear) and w.shape[0] % 32 == 0
    if gate_up:  # rows [gate | up] -> gate 0-15, up 0-15, gate 16-31, ...: each pair in one pass
        def alternate(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(0, (2, -1, 16)).transpose(0, 1).flatten(0, 2)
        w, bias = alternate(w), None if bias is None else alternate(bias)
    method = (KernelPackedGateUp if gate_up else KernelPackedLinear)(
        kernels.pack_linear_weight(w), None if bias is None else bias.contiguous())
    module.method = method
    module.weight = nn.Parameter(torch.empty(0, dtype=module.weight.dtype), requires_grad=False)
    return method
