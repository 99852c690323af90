"""Building blocks shared by the model files: norms, rotary embeddings, activations."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.errors import UnsupportedModelError
from pagedllm.model_executor.cpu_kernels import cpu_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def fused_kernels(x: torch.Tensor):
    """cpu_kernels for x when it is float32 or bfloat16 on CPU (what the elementwise kernels and the
    GEMV take), else None."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return cpu_kernels()


class RMSNorm(nn.Module):
    """Computed in float32 and cast back before the weight, exactly as the HF reference does.

    Given the residual stream too, adds x to it first and returns (normed, new residual): the
    residual add of a decoder layer fused with the norm after it (one pass on CPU, where the
    kernel updates the residual tensor in place)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        kernels = fused_kernels(x)
        if kernels is not None and x.dim() == 2 and x.stride(-1) == 1 and self.weight.dtype == x.dtype \
                and (residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1)):
            out = kernels.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is not None:
            x = residual = residual + x
        # F.rms_norm is x * rsqrt(mean(x^2) + eps) in one call (one op instead of five per norm).
        h = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)


def rope_inv_freq(head_dim: int, rope_parameters: dict) -> torch.Tensor:
    """Inverse frequencies for the supported rope types; anything else is refused by name."""
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})."
        )
    partial = rope_parameters.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported (only 1.0).")
    base = rope_parameters["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / rope_parameters["factor"]
    elif rope_type == "llama3":
        factor = rope_parameters["factor"]
        low, high = rope_parameters["low_freq_factor"], rope_parameters["high_freq_factor"]
        old_len = rope_parameters["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a cos/sin table for every position."""

    def __init__(self, head_dim: int, max_positions: int, rope_parameters: dict) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(head_dim, rope_parameters)  # validated at construction
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        if not self.cos.is_meta:
            self.build_tables()

    def build_tables(self) -> None:
        """Fill the cos/sin tables in float32 on the buffers' device (after meta-device construction)."""
        device = self.cos.device
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (positions, head_dim)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: (tokens, heads, head_dim); k: (tokens, kv_heads, head_dim)
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin for x: (tokens, heads, head_dim) (queries and keys may come as
        one tensor). On CPU a fused kernel rotates x in place; otherwise rotate_half(x) * sin =
        roll(x, half) * [-sin, sin], with the sign in the table: the same products as the reference's,
        in two fewer ops."""
        kernels = fused_kernels(x)
        if kernels is not None and x.stride(-1) == 1 and self.cos.dtype == torch.float32 \
                and positions.dtype == torch.long and positions.is_contiguous():
            kernels.rotary_embedding(x, positions, self.cos, self.sin)  # in place, same rounding
            return x
        cos, signed_sin = self._cos_sin(positions, x.dtype)
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer shares this module and the step's positions: look them up once per forward."""
        cached = getattr(self, "_step_cache", None)
        if cached is None or cached[0] is not positions or cached[1] != dtype:
            cos = self.cos[positions].to(dtype).unsqueeze(1)
            sin = self.sin[positions].to(dtype)
            half = sin.shape[-1] // 2
            signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1)
            self._step_cache = cached = (positions, dtype, cos, signed_sin)
        return cached[2], cached[3]


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def get_activation(name: str):
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act {name!r} is not supported (supported: {', '.join(ACTIVATIONS)}).")
    return ACTIVATIONS[name]


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
    kernels = fused_kernels(x) if x.shape[0] <= GEMV_MAX_ROWS and x.dtype == torch.bfloat16 else None
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
    kernels = fused_kernels(x) if 2 <= rows <= GEMV_MAX_ROWS and x.dtype == torch.bfloat16 else None
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


def _onednn_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpu_has_bf16_arithmetic() -> bool:
    """AMX / AVX512-BF16 (our kernels) or oneDNN's bf16 support. Without either, PyTorch's bf16 matmul
    on CPU is a slow fallback (a 2048^3 product: 59 s on a 2-core Zen 3, 0.1 s in fp32)."""
    kernels = cpu_kernels()
    return (kernels is not None and kernels.packed_linear_supported()) or _onednn_bf16()


def pack_linear_weights(model: nn.Module) -> int:
    """On CPU in bfloat16, re-lay every Linear's weight once for the CPU's vector / matrix units; the
    plain weight is freed. Returns the bytes now held in packed form.

    Where cpu_kernels has its AMX / AVX512-BF16 kernels (packed_linear.cpp), they take the weight:
    one layout serves every batch size, read at memory bandwidth at one row (24 layers of
    Qwen2.5-0.5B: 39-42 ms against oneDNN's 78-84 ms here) and faster than oneDNN at 64-512 rows.
    A weight shared by a Linear and an Embedding (a tied LM head) is packed once for both: the
    embedding reads its rows back out of the packed layout. A Linear marked `feeds_silu_and_mul`
    (an MLP's [gate | up]) is packed with its gate and up blocks alternating and gains
    `fused_silu_and_mul(x)`: SiLU(gate) * up computed as each block pair leaves the matrix units
    (no (rows, 2 * intermediate) product written and read back); its forward still gives the product.
    Otherwise, with oneDNN bf16 (AVX-512 without AMX), oneDNN's blocked format, 2-3x faster than the
    plain bf16 product at one row and ~1.4x at 64; a tied weight then stays plain (one copy) and
    multiplies in the orientation that is faster for decode. With neither (no bf16 arithmetic: AVX2
    only), the same packed layout goes to the kernels' AVX2 / FMA path, which widens bf16 to fp32 in
    registers (24 layers at 1 row: 24 ms, 30 GB/s, where PyTorch's bf16 product took 65 ms; at 64 rows
    ~135 GFLOP/s against ~20 for PyTorch's bf16 matmul); a weight not in whole blocks, or every weight
    when the kernels cannot be built, multiplies UPCAST_MIN_ROWS rows or more in fp32 (upcast_linear).
    """
    kernels = cpu_kernels()
    amx = kernels is not None and kernels.packed_linear_supported()
    onednn = _onednn_bf16()
    fma = not (amx or onednn) and kernels is not None and kernels.packed_linear_fma_supported()
    if not (amx or onednn or fma):
        _use_fp32_arithmetic(model)
        return 0
    own_kernels = amx or fma  # packed_linear.cpp takes whole-block weights
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
