"""4-bit values in bytes and in int32 words, the layouts checkpoints store them in."""
from __future__ import annotations

import torch

_NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
# E2M1 (FP4) codes 0..15: sign bit 3, two exponent bits, one mantissa bit (OCP MX and NVFP4 alike).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_int32_nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding eight 4-bit values each (value j in bits 4j..4j+3) -> uint8 values, `dim` 8x longer:
    word i's value j lands at index 8i + j."""
    dim = dim % words.dim()
    w = words.movedim(dim, -1)
    values = (w.unsqueeze(-1) >> _NIBBLE_SHIFTS.to(w.device)) & 0xF
    return values.reshape(*w.shape[:-1], w.shape[-1] * 8).to(torch.uint8).movedim(-1, dim)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 values < 16, (..., 2k) -> (..., k) bytes, the even index in the low nibble."""
    v = values.to(torch.uint8)
    return (v[..., 0::2] | (v[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(..., k) bytes -> (..., 2k) uint8 values, the low nibble first."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def fp4_e2m1_pairs(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(256, 2): the two E2M1 values of each byte, the low nibble's first (one gather per byte, not per value)."""
    values = torch.tensor(FP4_E2M1_VALUES, dtype=dtype, device=device)
    return torch.stack((values.repeat(16), values.repeat_interleave(16)), dim=1)
