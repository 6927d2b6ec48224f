"""The float64 truth: numpy's unpacking of the packed weights matches MLX's, and the SwiGLU is the float one."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from moebench.inspect.truth import dequantize_f64, expert_outputs, nmax, nrms
from moebench.models.args import QuantizedParts


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
