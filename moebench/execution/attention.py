"""The fused decode-attention step of one layer: q/k/v bias, the per-head q/k RMSNorm (declared PER_HEAD), RoPE and
attention over the KV cache for one new token in one launch (two past SPLIT_POSITIONS slots, where several
threadgroups share a head's positions and a second launch joins them), instead of the five to eight graph
nodes the unfused path builds for it. On CUDA, given a counter (a compiled step's, which writes the cache in place),
the kernel joins the split threadgroups' partials itself: the last of a head's threadgroups to finish does it.

The declared variants (moebench.models.declare.AttentionSpec) are template constants of the same kernel: rotary
on the first rope_fraction of each head (partial rotary, the rest passed through), an output gate (q_proj's rows
per head its queries then its gate: the output times sigmoid(gate), inside the kernel, so the gated layer costs
no extra graph node), a sliding window (the last `window` positions), learned per-head sinks (a logit in the
softmax's denominator only) and scaled rotary (the caller's frequencies, e.g. YaRN's, and its attention factor
multiplying q and k first). Off, each compiles to the code of plain attention.

At decode every graph node costs host time (building it in Python, encoding it), and the GPU waits on
the host, so a node saved is time saved. Backends: 'metal' and 'cuda' (kernels/attn_decode.body behind
the per-backend prelude, as for the MoE kernels) and 'reference' (the same arithmetic in MLX ops, the
test oracle and the CPU path). The kernel reads the cache buffers up to the token's position and hands
the new key and value back; the caller writes them into the cache (moebench.decode.cache), or, with `write`
(a GPU backend only), the kernel stores them at the token's slot itself, in place, where the cache
allows it (moebench.decode.cache.StaticCache).

Arithmetic, shared by every backend: the bias add is rounded to the activation dtype T, as an add in T
is; the q/k norm rounds where mx.fast.rms_norm does; q and k are rotated (rotate-half, as mx.fast.rope
with traditional=False) in float32 and rounded to T, as rope's output is; scores and softmax in float32
with the scale head_dim ** -0.5; the output is rounded to T once. The variants round where the unfused ops
do: q and k times the attention factor in T; sigmoid(gate) in T, op by op as on Metal and CUDA, and the output
times it in T again.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx

from ..errors import UnsupportedKernelConfig
from ..models.declare import AttentionSpec
from .kernel import (
    GPU_BACKENDS,
    JOIN,
    LANES,
    CheckedOnce,
    Stage,
    built_kernel,
    check_backend,
    float_bits,
    run_compiled,
    signature,
)
from .support import attention_reason, rotary_dims

ATTENTION = Stage("moebench_attn_decode", "attn_decode.body",
                  ("qkv", "bias", "inv_freq", "pos", "keys", "values", "block", "q_norm", "k_norm", "eps", "sinks",
                   "counter"),
                  ("out", "k_new", "v_new", "parts"), (JOIN,))
COMBINE = Stage("moebench_attn_combine", "attn_combine.body", ("parts",), ("out",), (JOIN,))


@dataclass(frozen=True)
class QKNorm:
    """The per-head RMSNorm of q and of k before RoPE (an attention declaring PER_HEAD): weights [head_dim] in the
    activation dtype."""

    q: mx.array
    k: mx.array
    eps: float


# Warps a threadgroup's positions are split over (docs/benchmarks/attention-split-h200-2026-12-01.md).
WARPS_PER_HEAD = 8
# Threadgroups that share a key/value head's positions (its query heads' partials then joined): enough for
# THREADGROUPS in all (about two per SM of an H200, so a long context is walked by the whole GPU), but none
# with fewer than SPLIT_POSITIONS slots of the cache (each split's partials cost a write and a read).
SPLIT_POSITIONS = 128
THREADGROUPS = 256


def splits(capacity: int, kv_heads: int) -> int:
    """Threadgroups per key/value head for cache buffers of `capacity` slots (1: no partials to join)."""
    return max(1, min(-(-THREADGROUPS // kv_heads), -(-capacity // SPLIT_POSITIONS)))


def attended(heads: AttentionSpec, capacity: int) -> int:
    """The most positions one token attends to in cache buffers of `capacity` slots: a window's, or every slot."""
    return capacity if heads.window is None else min(capacity, heads.window)


def projection_width(heads: AttentionSpec) -> int:
    """Width of the stacked projection the kernel reads: q_proj's rows (twice H * head_dim with an output gate),
    then k_proj's and v_proj's."""
    return heads.width + (heads.n_heads * heads.head_dim if heads.output_gate else 0)


@functools.lru_cache(maxsize=16)
def rope_frequencies(head_dim: int, base: float) -> mx.array:
    """float32 [head_dim / 2]: base ** (-2 i / head_dim), the rotation speed of dims i and i + head_dim / 2."""
    freqs = mx.power(mx.array(base, mx.float32), -mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)
    mx.eval(freqs)
    return freqs


def _check_inputs(qkv: mx.array, bias: mx.array | None, inv_freq: mx.array, slots: mx.array, keys: mx.array,
                  values: mx.array, heads: AttentionSpec, block: int, qk_norm: QKNorm | None, sinks: mx.array | None,
                  rope_scale: float, counter: mx.array | None) -> None:
    """Shapes and dtypes the kernel assumes (a bad launch would abort the process)."""
    reason = attention_reason(heads)
    if reason:
        raise UnsupportedKernelConfig(reason)
    if heads.clip_qkv is not None:
        raise UnsupportedKernelConfig(f"q, k and v clamped at {heads.clip_qkv:g}: the kernel takes them clamped (as "
                                      "steps.AttentionKernel passes them, with clip_qkv None)")
    kv, hd, width, half = heads.n_kv_heads, heads.head_dim, projection_width(heads), rotary_dims(heads) // 2
    if qkv.shape[-1:] != (width,) or any(n != 1 for n in qkv.shape[:-1]):
        raise UnsupportedKernelConfig(f"qkv has shape {tuple(qkv.shape)}, expected one token's ({width},)")
    if bias is not None and (bias.shape != (width,) or bias.dtype != qkv.dtype):
        raise UnsupportedKernelConfig(f"qkv bias {tuple(bias.shape)} {bias.dtype}: expected ({width},) {qkv.dtype}")
    if inv_freq.shape != (half,) or inv_freq.dtype != mx.float32:
        raise UnsupportedKernelConfig(f"inv_freq {tuple(inv_freq.shape)} {inv_freq.dtype}: expected ({half},) float32 "
                                      f"(the {2 * half} rotated dims of each head)")
    _check_variants(heads, qkv.dtype, sinks, rope_scale)
    if slots.shape != (2,) or slots.dtype != mx.int32:
        raise UnsupportedKernelConfig(f"slots {tuple(slots.shape)} {slots.dtype}: expected (2,) int32 [P, CAP]")
    for name, a in (("keys", keys), ("values", values)):
        if a.ndim != 4 or a.shape[1] != kv or a.shape[3] != hd or a.dtype != qkv.dtype:
            raise UnsupportedKernelConfig(f"cached {name} {tuple(a.shape)} {a.dtype}: expected (N, {kv}, CAP, {hd}) "
                                          f"{qkv.dtype}")
    if keys.shape != values.shape or keys.size >= 2**31:
        raise UnsupportedKernelConfig(f"cached keys {tuple(keys.shape)} and values {tuple(values.shape)}: expected "
                                      "one shape under 2**31 elements")
    if not 0 <= block < keys.shape[0]:
        raise UnsupportedKernelConfig(f"cache block {block} is outside the {keys.shape[0]} blocks of the buffers")
    if qk_norm is not None:
        for name, w in (("q_norm", qk_norm.q), ("k_norm", qk_norm.k)):
            if w.shape != (hd,) or w.dtype != qkv.dtype:
                raise UnsupportedKernelConfig(f"{name} weight {tuple(w.shape)} {w.dtype}: expected ({hd},) {qkv.dtype}")
        if not math.isfinite(qk_norm.eps) or qk_norm.eps < 0:
            raise UnsupportedKernelConfig(f"q/k norm eps {qk_norm.eps}: expected a finite number >= 0")
    if counter is not None and (counter.shape != (kv,) or counter.dtype != mx.uint32):
        raise UnsupportedKernelConfig(f"counter {tuple(counter.shape)} {counter.dtype}: expected ({kv},) uint32 (one "
                                      "per key/value head, zeros)")


def _check_variants(heads: AttentionSpec, dtype: mx.Dtype, sinks: mx.array | None, rope_scale: float) -> None:
    """The sinks and the rotary attention factor, as the declaration asks for them."""
    if heads.sinks != (sinks is not None):
        raise UnsupportedKernelConfig("sinks given for an attention declaring none" if sinks is not None else
                                      "the attention declares sinks: pass them ([n_heads] logits)")
    if sinks is not None and (sinks.shape != (heads.n_heads,) or sinks.dtype != dtype):
        raise UnsupportedKernelConfig(f"sinks {tuple(sinks.shape)} {sinks.dtype}: expected ({heads.n_heads},) {dtype}")
    if isinstance(rope_scale, bool) or not isinstance(rope_scale, (int, float)) or not math.isfinite(rope_scale) \
            or rope_scale <= 0:
        raise UnsupportedKernelConfig(f"rope_scale {rope_scale!r}: expected a finite number > 0")
    if rope_scale != 1.0 and not heads.scaled_rope:
        raise UnsupportedKernelConfig(f"rope_scale {rope_scale} for an attention declaring plain rotary (scaled_rope "
                                      "False)")


_check = CheckedOnce(_check_inputs)


def check_inputs(qkv: mx.array, bias: mx.array | None, inv_freq: mx.array, slots: mx.array, keys: mx.array,
                 values: mx.array, heads: AttentionSpec, block: int, qk_norm: QKNorm | None = None,
                 sinks: mx.array | None = None, rope_scale: float = 1.0, counter: mx.array | None = None) -> None:
    """_check_inputs, once per combination of shapes and dtypes (decode repeats one)."""
    key = (*map(signature, (qkv, bias, inv_freq, slots, keys, values, sinks, counter)), heads, block,
           qk_norm is not None and (signature(qk_norm.q), signature(qk_norm.k), qk_norm.eps),
           type(rope_scale), rope_scale)
    _check(key, qkv, bias, inv_freq, slots, keys, values, heads, block, qk_norm, sinks, rope_scale, counter)


_blocks: dict[int, mx.array] = {}


def block_array(block: int) -> mx.array:
    """int32 [block], one array per value: the same layer asks for it every step."""
    if block not in _blocks:
        _blocks[block] = mx.array([block], dtype=mx.int32)
    return _blocks[block]


@functools.cache
def no_counter() -> mx.array:
    """uint32 [8] zeros, the counter input of a launch that does not fold (never written): 8 elements, so Metal
    keeps it in `device` memory, where the kernel's unused cast to a writable pointer compiles."""
    a = mx.zeros((8,), mx.uint32)
    mx.eval(a)
    return a


def new_counter(kv_heads: int) -> mx.array:
    """A counter for the folded join, uint32 [kv_heads] zeros, evaluated: the kernel writes it in place, so it must
    be a whole row-contiguous array of its own (as a StaticCache's buffers), used by one launch at a time, each
    ordered after the one before (moebench.decode.cache.StaticCache says how a compiled step's are)."""
    a = mx.zeros((kv_heads,), mx.uint32)
    mx.eval(a)
    return a


@functools.lru_cache(maxsize=8)
def eps_array(eps: float) -> mx.array:
    """float32 [1] holding a norm's epsilon: the kernel takes it as an input (templates take no floats)."""
    a = mx.array([eps], mx.float32)
    mx.eval(a)
    return a


def gpu_decode_attention(backend: str, qkv: mx.array, bias: mx.array | None, inv_freq: mx.array, slots: mx.array,
                         keys: mx.array, values: mx.array, heads: AttentionSpec, block: int = 0, write: bool = False,
                         qk_norm: QKNorm | None = None, sinks: mx.array | None = None, rope_scale: float = 1.0,
                         counter: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """The kernel on `backend` (see decode_attention), with `splits` threadgroups a key/value head for the
    positions it attends to and, past one, their partials (with an output gate, each head's sigmoid(gate) follows
    them) joined by a second launch, or on CUDA with `counter` by the kernel itself (FOLD)."""
    h, kv, hd = heads.n_heads, heads.n_kv_heads, heads.head_dim
    lead = tuple(qkv.shape[:-1])
    s = splits(attended(heads, keys.shape[2]), kv)
    fold = backend == "cuda" and s > 1 and counter is not None
    norms = (qk_norm.q, qk_norm.k, eps_array(qk_norm.eps)) if qk_norm is not None else (qkv, qkv, inv_freq)
    parts = h * s * (hd + 2) + (h * hd if heads.output_gate else 0)
    out, k_new, v_new, partials = built_kernel(backend, ATTENTION)(
        inputs=[qkv, bias if bias is not None else qkv, inv_freq, slots, keys, values, block_array(block), *norms,
                sinks if sinks is not None else qkv, counter if fold else no_counter()],
        template=[("T", qkv.dtype), ("H", h), ("KV", kv), ("HD", hd), ("BIAS", bias is not None),
                  ("QKNORM", qk_norm is not None), ("ROPE_DIMS", rotary_dims(heads)),
                  ("FACTOR", float_bits(rope_scale) if rope_scale != 1.0 else 0), ("GATE", heads.output_gate),
                  ("WINDOW", heads.window or 0), ("SINKS", sinks is not None), ("W", WARPS_PER_HEAD), ("S", s),
                  ("WRITE", write), ("FOLD", fold)],
        grid=(LANES, kv * s * WARPS_PER_HEAD, 1), threadgroup=(LANES, WARPS_PER_HEAD, 1),
        output_shapes=[(*lead, h * hd) if s == 1 or fold else (1,), (1, kv, 1, hd), (1, kv, 1, hd),
                       (parts,) if s > 1 else (1,)],
        output_dtypes=[qkv.dtype, qkv.dtype, qkv.dtype, mx.float32],
    )
    if s > 1 and not fold:
        out = built_kernel(backend, COMBINE)(
            inputs=[partials], template=[("T", qkv.dtype), ("H", h), ("HD", hd), ("S", s), ("GATE", heads.output_gate)],
            grid=(LANES, h, 1), threadgroup=(LANES, 1, 1), output_shapes=[(*lead, h * hd)],
            output_dtypes=[qkv.dtype])[0]
    return out, k_new, v_new


def _rotate(x: mx.array, cos: mx.array, sin: mx.array, dtype: mx.Dtype) -> mx.array:
    """Rotate-half RoPE of the first 2 * len(cos) dims of float32 rows [..., hd] (the rest passed through), rounded
    to `dtype` and back to float32."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    rotated = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(dtype).astype(mx.float32)
    return mx.concatenate([rotated, rest], axis=-1) if rest.shape[-1] else rotated


def _split_projection(x: mx.array, heads: AttentionSpec) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
    """The stacked projection [width] -> q [KV, group, hd], k [KV, 1, hd], v [KV * hd] and, with an output gate,
    the gate rows [H, hd] (q_proj's rows per head: its queries, then its gate)."""
    h, kv, hd = heads.n_heads, heads.n_kv_heads, heads.head_dim
    rows = 2 * h if heads.output_gate else h
    q, gate = x[: rows * hd], None
    if heads.output_gate:
        q, gate = (a.reshape(h, hd) for a in mx.split(q.reshape(h, 2, hd), 2, axis=1))
    k, v = x[rows * hd : (rows + kv) * hd].reshape(kv, 1, hd), x[(rows + kv) * hd :]
    return q.reshape(kv, h // kv, hd), k, v, gate


def reference_decode_attention(qkv: mx.array, bias: mx.array | None, inv_freq: mx.array, slots: mx.array,
                               keys: mx.array, values: mx.array, heads: AttentionSpec, block: int = 0,
                               qk_norm: QKNorm | None = None, sinks: mx.array | None = None,
                               rope_scale: float = 1.0) -> tuple[mx.array, mx.array, mx.array]:
    """The kernel's arithmetic with MLX ops (the q/k norm as mx.fast.rms_norm, the gate as mx.sigmoid, which the
    model runs); the position may be a traced array (a compiled step), so the cache is masked outside the
    positions attended to rather than sliced."""
    h, kv, hd = heads.n_heads, heads.n_kv_heads, heads.head_dim
    dtype, lead = qkv.dtype, tuple(qkv.shape[:-1])
    x = qkv.reshape(-1)
    if bias is not None:
        x = x + bias
    q, k, v, gate = _split_projection(x, heads)
    if qk_norm is not None:
        q, k = mx.fast.rms_norm(q, qk_norm.q, qk_norm.eps), mx.fast.rms_norm(k, qk_norm.k, qk_norm.eps)
    if rope_scale != 1.0:  # the attention factor, in the activation dtype as the model multiplies
        q, k = q * rope_scale, k * rope_scale
    theta = slots[0].astype(mx.float32) * inv_freq
    cos, sin = mx.cos(theta), mx.sin(theta)
    q = _rotate(q.astype(mx.float32), cos, sin, dtype) * (hd**-0.5)
    k = _rotate(k.astype(mx.float32), cos, sin, dtype)
    v = v.astype(mx.float32).reshape(kv, 1, hd)
    slot = mx.arange(keys.shape[2], dtype=mx.int32)
    past = slot < slots[0]
    if heads.window is not None:  # with the new token, the last `window` positions
        past = past & (slot > slots[0] - heads.window)
    cached_k = keys[block].astype(mx.float32)  # [KV, CAP, HD]
    cached_v = mx.where(past[:, None], values[block].astype(mx.float32), 0.0)  # unwritten slots never reach the sum
    scores = mx.where(past, q @ cached_k.transpose(0, 2, 1), -mx.inf)  # [KV, group, CAP]
    columns = [scores, (q * k).sum(axis=-1, keepdims=True)]
    if sinks is not None:  # a logit with no value: in the denominator only
        columns.append(sinks.astype(mx.float32).reshape(kv, h // kv, 1))
    probs = mx.softmax(mx.concatenate(columns, axis=-1), axis=-1, precise=True)
    cap = keys.shape[2]
    out = (probs[..., :cap] @ cached_v + probs[..., cap : cap + 1] * v).reshape(h, hd).astype(dtype)
    if gate is not None:
        out = out * mx.sigmoid(gate)
    new = (a.reshape(1, kv, 1, hd).astype(dtype) for a in (k, v))
    return (out.reshape(*lead, h * hd), *new)


def decode_attention(backend: str, qkv: mx.array, bias: mx.array | None, inv_freq: mx.array, slots: mx.array,
                     keys: mx.array, values: mx.array, heads: AttentionSpec, block: int = 0, write: bool = False,
                     qk_norm: QKNorm | None = None, sinks: mx.array | None = None, rope_scale: float = 1.0,
                     counter: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """One new token's attention on `backend`: (output [..., H * HD] in qkv's dtype, its rotated key and its
    value [1, KV, 1, HD] for the cache).

    qkv [..., width] is the stacked projection without its bias (leading axes all 1, kept in the output; width
    projection_width(heads): q_proj's rows as the model stores them, per head its queries then its gate with an
    output gate, then k's and v's); bias the stacked bias or None; inv_freq [rotary_dims / 2] from
    rope_frequencies (or a scaled rotary's own); slots int32 [P, CAP]: the token's
    position P and the slots CAP of the cache buffers keys / values [N, KV, CAP, HD], whose block `block`
    holds this layer's cache: its first P slots the earlier tokens' rotated keys and values (one pair of
    buffers can hold every layer's cache, moebench.decode.cache.StaticCache). With `write` the GPU kernel also
    stores the key and value at slot P of that block, in place: MLX does not see the buffers change, so
    only a cache that orders every reader of the slot after this step may ask (a compiled step's static cache,
    moebench.decode.cache.StaticCache), and its buffers must be whole row-contiguous arrays (MLX hands a
    kernel a copy of any other input, and the write would land in the copy): a StaticCache's are (zeros,
    then its updates' outputs). `qk_norm`: normalise each head of q and k first. `sinks` [H] in qkv's dtype:
    the heads' sink logits, where `heads` declares sinks; `rope_scale`: the attention factor multiplying q and k
    before the rotation, where `heads` declares scaled rotary. `counter` (new_counter, uint32 [KV] zeros): on CUDA
    the kernel joins its split threadgroups' partials itself, with no second launch, and leaves the counter zeros
    again. The kernel writes it in place, so only a caller that orders its launches as `write` asks (a compiled
    step's) may pass it; the other backends ignore it (their arithmetic is the same).
    """
    check_backend(backend)
    check_inputs(qkv, bias, inv_freq, slots, keys, values, heads, block, qk_norm, sinks, rope_scale, counter)
    if backend in GPU_BACKENDS:
        return gpu_decode_attention(backend, qkv, bias, inv_freq, slots, keys, values, heads, block, write, qk_norm,
                                    sinks, rope_scale, counter)
    if write:
        raise UnsupportedKernelConfig("the reference attention returns new arrays: it cannot write the cache in place")
    norm = None if qk_norm is None else (qk_norm.q, qk_norm.k)
    return run_compiled(_traced_reference, (heads, block, None if qk_norm is None else qk_norm.eps, rope_scale), qkv,
                        bias, inv_freq, slots, keys, values, norm, sinks)


def _traced_reference(qkv: mx.array, bias: mx.array | None, inv_freq: mx.array, slots: mx.array, keys: mx.array,
                      values: mx.array, norm: tuple | None, sinks: mx.array | None, heads: AttentionSpec, block: int,
                      eps: float | None, rope_scale: float) -> tuple[mx.array, mx.array, mx.array]:
    """reference_decode_attention with the q/k norm given as its weights and eps (run_compiled takes arrays)."""
    qk_norm = None if norm is None else QKNorm(*norm, eps)
    return reference_decode_attention(qkv, bias, inv_freq, slots, keys, values, heads, block, qk_norm, sinks,
                                      rope_scale)
