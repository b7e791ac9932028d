"""Rotary position embeddings: default, linear, llama3 and yarn scaling.

The frequency tables are computed with the same operations, in the same
order and dtype, as mlx-lm's ``rope_utils`` so logits match it to the bit.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kvstore.errors import CapabilityError

__all__ = ["SUPPORTED_ROPE_TYPES", "FreqsRoPE", "initialize_rope", "llama3_freqs", "yarn_freqs"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class FreqsRoPE(nn.Module):
    """RoPE over a precomputed frequency table, with an optional input scale (yarn mscale)."""

    def __init__(
        self, dims: int, freqs: mx.array, traditional: bool = False, mscale: float = 1.0
    ) -> None:
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.mscale = mscale
        self._freqs = freqs

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        if self.mscale != 1.0:
            x = x.at[..., : self.dims].multiply(self.mscale)
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._freqs,
        )


def llama3_freqs(dims: int, base: float, scaling: dict[str, Any]) -> mx.array:
    """Llama 3.1 frequencies: long wavelengths stretched by ``factor``, a smooth ramp between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling.get("original_max_position_embeddings", 8192)

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    freqs = base ** (mx.arange(0, dims, 2) / dims)
    wavelens = 2 * mx.pi * freqs

    freqs = mx.where(wavelens > low_freq_wavelen, freqs * factor, freqs)
    is_medium_freq = (wavelens > high_freq_wavelen) & (wavelens < low_freq_wavelen)
    smooth_factors = (old_context_len / wavelens - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smooth_freqs = freqs / ((1 - smooth_factors) / factor + smooth_factors)
    return mx.where(is_medium_freq, smooth_freqs, freqs)


def yarn_freqs(dims: int, base: float, scaling: dict[str, Any]) -> tuple[mx.array, float]:
    """YaRN frequency table and input mscale (the ratio mlx-lm puts on the rope)."""
    factor = scaling["factor"]
    original = scaling.get("original_max_position_embeddings", 4096)
    beta_fast = scaling.get("beta_fast", 32)
    beta_slow = scaling.get("beta_slow", 1)
    mscale = scaling.get("mscale", 1)
    mscale_all_dim = scaling.get("mscale_all_dim", 0)

    def correction_dim(num_rotations: float) -> float:
        return (dims * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    def get_mscale(scale: float, m: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    low = float(max(math.floor(correction_dim(beta_fast)), 0))
    high = float(min(math.ceil(correction_dim(beta_slow)), dims - 1))
    if low == high:
        high += 0.001  # prevent a singular ramp
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    freq_mask = 1.0 - ramp
    freq_extra = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    freq_inter = factor * freq_extra
    freqs = (freq_inter * freq_extra) / (freq_inter * freq_mask + freq_extra * (1 - freq_mask))
    return freqs, get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)


def initialize_rope(
    dims: int, base: float, traditional: bool, scaling: dict[str, Any] | None = None
) -> nn.Module:
    """The rope module for ``scaling`` (an HF ``rope_scaling`` dict, or ``None``).

    Raises:
        CapabilityError: the rope type is not one of :data:`SUPPORTED_ROPE_TYPES`.
    """
    rope_type = "default"
    if scaling is not None:
        rope_type = scaling.get("type") or scaling.get("rope_type", "default")
    if rope_type in ("default", "linear"):
        scale = 1 / scaling["factor"] if rope_type == "linear" and scaling else 1.0
        return nn.RoPE(dims, traditional=traditional, base=base, scale=scale)
    if rope_type == "llama3":
        return FreqsRoPE(dims, llama3_freqs(dims, base, scaling or {}), traditional)
    if rope_type == "yarn":
        freqs, mscale = yarn_freqs(dims, base, scaling or {})
        return FreqsRoPE(dims, freqs, traditional, mscale)
    raise CapabilityError(
        f"[rope] rope type {rope_type!r} is not supported; supported: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}.",
        found=rope_type,
        supported=list(SUPPORTED_ROPE_TYPES),
    )
