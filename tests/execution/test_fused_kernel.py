"""The fused decode-MoE arithmetic on the CPU: the 'reference' backend against a float64 dense truth,
against the gather_qmm fallback, its determinism, and the launch settings the GPU kernels read."""

from __future__ import annotations

import gc
import weakref

import mlx.core as mx
import numpy as np
import pytest

from moebench.checkpoint.quant import QuantizedParts
from moebench.errors import ConfigError, UnsupportedKernelConfig
from moebench.execution import moe as fused_kernel
from moebench.models.switch import SwitchGLU, SwitchLinear, weighted_sum


def make_experts(n_exp: int, d: int, dff: int, bits: tuple[int, int] = (4, 4), group: int = 64, seed: int = 0,
                 scale_dtype: mx.Dtype = mx.float32) -> tuple[QuantizedParts, QuantizedParts, QuantizedParts]:
    """Random gate/up [E, Dff, D] and down [E, D, Dff] experts, affine-quantized."""
    rng = np.random.default_rng(seed)
    parts = []
    for b, (o, i) in zip((bits[0], bits[0], bits[1]), ((dff, d), (dff, d), (d, dff)), strict=True):
        w = mx.array((rng.standard_normal((n_exp, o, i)) / np.sqrt(i)).astype(np.float32))
        q, s, bias = mx.quantize(w, group_size=group, bits=b)
        parts.append(QuantizedParts(q, s.astype(scale_dtype), bias.astype(scale_dtype), group, b, "affine"))
    return tuple(parts)


def dense_truth(x: mx.array, ids: list[int], scores: np.ndarray, parts) -> tuple[np.ndarray, np.ndarray]:
    """float64 SwiGLU experts, weights dequantized with scales and biases upcast to float32 first."""
    def dense(p: QuantizedParts) -> np.ndarray:
        sel = mx.array(ids)
        w = mx.dequantize(p.weight[sel], p.scales[sel].astype(mx.float32), p.biases[sel].astype(mx.float32),
                          group_size=p.group_size, bits=p.bits)
        return np.array(w, dtype=np.float64)

    g_w, u_w, d_w = (dense(p) for p in parts)
    xf = np.array(x.astype(mx.float32), dtype=np.float64)
    g, u = g_w @ xf, u_w @ xf
    y = np.einsum("kdf,kf->kd", d_w, g / (1 + np.exp(-g)) * u)
    return y, (y * scores[:, None]).sum(0)


def nrms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def routing(n_exp: int, k: int, seed: int) -> tuple[list[int], np.ndarray]:
    rng = np.random.default_rng(seed)
    return [int(i) for i in rng.choice(n_exp, k, replace=False)], rng.dirichlet(np.ones(k)).astype(np.float32)


@pytest.mark.parametrize("bits", [(4, 4), (8, 8), (4, 8), (4, 6)])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_reference_matches_dense_truth_on_small_shapes(bits, group):
    parts = make_experts(6, 256, 128, bits, group, seed=group + bits[1])
    ids, scores = routing(6, 3, seed=group)
    x = mx.array(np.random.default_rng(1).standard_normal(256).astype(np.float32))
    out, y, _ = fused_kernel.routed("reference", x, mx.array(ids, dtype=mx.uint32), mx.array(scores), *parts)
    truth_y, truth_out = dense_truth(x, ids, scores, parts)
    assert y.dtype == mx.float32 and y.shape == (3, 256) and out.dtype == x.dtype
    assert nrms(y, truth_y) < 5e-4 and nrms(out, truth_out) < 5e-4


REAL_EXPERT_SHAPES = {"qwen1.5-moe-a2.7b": (2048, 1408, 4), "qwen3-30b-a3b": (2048, 768, 8)}  # D, Dff, top-k


@pytest.mark.parametrize("model", sorted(REAL_EXPERT_SHAPES))
@pytest.mark.parametrize("bits,group", [((4, 4), 64), ((8, 8), 128), ((4, 4), 32)])
def test_reference_matches_dense_truth_at_real_expert_shapes(model, bits, group):
    """Qwen1.5-MoE-A2.7B (top-4) and Qwen3-30B-A3B (top-8) experts, with 10 experts per stack to stay fast."""
    d, dff, k = REAL_EXPERT_SHAPES[model]
    parts = make_experts(10, d, dff, bits, group, seed=3)
    ids, scores = routing(10, k, seed=4)
    x = mx.array(np.random.default_rng(5).standard_normal(d).astype(np.float32))
    out, y, _ = fused_kernel.routed("reference", x, mx.array(ids, dtype=mx.uint32), mx.array(scores), *parts)
    truth_y, truth_out = dense_truth(x, ids, scores, parts)
    assert nrms(y, truth_y) < 5e-4 and nrms(out, truth_out) < 5e-4


def test_fused_is_no_farther_from_truth_than_the_fallback_in_bfloat16():
    """bfloat16 activations and scales (as on a GPU): the fused path rounds once, gather_qmm all along."""
    parts = make_experts(8, 256, 128, (4, 4), 64, seed=6, scale_dtype=mx.bfloat16)
    ids, scores = routing(8, 4, seed=7)
    x = mx.array(np.random.default_rng(8).standard_normal(256).astype(np.float32)).astype(mx.bfloat16)
    idx, sc = mx.array(ids, dtype=mx.uint32), mx.array(scores)
    out, _, _ = fused_kernel.routed("reference", x, idx, sc, *parts)
    switch = SwitchGLU(*(SwitchLinear(p.weight, p) for p in parts))
    fallback = weighted_sum(switch(x[None], idx[None]), sc[None])[0]
    _, truth_out = dense_truth(x, ids, scores, parts)
    fused_err, fallback_err = nrms(out.astype(mx.float32), truth_out), nrms(fallback.astype(mx.float32), truth_out)
    assert out.dtype == mx.bfloat16
    assert fused_err <= fallback_err, f"fused nRMS {fused_err:.2e} vs fallback {fallback_err:.2e}"


def test_reference_is_bitwise_deterministic():
    parts = make_experts(6, 256, 128, seed=9)
    ids, scores = routing(6, 3, seed=9)
    x = mx.array(np.random.default_rng(9).standard_normal(256).astype(np.float32))
    args = (x, mx.array(ids, dtype=mx.uint32), mx.array(scores), *parts)
    first = [np.array(a) for a in fused_kernel.routed("reference", *args)[:2]]
    for _ in range(5):
        again = [np.array(a) for a in fused_kernel.routed("reference", *args)[:2]]
        assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


def test_bad_inputs_raise_named_errors_before_any_launch():
    parts = make_experts(4, 128, 64, seed=10)
    idx, sc = mx.array([0, 1], dtype=mx.uint32), mx.array([0.5, 0.5])
    with pytest.raises(UnsupportedKernelConfig, match="one token"):
        fused_kernel.routed("reference", mx.zeros((2, 128)), idx, sc, *parts)
    with pytest.raises(UnsupportedKernelConfig, match=r"must both be \[K\]"):
        fused_kernel.routed("reference", mx.zeros((128,)), idx, mx.array([1.0]), *parts)
    with pytest.raises(UnsupportedKernelConfig, match="down experts"):
        fused_kernel.routed("reference", mx.zeros((128,)), idx, sc, parts[0], parts[1], parts[0])
    with pytest.raises(UnsupportedKernelConfig, match="unknown fused backend"):
        fused_kernel.routed("rocm", mx.zeros((128,)), idx, sc, *parts)


def test_gpu_backend_without_its_runtime_says_so():
    parts = make_experts(4, 128, 64, seed=11)
    backend = "cuda" if not mx.cuda.is_available() else "metal"
    with pytest.raises(UnsupportedKernelConfig, match="not available"):
        fused_kernel.gpu_routed(backend, mx.zeros((128,)), mx.array([0, 1], dtype=mx.uint32), mx.array([0.5, 0.5]),
                                *parts)


@pytest.mark.parametrize("raw,expected", [(None, 8), ("", 8), ("1", 1), (" 16 ", 16), ("32", 32)])
def test_rows_per_threadgroup_from_the_environment(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv(fused_kernel.ENV_ROWS, raising=False)
    else:
        monkeypatch.setenv(fused_kernel.ENV_ROWS, raw)
    assert fused_kernel.rows_per_threadgroup() == expected


@pytest.mark.parametrize("raw", ["0", "33", "-2", "eight"])
def test_bad_rows_per_threadgroup_is_a_config_error(monkeypatch, raw):
    monkeypatch.setenv(fused_kernel.ENV_ROWS, raw)
    with pytest.raises(ConfigError, match=fused_kernel.ENV_ROWS):
        fused_kernel.rows_per_threadgroup()


def test_each_backend_gets_its_prelude_around_the_same_body():
    for stage in fused_kernel.STAGES:
        body = (fused_kernel.KERNEL_DIR / stage.body).read_text()
        metal_header, metal_source = fused_kernel.kernel_source("metal", stage)
        cuda_header, cuda_source = fused_kernel.kernel_source("cuda", stage)
        assert metal_source.endswith(body) and cuda_source.endswith(body)
        assert "thread_position_in_grid" in metal_source and "blockIdx" in cuda_source
        assert "simd_sum" in metal_header and "__shfl_xor_sync" in cuda_header
    with pytest.raises(UnsupportedKernelConfig, match="no kernel prelude"):
        fused_kernel.kernel_source("rocm", fused_kernel.GATE_UP)


def test_launch_plans_are_reused_per_layer_and_never_keep_weights_alive():
    parts = make_experts(4, 128, 64, seed=12, scale_dtype=mx.bfloat16)
    x, idx, sc = mx.zeros((1, 1, 128), mx.bfloat16), mx.array([[[0, 1]]], dtype=mx.uint32), mx.array([[[0.5, 0.5]]])
    plan = fused_kernel._plan(x, idx, sc, *parts, None, None, 8)
    assert fused_kernel._plan(x, idx, sc, *parts, None, None, 8) is plan
    assert plan.down_shapes == [(1, 1, 2, 128), (1,), (1, 1, 128)]
    watch = weakref.ref(parts[0])
    del parts
    gc.collect()
    assert watch() is None, "a launch plan kept a layer's weights alive"
