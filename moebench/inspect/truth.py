"""The float64 truth every comparison is measured against: quantized weights unpacked by numpy
(independently of MLX), scales and biases upcast before the affine map (or, in the microscaled modes
mxfp4, nvfp4 and mxfp8, codes and scales decoded from their formats' definitions), every product
accumulated in float64; the declared variants (expert biases, the clamped SwiGLU) from their definitions
too; and a decode-attention step and a Gated DeltaNet decode step from their definitions. compare, selfcheck
and the tests use it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..errors import UnsupportedKernelConfig
from ..execution.attention import QKNorm
from ..execution.linear_attention import GatedDeltaWeights
from ..execution.moe import ExpertVariant
from ..models.args import QuantizedParts
from ..models.declare import AttentionSpec, LinearAttentionSpec
from ..models.gated_delta import L2_EPS


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


def minifloat(codes: np.ndarray, exponent_bits: int, mantissa_bits: int, finite: bool = False) -> np.ndarray:
    """Sign / exponent / mantissa codes (bias 2^(exponent_bits - 1) - 1, subnormals at exponent 0) in float64.
    `finite`: the OCP "FN" rule of e4m3, all bits but the sign set is NaN and there are no infinities."""
    codes = np.asarray(codes, np.int64)
    bias = 2 ** (exponent_bits - 1) - 1
    exponent = (codes >> mantissa_bits) & (2**exponent_bits - 1)
    mantissa = codes & (2**mantissa_bits - 1)
    fraction = mantissa / 2.0**mantissa_bits
    magnitude = np.where(exponent == 0, fraction * 2.0 ** (1 - bias), (1 + fraction) * 2.0 ** (exponent - bias))
    if finite:
        magnitude = np.where((codes & (2 ** (exponent_bits + mantissa_bits) - 1)) ==
                             2 ** (exponent_bits + mantissa_bits) - 1, np.nan, magnitude)
    return np.where(codes >> (exponent_bits + mantissa_bits) & 1, -magnitude, magnitude)


def e8m0(codes: np.ndarray) -> np.ndarray:
    """Power-of-two scales 2^(s - 127) in float64; 255 is infinity, as MLX reads it (float32 overflows there)."""
    codes = np.asarray(codes, np.int64)
    return np.where(codes == 255, np.inf, np.ldexp(1.0, codes - 127))


# Per microscaled mode: its codes in float64 (from the packed levels), its scales in float64 (from the uint8s).
MICROSCALED = {
    "mxfp4": (lambda q: minifloat(q, 2, 1), e8m0),
    "nvfp4": (lambda q: minifloat(q, 2, 1), lambda s: minifloat(s, 4, 3, finite=True)),
    "mxfp8": (lambda q: minifloat(q, 4, 3, finite=True), e8m0),
}


def dequantize_f64(parts: QuantizedParts, ids: np.ndarray | list[int] | None = None) -> np.ndarray:
    """The selected experts' matrices [K, out, in] (or, without ids, the one matrix or stack) in float64 from
    the packed weights: affine scales and biases upcast (from whatever float they are stored in) first; the
    microscaled modes' codes and uint8 scales decoded by their formats."""
    take = (lambda a: a[mx.array(np.asarray(ids, dtype=np.int64))]) if ids is not None else (lambda a: a)
    levels = unpack(np.array(take(parts.weight)), parts.bits)
    gs = parts.group_size
    if parts.mode in MICROSCALED and parts.biases is None:
        values, scales = MICROSCALED[parts.mode]
        return values(levels) * np.repeat(scales(np.array(take(parts.scales))), gs, axis=-1)
    if parts.mode != "affine" or parts.biases is None:
        raise UnsupportedKernelConfig(f"the float64 truth handles affine quantization with biases and "
                                      f"{', '.join(MICROSCALED)} without, not {parts.mode} "
                                      f"{'without' if parts.biases is None else 'with'} biases")
    return levels * np.repeat(f64(take(parts.scales)), gs, axis=-1) + np.repeat(f64(take(parts.biases)), gs, axis=-1)


def activation_f64(g: np.ndarray, u: np.ndarray, clamp: tuple[float, float] | None = None) -> np.ndarray:
    """silu(g) * u in float64, or with `clamp` (limit, alpha) gpt-oss's clamped SwiGLU: g' = min(g, limit),
    (clip(u, -limit, limit) + 1) * g' * sigmoid(alpha * g')."""
    if clamp is None:
        return g / (1.0 + np.exp(-g)) * u
    limit, alpha = clamp
    g = np.minimum(g, limit)
    return (np.clip(u, -limit, limit) + 1.0) * g / (1.0 + np.exp(-alpha * g))


def swiglu_f64(gate: np.ndarray, up: np.ndarray, down: np.ndarray, x: np.ndarray,
               biases: list[np.ndarray] | None = None, clamp: tuple[float, float] | None = None) -> np.ndarray:
    """down (act(gate x, up x)) in float64, for one matrix [out, in] or a stack [K, out, in] of each; `biases`
    (gate, up, down: [out] or [K, out]) added to each projection, `clamp` the clamped SwiGLU's (limit, alpha)."""
    g, u = gate @ x, up @ x
    if biases is not None:
        g, u = g + biases[0], u + biases[1]
    y = (down @ activation_f64(g, u, clamp)[..., None])[..., 0]
    return y if biases is None else y + biases[2]


def expert_outputs(parts: list[QuantizedParts], x: np.ndarray, ids: np.ndarray | list[int] | None = None,
                   variant: ExpertVariant | None = None) -> np.ndarray:
    """Unweighted outputs of gate/up/down `parts` on one token x [D]: [K, D] for experts `ids` of a stack, or
    [D] for a single expert (the shared expert); SwiGLU without biases, or what `variant` declares (the
    experts' biases [E, out], upcast from their stored dtype, and the clamped SwiGLU)."""
    if any(p is None for p in parts):
        raise UnsupportedKernelConfig("float weights: the fused kernels need quantized weights")
    biases, clamp = None, None
    if variant is not None:
        clamp = variant.clamp
        if variant.biases is not None:
            pick = (lambda b: b[np.asarray(ids, dtype=np.int64)]) if ids is not None else (lambda b: b)
            biases = [pick(f64(b)) for b in variant.biases]
    return swiglu_f64(*(dequantize_f64(p, ids) for p in parts), x.astype(np.float64), biases, clamp)


def gated_delta_f64(qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv_state: mx.array, state: mx.array,
                    weights: GatedDeltaWeights, spec: LinearAttentionSpec) -> tuple[np.ndarray, ...]:
    """One token of a Gated DeltaNet layer from its definition (the arguments as
    moebench.execution.linear_attention.gated_delta_step's), every step in float64: (the output before out_proj
    [Hv * Dv], the new conv state [kernel - 1, C], the new delta state [Hv, Dv, Dk])."""
    hk, hv, dk, dv = spec.num_key_heads, spec.num_value_heads, spec.key_head_dim, spec.value_head_dim
    window = np.concatenate([f64(conv_state)[0], f64(qkv).reshape(1, -1)])  # [kernel, C]
    x = (window * f64(weights.conv)[..., 0].T).sum(axis=0)
    x = x / (1 + np.exp(-x))  # SiLU
    q, k, v = x[: hk * dk].reshape(hk, dk), x[hk * dk : 2 * hk * dk].reshape(hk, dk), x[2 * hk * dk :].reshape(hv, dv)
    q = q / np.sqrt((q**2).sum(-1, keepdims=True) + L2_EPS) / np.sqrt(dk)
    k = k / np.sqrt((k**2).sum(-1, keepdims=True) + L2_EPS)
    q, k = np.repeat(q, hv // hk, axis=0), np.repeat(k, hv // hk, axis=0)  # a key head serves hv / hk value heads
    softplus = np.logaddexp(0.0, f64(a).reshape(hv) + f64(weights.dt_bias))
    g = np.exp(-np.exp(f64(weights.a_log)) * softplus)
    beta = 1 / (1 + np.exp(-f64(b).reshape(hv)))
    s = f64(state)[0] * g[:, None, None]
    s = s + (beta[:, None] * (v - np.einsum("hvk,hk->hv", s, k)))[..., None] * k[:, None, :]
    o = np.einsum("hvk,hk->hv", s, q)
    normed = o / np.sqrt((o**2).mean(-1, keepdims=True) + weights.eps) * f64(weights.norm)
    gate = f64(z).reshape(hv, dv)
    return (gate / (1 + np.exp(-gate)) * normed).reshape(-1), window[1:], s


def attention_f64(qkv: mx.array, bias: mx.array | None, inv_freq: mx.array, slots: mx.array, keys: mx.array,
                  values: mx.array, heads: AttentionSpec, block: int = 0, qk_norm: QKNorm | None = None,
                  sinks: mx.array | None = None, rope_scale: float = 1.0) -> np.ndarray:
    """One token's decode attention from its definition (the arguments as
    moebench.execution.attention.decode_attention's), every step in float64 so that none of the kernel's or the
    reference's roundings (the activation dtype's, float32's) is in it: the output [H * HD]. The stacked projection
    plus its bias; each head of q and k RMS-normalised with `qk_norm`; q and k times `rope_scale`, then rotated
    (rotate-half) on their first rotary dims at `inv_freq` (the rest passed through); the new token attends to itself
    and the cached positions before it in block `block` (only the last `window` positions with one); `sinks` in the
    softmax's denominators; with an output gate, each head's output times sigmoid of its gate rows."""
    h, kv, hd = heads.n_heads, heads.n_kv_heads, heads.head_dim
    p, rows, freqs = int(slots[0].item()), 2 * h if heads.output_gate else h, f64(inv_freq)
    x = f64(qkv).reshape(-1) + (f64(bias) if bias is not None else 0.0)
    queries = x[: rows * hd].reshape(h, -1, hd)  # per head its queries, then its gate rows
    q, k, v = queries[:, 0], x[rows * hd : (rows + kv) * hd].reshape(kv, hd), x[(rows + kv) * hd :].reshape(kv, hd)
    if qk_norm is not None:
        q, k = (a / np.sqrt((a * a).mean(axis=-1, keepdims=True) + qk_norm.eps) * f64(w)
                for a, w in ((q, qk_norm.q), (k, qk_norm.k)))
    cos, sin, half = np.cos(p * freqs), np.sin(p * freqs), freqs.size

    def rotate(a: np.ndarray) -> np.ndarray:
        a = a * rope_scale
        a1, a2 = a[..., :half], a[..., half : 2 * half]
        return np.concatenate([a1 * cos - a2 * sin, a2 * cos + a1 * sin, a[..., 2 * half :]], axis=-1)

    q, k = rotate(q), rotate(k)
    oldest = 0 if heads.window is None else max(0, p + 1 - heads.window)
    ks = np.concatenate([f64(keys[block, :, oldest:p]), k[:, None]], axis=1)  # [KV, attended, HD]
    vs = np.concatenate([f64(values[block, :, oldest:p]), v[:, None]], axis=1)
    group, sink = h // kv, None if sinks is None else f64(sinks)
    out = np.empty((h, hd))
    for i in range(h):
        scores = ks[i // group] @ q[i] / np.sqrt(hd)
        top = scores.max() if sink is None else max(scores.max(), sink[i])
        w = np.exp(scores - top)
        out[i] = w @ vs[i // group] / (w.sum() + (0.0 if sink is None else np.exp(sink[i] - top)))
    if heads.output_gate:
        out = out / (1 + np.exp(-queries[:, 1]))
    return out.reshape(-1)


def nrms(a: np.ndarray, ref: np.ndarray) -> float:
    """RMS of (a - ref) over RMS of ref."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    denom = np.sqrt(np.mean(ref**2))
    return float(np.sqrt(np.mean((a - ref) ** 2)) / denom) if denom else float(np.sqrt(np.mean(a**2)))


def nmax(a: np.ndarray, ref: np.ndarray) -> float:
    """Largest |a - ref| over the largest |ref|."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(a - ref)) / max(np.max(np.abs(ref)), 1e-30))
