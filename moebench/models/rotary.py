"""Rotary scaled beyond plain RoPE: YaRN's frequencies and attention factor, as transformers computes them
(gpt-oss rotates whole heads with it, DeepSeek-V3 its decoupled rotary dims)."""

from __future__ import annotations

import math

import mlx.core as mx

from .args import YarnScaling


def yarn(head_dim: int, theta: float, scaling: YarnScaling) -> tuple[mx.array, float]:
    """YaRN's inverse frequencies [head_dim / 2] and attention factor, as transformers computes them: each
    frequency between theta's and theta's divided by `factor`, blended by a ramp over the dimensions whose
    wavelength lies between `beta_fast` and `beta_slow` rotations of the original context."""

    def correction_dim(rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(head_dim // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolated = 1.0 / theta ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)
    interpolated = extrapolated / scaling.factor
    inv_freq = interpolated * ramp + extrapolated * (1 - ramp)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = scaling.attention_factor
    if factor is None:
        factor = mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim) \
            if scaling.mscale and scaling.mscale_all_dim else mscale(scaling.factor)
    return inv_freq, factor
