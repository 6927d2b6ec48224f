"""The decode-attention step: its reference against MLX's own attention path, the checks that stand
between a bad launch and the process, and when a layer declines it (always with the reason)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import moebench
from moebench.decode.loop import generate
from moebench.errors import UnsupportedKernelConfig
from moebench.execution import attention
from moebench.execution.attention import QKNorm, decode_attention, rope_frequencies, splits
from moebench.execution.support import attention_reason
from moebench.inspect.truth import f64, nrms
from moebench.models.declare import AttentionSpec

BASE = 10000.0


def _inputs(heads: AttentionSpec, p: int, cap: int, dtype: mx.Dtype, bias: bool = True, seed: int = 0):
    keys = mx.random.split(mx.random.key(seed), 4)
    qkv = mx.random.normal((1, 1, heads.width), key=keys[0]).astype(dtype)
    b = mx.random.normal((heads.width,), key=keys[1]).astype(dtype) if bias else None
    shape = (1, heads.n_kv_heads, cap, heads.head_dim)
    cached_k, cached_v = (mx.random.normal(shape, key=k).astype(dtype) for k in keys[2:])
    return qkv, b, rope_frequencies(heads.head_dim, BASE), mx.array([p, cap], mx.int32), cached_k, cached_v


def _mlx_attention(qkv, bias, p, cached_k, cached_v, heads: AttentionSpec, qk_norm: QKNorm | None = None):
    """What the unfused layer computes: bias add, (Qwen3's per-head q/k RMSNorm,) mx.fast.rope, cache fetch,
    mx.fast SDPA."""
    h, kv, hd = heads.n_heads, heads.n_kv_heads, heads.head_dim
    x = (qkv + bias if bias is not None else qkv).reshape(1, 1, h + 2 * kv, hd).transpose(0, 2, 1, 3)
    q, k, v = x[:, :h], x[:, h : h + kv], x[:, h + kv :]
    if qk_norm is not None:
        q, k = mx.fast.rms_norm(q, qk_norm.q, qk_norm.eps), mx.fast.rms_norm(k, qk_norm.k, qk_norm.eps)
    q, k = (mx.fast.rope(a, hd, traditional=False, base=BASE, scale=1.0, offset=p) for a in (q, k))
    keys = mx.concatenate([cached_k[:, :, :p], k], axis=2)
    values = mx.concatenate([cached_v[:, :, :p], v], axis=2)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=hd**-0.5)
    return out.reshape(1, 1, h * hd), k, v


@pytest.mark.parametrize("heads,bias", [(AttentionSpec(4, 4, 64), True), (AttentionSpec(8, 2, 32), False),
                                        (AttentionSpec(2, 1, 96), True)])
@pytest.mark.parametrize("p", [0, 1, 9, 40])
def test_reference_matches_mlx_attention(heads, bias, p):
    qkv, b, inv, slots, cached_k, cached_v = _inputs(heads, p, 48, mx.float32, bias, seed=p)
    out, k_new, v_new = decode_attention("reference", qkv, b, inv, slots, cached_k, cached_v, heads)
    want, k, v = _mlx_attention(qkv, b, p, cached_k, cached_v, heads)
    assert out.shape == (1, 1, heads.n_heads * heads.head_dim) and k_new.shape == v_new.shape == k.shape
    assert np.abs(np.array(out) - np.array(want)).max() < 1e-5
    assert np.abs(np.array(k_new) - np.array(k)).max() < 1e-5 and np.array_equal(np.array(v_new), np.array(v))


def test_reference_never_reads_the_slots_past_the_position():
    heads = AttentionSpec(4, 2, 64)
    qkv, b, inv, slots, cached_k, cached_v = _inputs(heads, 5, 16, mx.float32)
    unread = mx.arange(16)[None, None, :, None] >= 5
    poisoned = [mx.where(unread, mx.nan, a) for a in (cached_k, cached_v)]
    clean = decode_attention("reference", qkv, b, inv, slots, cached_k, cached_v, heads)
    dirty = decode_attention("reference", qkv, b, inv, slots, *poisoned, heads)
    for a, c in zip(clean, dirty, strict=True):
        assert np.array_equal(np.array(a), np.array(c))


def test_bfloat16_rounds_where_mlx_rounds():
    heads = AttentionSpec(4, 4, 64)
    inputs = _inputs(heads, 20, 32, mx.bfloat16)
    out, k_new, _ = decode_attention("reference", *inputs, heads)
    _, k, _ = _mlx_attention(inputs[0], inputs[1], 20, inputs[4], inputs[5], heads)
    assert out.dtype == k_new.dtype == mx.bfloat16
    assert np.abs(f64(k_new) - f64(k)).max() <= 2**-7 * np.abs(f64(k)).max()  # rope's rounding, one step at most
    exact = decode_attention("reference", *(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a for a in inputs),
                             heads)[0]  # the same bf16 values, no rounding after them
    assert nrms(f64(out), f64(exact)) < 5e-3  # q, k and the output rounded to bf16: a few bf16 steps, no more


def test_bad_inputs_are_named_before_any_launch():
    """Each case differs from a good call in one respect, and raises every time (a failed check is never
    remembered as passed)."""
    heads = AttentionSpec(4, 4, 64)
    qkv, b, inv, slots, cached_k, cached_v = _inputs(heads, 3, 16, mx.float32)
    decode_attention("reference", qkv, b, inv, slots, cached_k, cached_v, heads)
    cases = {
        "qkv has shape": ((qkv[..., :-1], b, inv, slots, cached_k, cached_v, heads), {}),
        "qkv bias": ((qkv, b.astype(mx.bfloat16), inv, slots, cached_k, cached_v, heads), {}),
        "inv_freq": ((qkv, b, inv[:-1], slots, cached_k, cached_v, heads), {}),
        "slots": ((qkv, b, inv, slots.astype(mx.float32), cached_k, cached_v, heads), {}),
        "cached keys": ((qkv, b, inv, slots, cached_k[:, :2], cached_v, heads), {}),
        "cached values": ((qkv, b, inv, slots, cached_k, cached_v.astype(mx.bfloat16), heads), {}),
        "cache block 1 is outside": ((qkv, b, inv, slots, cached_k, cached_v, heads, 1), {}),
        "multiple of 32": ((qkv, b, inv, slots, cached_k, cached_v, AttentionSpec(4, 4, 48)), {}),
        "cannot write the cache in place": ((qkv, b, inv, slots, cached_k, cached_v, heads), {"write": True}),
    }
    for message, (args, kwargs) in cases.items():
        for _ in range(2):
            with pytest.raises(UnsupportedKernelConfig, match=message):
                decode_attention("reference", *args, **kwargs)
    with pytest.raises(UnsupportedKernelConfig, match="unknown fused backend"):
        decode_attention("vulkan", qkv, b, inv, slots, cached_k, cached_v, heads)


def test_support_reasons_and_splits():
    assert attention_reason(AttentionSpec(16, 16, 128)) is None and attention_reason(AttentionSpec(4, 2, 32)) is None
    assert "multiple of 32" in attention_reason(AttentionSpec(4, 4, 48))
    assert "do not divide" in attention_reason(AttentionSpec(6, 4, 64))
    assert splits(1) == splits(attention.SPLIT_POSITIONS) == 1  # a short cache: one threadgroup a head, no join
    assert splits(attention.SPLIT_POSITIONS + 1) == 2 and splits(10**7) == attention.MAX_SPLITS


@pytest.mark.parametrize("heads", [AttentionSpec(4, 2, 64), AttentionSpec(8, 8, 32)])
@pytest.mark.parametrize("p", [0, 700, 2999])
def test_reference_with_the_qk_norm_matches_the_qwen3_attention(heads, p):
    """Qwen3's per-head q/k RMSNorm before RoPE, deep into a long cache too. Past a few hundred positions the
    float32 rotation angles round differently from mx.fast.rope's (both as far from a float64 rotation: about
    1e-4 at position 3000), so the bound there is the fused path's parity class, 5e-4."""
    qkv, _, inv, slots, cached_k, cached_v = _inputs(heads, p, 3000, mx.float32, False, seed=p)
    norm = QKNorm(mx.random.uniform(0.5, 1.5, (heads.head_dim,), key=mx.random.key(1)),
                  mx.random.uniform(0.5, 1.5, (heads.head_dim,), key=mx.random.key(2)), 1e-6)
    got = decode_attention("reference", qkv, None, inv, slots, cached_k, cached_v, heads, qk_norm=norm)
    want = _mlx_attention(qkv, None, p, cached_k, cached_v, heads, norm)
    for a, b in zip(got, want, strict=True):
        assert nrms(f64(a).reshape(-1), f64(b).reshape(-1)) < (1e-5 if p < 1000 else 5e-4)


def test_long_contexts_run_the_kernel(quantized_checkpoint):
    """No length declines the decode-attention kernel: every decode step of a context past the old 1024-slot
    bound (and past one split of the positions) runs it, and so do the MoE blocks."""
    model, _ = moebench.load(quantized_checkpoint)
    prompt = np.random.default_rng(0).integers(0, model.args.vocab_size, 1100).tolist()
    with moebench.fused_moe(True, model):
        result = generate(model, prompt, 4, compiled=False)
    with moebench.fused_moe(False, model):
        assert generate(model, prompt, 4, compiled=False).token_ids == result.token_ids
    backend, counts = moebench.available_backend(), moebench.dispatch(model)
    for part in ("attention", "moe"):
        for d in counts[part].values():
            assert d["fused"] == {backend: 3} and d["fallback"] == 1 + 4  # the prefills, and the fallback run
