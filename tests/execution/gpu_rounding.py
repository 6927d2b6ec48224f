"""MLX's ops as they round on Metal and CUDA, computed on the CPU, for kernels checked against a reference that runs
on the CPU (the Metal twin through kernels/metal_cpu_shim.h, the CUDA kernels against the CPU reference): the
kernels round as the ops do on the GPU they run on, and where MLX's CPU rounds otherwise the reference must too."""

from __future__ import annotations

import mlx.core as mx
import pytest

from moebench.execution.attention import reference_decode_attention


def gpu_sigmoid(x: mx.array) -> mx.array:
    """mx.sigmoid as MLX computes it on Metal and CUDA: in x's dtype, exp(|x|), 1 + it, the quotient and 1 - it each
    rounded to it (MLX's CPU rounds only the exp and the result, so in bfloat16 its sigmoid parts from theirs by a
    unit of the last place in about one value in ten)."""
    y = 1 / (1 + mx.exp(mx.abs(x)))
    return mx.where(x < 0, y, 1 - y)


def gpu_rounded_attention(*args, **variants) -> tuple[mx.array, mx.array, mx.array]:
    """reference_decode_attention(*args, **variants) as it rounds on Metal and CUDA: the output gate's mx.sigmoid
    through gpu_sigmoid (the one op of it whose rounding MLX's CPU and GPUs differ on), on the default stream."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mx, "sigmoid", gpu_sigmoid)
        return reference_decode_attention(*args, **variants)
