"""The float64 truth every comparison is measured against: quantized weights unpacked by numpy
(independently of MLX), scales and biases upcast before the affine map, every product accumulated in
float64. compare, selfcheck and the tests use it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..errors import UnsupportedKernelConfig
from ..models.args import QuantizedParts


def f64(a: mx.array) -> np.ndarray:
    """An MLX array in float64 (through float32: numpy has no bfloat16; every 16- and 32-bit value is exact)."""
    return np.array(a.astype(mx.float32)).astype(np.float64)


def unpack(weight: np.ndarray, bits: int) -> np.ndarray:
    """Packed uint32 words [..., packed] -> integer levels [..., packed * 32 / bits] (LSB-first bitstream):
    value i is the `bits` bits from bit i * bits on, read from the 64-bit window of its word and the next."""
    words = np.ascontiguousarray(weight, dtype="<u4").astype(np.uint64)
    words = np.concatenate([words, np.zeros((*words.shape[:-1], 1), np.uint64)], axis=-1)  # the last window
    start = np.arange(weight.shape[-1] * 32 // bits, dtype=np.int64) * bits
    first, shift = start // 32, (start % 32).astype(np.uint64)
    window = words[..., first] | (words[..., first + 1] << np.uint64(32))
    return ((window >> shift) & np.uint64((1 << bits) - 1)).astype(np.int64)


def dequantize_f64(parts: QuantizedParts, ids: np.ndarray | list[int] | None = None) -> np.ndarray:
    """The selected experts' matrices [K, out, in] (or, without ids, the one matrix or stack) in float64 from
    the packed weights; scales and biases upcast (from whatever float they are stored in) first."""
    if parts.mode != "affine" or parts.biases is None:
        raise UnsupportedKernelConfig(f"the float64 truth handles affine quantization with biases, not {parts.mode}")
    take = (lambda a: a[mx.array(np.asarray(ids, dtype=np.int64))]) if ids is not None else (lambda a: a)
    levels = unpack(np.array(take(parts.weight)), parts.bits)
    gs = parts.group_size
    return levels * np.repeat(f64(take(parts.scales)), gs, axis=-1) + np.repeat(f64(take(parts.biases)), gs, axis=-1)


def swiglu_f64(gate: np.ndarray, up: np.ndarray, down: np.ndarray, x: np.ndarray) -> np.ndarray:
    """down (silu(gate x) * up x) in float64, for one matrix [out, in] or a stack [K, out, in] of each."""
    g, u = gate @ x, up @ x
    return (down @ (g / (1.0 + np.exp(-g)) * u)[..., None])[..., 0]


def expert_outputs(parts: list[QuantizedParts], x: np.ndarray, ids: np.ndarray | list[int] | None = None
                   ) -> np.ndarray:
    """Unweighted SwiGLU outputs of gate/up/down `parts` on one token x [D]: [K, D] for experts `ids` of a
    stack, or [D] for a single expert (the shared expert)."""
    if any(p is None for p in parts):
        raise UnsupportedKernelConfig("float weights: the fused kernels need quantized weights")
    return swiglu_f64(*(dequantize_f64(p, ids) for p in parts), x.astype(np.float64))


def nrms(a: np.ndarray, ref: np.ndarray) -> float:
    """RMS of (a - ref) over RMS of ref."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    denom = np.sqrt(np.mean(ref**2))
    return float(np.sqrt(np.mean((a - ref) ** 2)) / denom) if denom else float(np.sqrt(np.mean(a**2)))


def nmax(a: np.ndarray, ref: np.ndarray) -> float:
    """Largest |a - ref| over the largest |ref|."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(a - ref)) / max(np.max(np.abs(ref)), 1e-30))
