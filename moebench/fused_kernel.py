"""The fused single-token decode-MoE arithmetic: per-expert SwiGLU outputs for the top-k experts.

Backends: 'reference' (MLX ops on any device, the test oracle), 'metal' and 'cuda' (JIT kernels
built from kernels/). All share one arithmetic: dequantize in float32 with float32 scales and biases,
accumulate in float32, SwiGLU in float32, float32 per-expert outputs [K, D]; `combine` weights them
by the router scores and sums over K in float32.
"""

from __future__ import annotations

import mlx.core as mx

from .quant import QuantizedParts


def _dequantized_rows(p: QuantizedParts, indices: mx.array) -> mx.array:
    """The selected experts' matrices [K, out, in] in float32 (scales and biases upcast first)."""
    return mx.dequantize(
        p.weight[indices], p.scales[indices].astype(mx.float32), p.biases[indices].astype(mx.float32),
        group_size=p.group_size, bits=p.bits,
    ).astype(mx.float32)


def reference_expert_outputs(
    x: mx.array, indices: mx.array, gate: QuantizedParts, up: QuantizedParts, down: QuantizedParts
) -> mx.array:
    """x [D], indices [K] -> unweighted expert outputs [K, D] in float32, with MLX ops."""
    xf = x.astype(mx.float32)
    g = _dequantized_rows(gate, indices) @ xf
    u = _dequantized_rows(up, indices) @ xf
    act = g / (1.0 + mx.exp(-g)) * u
    return (_dequantized_rows(down, indices) @ act[..., None]).squeeze(-1)


def expert_outputs(
    backend: str, x: mx.array, indices: mx.array, gate: QuantizedParts, up: QuantizedParts, down: QuantizedParts
) -> mx.array:
    if backend == "reference":
        return reference_expert_outputs(x, indices, gate, up, down)
    raise NotImplementedError(backend)


def combine(expert_out: mx.array, scores: mx.array) -> mx.array:
    """Weighted sum over K of float32 expert outputs [K, D] with scores [K], in float32."""
    return (expert_out * scores.astype(mx.float32)[:, None]).sum(axis=0)
