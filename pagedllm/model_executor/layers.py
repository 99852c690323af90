"""Building blocks shared by the model files: norms, rotary embeddings, activations. Each op with device-specific
code is a CustomOp: a reference forward in PyTorch ops (`forward_native`, any device) and the platform's own
(`forward_cpu`: the native CPU kernels), one of which the loader selects once (select_forwards). Linear layers
choose how they multiply the same way, through their LinearMethod (linear.py)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import tp_group
from pagedllm.errors import UnsupportedModelError
from pagedllm.model_executor.attention.base import current_forward_id
from pagedllm.model_executor.cpu_isa import cpu_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the CPU's element-wise kernels and GEMV take


class CustomOp(nn.Module):
    """An op with a reference implementation and per-platform ones (SGLang's CustomOp): `forward` runs the
    one select_forward chose, the reference until then. A platform's forward must give the reference's
    result (the same rounding), and falls back to it for inputs its kernel does not take."""

    def __init__(self) -> None:
        super().__init__()
        self.native_cpu = False  # forward_cpu (the CPU's kernels) instead of forward_native

    def forward(self, *args, **kwargs):
        return self.forward_cpu(*args, **kwargs) if self.native_cpu else self.forward_native(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def select_forward(self, native_cpu: bool) -> None:
        """`native_cpu`: the CPU's kernels serve this engine (a CPU device, kernels built, a dtype they take)."""
        self.native_cpu = native_cpu


def select_forwards(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Choose every CustomOp's forward for this engine, once, at load. Returns whether the CPU's native ones
    were chosen."""
    native_cpu = device.type == "cpu" and dtype in NATIVE_DTYPES and cpu_kernels() is not None
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.select_forward(native_cpu)
    return native_cpu


class RMSNorm(CustomOp):
    """Computed in float32 and cast back before the weight, exactly as the HF reference does.

    Given the residual stream too, adds x to it first and returns (normed, new residual): the
    residual add of a decoder layer fused with the norm after it (one pass on CPU, where the
    kernel updates the residual tensor in place)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = residual = residual + x
        # F.rms_norm is x * rsqrt(mean(x^2) + eps) in one call (one op instead of five per norm).
        h = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """One pass (the residual add updates `residual` in place), the reference's rounding."""
        if x.dim() == 2 and x.stride(-1) == 1 and self.weight.dtype == x.dtype \
                and (residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1)):
            out = cpu_kernels().rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        return self.forward_native(x, residual)


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
    elif rope_type == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, head_dim, rope_parameters)
    return inv_freq


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, p: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): interpolated (divided by `factor`) frequencies for the dimensions that turn
    fewer than beta_slow times over the original context, the original ones for those that turn more than
    beta_fast times, a linear ramp between; as transformers computes it."""
    base, factor, original = p["rope_theta"], p["factor"], p["original_max_position_embeddings"]
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # the share of the original frequency
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation


def rope_attention_factor(rope_parameters: dict) -> float:
    """What YaRN multiplies cos and sin by (its attention temperature, 0.1 ln(factor) + 1); 1 otherwise."""
    if rope_parameters.get("rope_type", rope_parameters.get("type")) != "yarn":
        return 1.0
    if rope_parameters.get("attention_factor") is not None:
        return float(rope_parameters["attention_factor"])
    factor = rope_parameters["factor"]
    mscale, mscale_all_dim = rope_parameters.get("mscale"), rope_parameters.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


class RotaryEmbedding(CustomOp):
    """Neox-style (rotate-half) rotary embedding with a cos/sin table for every position: `rotary(positions, x)`
    rotates x, (tokens, heads, head_dim), queries and keys alike (they may come as one tensor)."""

    def __init__(self, head_dim: int, max_positions: int, rope_parameters: dict) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(head_dim, rope_parameters)  # validated at construction
        self.attention_factor = rope_attention_factor(rope_parameters)
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
        self.cos = emb.cos() * self.attention_factor
        self.sin = emb.sin() * self.attention_factor

    def forward_native(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = roll(x, half) * [-sin, sin], the sign in
        the table: the same products as the reference's, in two fewer ops."""
        cos, signed_sin = self._cos_sin(positions, x.dtype)
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin

    def forward_cpu(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x rotated in place, the reference's rounding."""
        if x.stride(-1) == 1 and self.cos.dtype == torch.float32 and positions.dtype == torch.long \
                and positions.is_contiguous():
            cpu_kernels().rotary_embedding(x, positions, self.cos, self.sin)
            return x
        return self.forward_native(positions, x)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer shares this module and the step's positions: look them up once per forward."""
        cached = getattr(self, "_step_cache", None)
        key = (current_forward_id(), positions, dtype)
        if cached is None or cached[0] != key[0] or cached[1] is not positions or cached[2] != dtype:
            cos = self.cos[positions].to(dtype).unsqueeze(1)
            sin = self.sin[positions].to(dtype)
            half = sin.shape[-1] // 2
            signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1)
            self._step_cache = cached = (*key, cos, signed_sin)
        return cached[3], cached[4]


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class ActAndMul(CustomOp):
    """act(gate) * up of a [gate | up] product (rows, 2 * width) -> (rows, width): the gated MLP's activation.
    SiLU has a CPU kernel (one pass over the product)."""

    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act {hidden_act!r} is not supported (supported: "
                                        f"{', '.join(ACTIVATIONS)}).")
        self.hidden_act = hidden_act
        self.act = ACTIVATIONS[hidden_act]

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.hidden_act == "silu" and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            return cpu_kernels().silu_and_mul(gate_up)
        return self.forward_native(gate_up)

    def extra_repr(self) -> str:
        return self.hidden_act


class ClampedSwigluAndMul(CustomOp):
    """gpt-oss' activation of a [gate | up] product: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),
    g = min(gate, limit)."""

    hidden_act = "swigluoai"  # (vLLM's name for it)

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


def vocab_parallel_embed(embedding: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """Embedding rows of `ids` where each tensor-parallel rank holds a contiguous slice of the vocabulary:
    each looks up the ids in its slice (zeros elsewhere) and one all-reduce sums them. One rank: a lookup."""
    tp = tp_group()
    if tp.size == 1:
        return embedding(ids)
    rows = embedding.num_embeddings
    local = ids - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    h = embedding(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)
    return tp.all_reduce(h)
