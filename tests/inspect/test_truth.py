"""The float64 truth: numpy's unpacking of the packed weights matches MLX's, the SwiGLU is the float one, and the
decode attention is the reference's in float64."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from moebench.execution.attention import QKNorm, projection_width, reference_decode_attention, rope_frequencies
from moebench.execution.support import rotary_dims
from moebench.inspect.truth import attention_f64, dequantize_f64, expert_outputs, f64, nmax, nrms
from moebench.models.args import QuantizedParts, YarnScaling
from moebench.models.declare import PER_HEAD, AttentionSpec
from moebench.models.rotary import yarn


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_numpy_dequantization_matches_mlx(bits, group_size):
    w = mx.random.normal((3, 8, 256), key=mx.random.key(bits))
    q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    parts = QuantizedParts(q, scales, biases, group_size, bits, "affine")
    ids = np.array([2, 0])
    expected = np.array(mx.dequantize(q, scales, biases, group_size=group_size, bits=bits))[ids]
    np.testing.assert_allclose(dequantize_f64(parts, ids), expected, rtol=0, atol=1e-6)


def test_expert_outputs_agree_with_a_float32_swiglu():
    parts = [QuantizedParts(*mx.quantize(mx.random.normal(shape, key=mx.random.key(i)), group_size=64, bits=4), 64, 4,
                            "affine") for i, shape in enumerate([(6, 64, 128), (6, 64, 128), (6, 128, 64)])]
    x = np.random.default_rng(0).standard_normal(128).astype(np.float32)
    ids = np.array([1, 4])
    truth = expert_outputs(parts, x, ids)
    w = [dequantize_f64(p, ids).astype(np.float32) for p in parts]
    g, u = w[0] @ x, w[1] @ x
    f32 = np.einsum("kdf,kf->kd", w[2], g / (1 + np.exp(-g)) * u)
    assert truth.shape == (2, 128) and nrms(f32, truth) < 1e-6
    one = expert_outputs([QuantizedParts(p.weight[1], p.scales[1], p.biases[1], 64, 4, "affine") for p in parts], x)
    assert np.array_equal(one, truth[0])  # a single matrix (the shared expert) is the same arithmetic


def test_nrms_and_nmax():
    truth = np.array([1.0, -2.0, 3.0])
    assert nrms(truth * 1.01, truth) == pytest.approx(0.01) and nmax(truth + 0.3, truth) == pytest.approx(0.1)
    assert nrms(np.zeros(3), np.zeros(3)) == 0.0


def test_expert_outputs_of_a_declared_variant_are_gpt_oss_experts_in_float64():
    """With expert biases and the clamped SwiGLU, the truth is what gpt-oss's experts compute (its own
    clamped_swiglu, the biases added to each projection), in float64; the clamp bites on these values."""
    from moebench.execution.moe import ExpertVariant
    from moebench.models.gpt_oss import clamped_swiglu

    parts = [QuantizedParts(*mx.quantize(mx.random.normal(shape, key=mx.random.key(i)) / 8, mode="mxfp4"), None, 32,
                            4, "mxfp4") for i, shape in enumerate([(6, 64, 128), (6, 64, 128), (6, 128, 64)])]
    rng = np.random.default_rng(1)
    biases = [rng.standard_normal((6, n)).astype(np.float32) for n in (64, 64, 128)]
    x = rng.standard_normal(128).astype(np.float32)
    ids = np.array([5, 2])
    truth = expert_outputs(parts, x, ids, ExpertVariant(tuple(map(mx.array, biases)), (1.0, 1.702)))
    w = [mx.array(dequantize_f64(p, ids).astype(np.float32)) for p in parts]
    g = w[0] @ mx.array(x) + mx.array(biases[0][ids])
    u = w[1] @ mx.array(x) + mx.array(biases[1][ids])
    f32 = np.array((w[2] @ clamped_swiglu(g, u, 1.0, 1.702)[..., None])[..., 0]) + biases[2][ids]
    assert truth.shape == (2, 128) and nrms(f32, truth) < 1e-6
    assert (np.abs(np.array(g)) > 1.0).any() and (np.abs(np.array(u)) > 1.0).any()  # the clamp bites
    plain = expert_outputs(parts, x, ids, ExpertVariant(tuple(map(mx.array, biases)), None))
    assert nrms(plain, truth) > 1e-3


# (declaration, position, cache slots): plain GQA; q/k/v biases; the hybrids' q/k norm, partial rotary and output
# gate; gpt-oss's biases, sinks, YaRN and window, at a position past the window
@pytest.mark.parametrize("heads,p,cap", [
    (AttentionSpec(8, 2, 32), 20, 32),
    (AttentionSpec(4, 4, 32, qkv_bias=True), 9, 16),
    (AttentionSpec(4, 2, 64, qk_norm=PER_HEAD, rope_fraction=0.25, output_gate=True), 30, 32),
    (AttentionSpec(8, 2, 64, qkv_bias=True, window=8, sinks=True, scaled_rope=True), 40, 48)], ids=str)
def test_attention_truth_is_the_reference_attention_in_float64(heads, p, cap):
    """attention_f64 against the reference attention in float32 on the CPU, at decode_attention's arguments. Only
    this layer's block of the cache is filled, and only before the token's slot: the rest is NaN, which neither
    may read."""
    rng = np.random.default_rng(p)
    width, hd = projection_width(heads), heads.head_dim
    qkv = mx.array(rng.standard_normal((1, 1, width)).astype(np.float32))
    bias = mx.array(0.5 * rng.standard_normal(width).astype(np.float32)) if heads.qkv_bias else None
    caches = np.full((2, 2, heads.n_kv_heads, cap, hd), np.nan, np.float32)  # (keys, values) of two blocks
    caches[:, 1, :, :p] = rng.standard_normal((2, heads.n_kv_heads, p, hd))
    keys, values = map(mx.array, caches)
    qk_norm = QKNorm(*(mx.array(rng.uniform(0.5, 1.5, hd).astype(np.float32)) for _ in range(2)), 1e-6) \
        if heads.qk_norm == PER_HEAD else None
    sinks = mx.array(rng.uniform(-1.0, 4.0, heads.n_heads).astype(np.float32)) if heads.sinks else None
    if heads.scaled_rope:
        inv_freq, rope_scale = yarn(hd, 150_000.0, YarnScaling(factor=32.0, original_max_position_embeddings=4096,
                                                               truncate=False))
    else:
        inv_freq, rope_scale = rope_frequencies(rotary_dims(heads), 10_000.0), 1.0
    args = (qkv, bias, inv_freq, mx.array([p, cap], dtype=mx.int32), keys, values, heads, 1)
    variants = {"qk_norm": qk_norm, "sinks": sinks, "rope_scale": rope_scale}
    with mx.stream(mx.cpu):
        ref = reference_decode_attention(*args, **variants)[0]
        mx.eval(ref)
    truth = attention_f64(*args, **variants)
    assert truth.shape == (heads.n_heads * hd,) and nrms(f64(ref).reshape(-1), truth) < 1e-5
