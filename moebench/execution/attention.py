"""The fused decode-attention step of one layer: q/k/v bias, the per-head q/k RMSNorm (declared PER_HEAD), RoPE and
attention over the KV cache for one new token in one launch (two past SPLIT_POSITIONS slots, where several
threadgroups share a head's positions and a second launch joins them), instead of the five to eight graph
nodes the unfused path builds for it.

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
with the scale head_dim ** -0.5; the output is rounded to T once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx

from ..errors import UnsupportedKernelConfig
from ..models.declare import AttentionSpec
from .kernel import GPU_BACKENDS, LANES, CheckedOnce, Stage, built_kernel, check_backend, run_compiled
from .support import attention_reason

ATTENTION = Stage("moebench_attn_decode", "attn_decode.body",
                  ("qkv", "bias", "inv_freq", "pos", "keys", "values", "block", "q_norm", "k_norm", "eps"),
                  ("out", "k_new", "v_new"))
COMBINE = Stage("moebench_attn_combine", "attn_combine.body", ("parts",), ("out",))


@dataclass(frozen=True)
class QKNorm:
    """The per-head RMSNorm of q and of k before RoPE (an attention declaring PER_HEAD): weights [head_dim] in the
    activation dtype."""

    q: mx.array
    k: mx.array
    eps: float


# Warps a query head's positions are split over within a threadgroup
# (docs/benchmarks/attention-split-h200-2026-12-01.md).
WARPS_PER_HEAD = 8
# Threadgroups that share a head's positions: one per SPLIT_POSITIONS slots of the cache, at most
# MAX_SPLITS (a long context is walked by many threadgroups at once, then their partials are joined).
SPLIT_POSITIONS = 512
MAX_SPLITS = 32


def splits(capacity: int) -> int:
    """Threadgroups per query head for cache buffers of `capacity` slots (1: no partials to join)."""
    return max(1, min(MAX_SPLITS, -(-capacity // SPLIT_POSITIONS)))


@functools.lru_cache(maxsize=16)
def rope_frequencies(head_dim: int, base: float) -> mx.array:
    """float32 [head_dim / 2]: base ** (-2 i / head_dim), the rotation speed of dims i and i + head_dim / 2."""
    freqs = mx.power(mx.array(base, mx.float32), -mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)
    mx.eval(freqs)
    return freqs


def _check_inputs(qkv: mx.array, bias: mx.array | None, inv_freq: mx.array, slots: mx.array, keys: mx.array,
                  values: mx.array, heads: AttentionSpec, block: int, qk_norm: QKNorm | None) -> None:
    """Shapes and dtypes the kernel assumes (a bad launch would abort the process)."""
    reason = attention_reason(heads)
    if reason:
        raise UnsupportedKernelConfig(reason)
    kv, hd = heads.n_kv_heads, heads.head_dim
    if qkv.shape[-1:] != (heads.width,) or any(n != 1 for n in qkv.shape[:-1]):
        raise UnsupportedKernelConfig(f"qkv has shape {tuple(qkv.shape)}, expected one token's ({heads.width},)")
    if bias is not None and (bias.shape != (heads.width,) or bias.dtype != qkv.dtype):
        raise UnsupportedKernelConfig(f"qkv bias {tuple(bias.shape)} {bias.dtype}: expected ({heads.width},) "
                                      f"{qkv.dtype}")
    if inv_freq.shape != (hd // 2,) or inv_freq.dtype != mx.float32:
        raise UnsupportedKernelConfig(f"inv_freq {tuple(inv_freq.shape)} {inv_freq.dtype}: expected "
                                      f"({hd // 2},) float32")
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


_check = CheckedOnce(_check_inputs)


def _signature(a: mx.array | None) -> tuple | None:
    return None if a is None else (a.shape, a.dtype)


def check_inputs(qkv: mx.array, bias: mx.array | None, inv_freq: mx.array, slots: mx.array, keys: mx.array,
                 values: mx.array, heads: AttentionSpec, block: int, qk_norm: QKNorm | None = None) -> None:
    """_check_inputs, once per combination of shapes and dtypes (decode repeats one)."""
    key = (*map(_signature, (qkv, bias, inv_freq, slots, keys, values)), heads, block,
           qk_norm is not None and (_signature(qk_norm.q), _signature(qk_norm.k), qk_norm.eps))
    _check(key, qkv, bias, inv_freq, slots, keys, values, heads, block, qk_norm)


_blocks: dict[int, mx.array] = {}


def block_array(block: int) -> mx.array:
    """int32 [block], one array per value: the same layer asks for it every step."""
    if block not in _blocks:
        _blocks[block] = mx.array([block], dtype=mx.int32)
    return _blocks[block]


@functools.lru_cache(maxsize=8)
def eps_array(eps: float) -> mx.array:
    """float32 [1] holding a norm's epsilon: the kernel takes it as an input (templates take no floats)."""
    a = mx.array([eps], mx.float32)
    mx.eval(a)
    return a


def gpu_decode_attention(backend: str, qkv: mx.array, bias: mx.array | None, inv_freq: mx.array, slots: mx.array,
                         keys: mx.array, values: mx.array, heads: AttentionSpec, block: int = 0, write: bool = False,
                         qk_norm: QKNorm | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """The kernel on `backend` (see decode_attention), with `splits(CAP)` threadgroups a head and, past one,
    the launch that joins their partials."""
    h, kv, hd = heads.n_heads, heads.n_kv_heads, heads.head_dim
    lead = tuple(qkv.shape[:-1])
    s = splits(keys.shape[2])
    norms = (qk_norm.q, qk_norm.k, eps_array(qk_norm.eps)) if qk_norm is not None else (qkv, qkv, inv_freq)
    out_dtype = qkv.dtype if s == 1 else mx.float32
    out, k_new, v_new = built_kernel(backend, ATTENTION)(
        inputs=[qkv, bias if bias is not None else qkv, inv_freq, slots, keys, values, block_array(block), *norms],
        template=[("T", qkv.dtype), ("OT", out_dtype), ("H", h), ("KV", kv), ("HD", hd), ("BIAS", bias is not None),
                  ("QKNORM", qk_norm is not None), ("W", WARPS_PER_HEAD), ("S", s), ("WRITE", write)],
        grid=(LANES, h * s * WARPS_PER_HEAD, 1), threadgroup=(LANES, WARPS_PER_HEAD, 1),
        output_shapes=[(*lead, h * hd) if s == 1 else (h * s * (hd + 2),), (1, kv, 1, hd), (1, kv, 1, hd)],
        output_dtypes=[out_dtype, qkv.dtype, qkv.dtype],
    )
    if s > 1:
        out = built_kernel(backend, COMBINE)(
            inputs=[out], template=[("T", qkv.dtype), ("H", h), ("HD", hd), ("S", s)],
            grid=(LANES, h, 1), threadgroup=(LANES, 1, 1), output_shapes=[(*lead, h * hd)],
            output_dtypes=[qkv.dtype])[0]
    return out, k_new, v_new


def _rotate(x: mx.array, cos: mx.array, sin: mx.array, dtype: mx.Dtype) -> mx.array:
    """Rotate-half RoPE of float32 rows [..., hd], rounded to `dtype` and back to float32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(dtype).astype(mx.float32)


def reference_decode_attention(qkv: mx.array, bias: mx.array | None, inv_freq: mx.array, slots: mx.array,
                               keys: mx.array, values: mx.array, heads: AttentionSpec, block: int = 0,
                               qk_norm: QKNorm | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """The kernel's arithmetic with MLX ops (the q/k norm as mx.fast.rms_norm, which the model runs); the
    position may be a traced array (a compiled step), so the cache is masked past it rather than sliced."""
    h, kv, hd = heads.n_heads, heads.n_kv_heads, heads.head_dim
    dtype, lead = qkv.dtype, tuple(qkv.shape[:-1])
    x = qkv.reshape(-1)
    if bias is not None:
        x = x + bias
    q, k, v = x[: h * hd].reshape(kv, h // kv, hd), x[h * hd : (h + kv) * hd].reshape(kv, 1, hd), x[(h + kv) * hd :]
    if qk_norm is not None:
        q, k = mx.fast.rms_norm(q, qk_norm.q, qk_norm.eps), mx.fast.rms_norm(k, qk_norm.k, qk_norm.eps)
    theta = slots[0].astype(mx.float32) * inv_freq
    cos, sin = mx.cos(theta), mx.sin(theta)
    q = _rotate(q.astype(mx.float32), cos, sin, dtype) * (hd**-0.5)
    k = _rotate(k.astype(mx.float32), cos, sin, dtype)
    v = v.astype(mx.float32).reshape(kv, 1, hd)
    past = mx.arange(keys.shape[2], dtype=mx.int32) < slots[0]
    cached_k = keys[block].astype(mx.float32)  # [KV, CAP, HD]
    cached_v = mx.where(past[:, None], values[block].astype(mx.float32), 0.0)  # unwritten slots never reach the sum
    scores = mx.where(past, q @ cached_k.transpose(0, 2, 1), -mx.inf)  # [KV, group, CAP]
    scores = mx.concatenate([scores, (q * k).sum(axis=-1, keepdims=True)], axis=-1)
    probs = mx.softmax(scores, axis=-1, precise=True)
    out = probs[..., :-1] @ cached_v + probs[..., -1:] * v
    new = (a.reshape(1, kv, 1, hd).astype(dtype) for a in (k, v))
    return (out.reshape(*lead, h * hd).astype(dtype), *new)


def decode_attention(backend: str, qkv: mx.array, bias: mx.array | None, inv_freq: mx.array, slots: mx.array,
                     keys: mx.array, values: mx.array, heads: AttentionSpec, block: int = 0, write: bool = False,
                     qk_norm: QKNorm | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """One new token's attention on `backend`: (output [..., H * HD] in qkv's dtype, its rotated key and its
    value [1, KV, 1, HD] for the cache).

    qkv [..., (H + 2 KV) * HD] is the stacked projection without its bias (leading axes all 1, kept in the
    output); bias the stacked bias or None; inv_freq from rope_frequencies; slots int32 [P, CAP]: the token's
    position P and the slots CAP of the cache buffers keys / values [N, KV, CAP, HD], whose block `block`
    holds this layer's cache: its first P slots the earlier tokens' rotated keys and values (one pair of
    buffers can hold every layer's cache, moebench.decode.cache.StaticCache). With `write` the GPU kernel also
    stores the key and value at slot P of that block, in place: MLX does not see the buffers change, so
    only a cache that orders every reader of the slot after this step may ask (a compiled step's static cache,
    moebench.decode.cache.StaticCache), and its buffers must be whole row-contiguous arrays (MLX hands a
    kernel a copy of any other input, and the write would land in the copy): a StaticCache's are (zeros,
    then its updates' outputs). `qk_norm`: normalise each head of q and k first.
    """
    check_backend(backend)
    check_inputs(qkv, bias, inv_freq, slots, keys, values, heads, block, qk_norm)
    if backend in GPU_BACKENDS:
        return gpu_decode_attention(backend, qkv, bias, inv_freq, slots, keys, values, heads, block, write, qk_norm)
    if write:
        raise UnsupportedKernelConfig("the reference attention returns new arrays: it cannot write the cache in place")
    norm = None if qk_norm is None else (qk_norm.q, qk_norm.k)
    return run_compiled(_traced_reference, (heads, block, None if qk_norm is None else qk_norm.eps), qkv, bias,
                        inv_freq, slots, keys, values, norm)


def _traced_reference(qkv: mx.array, bias: mx.array | None, inv_freq: mx.array, slots: mx.array, keys: mx.array,
                      values: mx.array, norm: tuple | None, heads: AttentionSpec, block: int,
                      eps: float | None) -> tuple[mx.array, mx.array, mx.array]:
    """reference_decode_attention with the q/k norm given as its weights and eps (run_compiled takes arrays)."""
    qk_norm = None if norm is None else QKNorm(*norm, eps)
    return reference_decode_attention(qkv, bias, inv_freq, slots, keys, values, heads, block, qk_norm)
