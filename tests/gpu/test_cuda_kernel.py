"""The CUDA kernel pair against the CPU reference and a float64 truth, at Qwen1.5-MoE-A2.7B shapes.

Runs only where MLX has a CUDA back-end (the H200 of the device tool); skips cleanly elsewhere.
Numbers are printed as well as asserted (run with -s to see them).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from moebench import fused_kernel
from moebench.decode import generate
from moebench.fused_kernel import gpu_routed
from moebench.kernels import available_backend, fused_moe
from moebench.loader import load
from moebench.quant import QuantizedParts
from moebench.switch import SwitchGLU, SwitchLinear, weighted_sum
from moebench.writer import qwen2_moe_config, write_random_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX with a CUDA back-end")]

E, K, D, DFF = 60, 4, 2048, 1408
ROWS = (1, 2, 3, 5, 8, 16, 32)


def _experts(bits: tuple[int, int], group: int, seed: int) -> tuple[QuantizedParts, ...]:
    mx.random.seed(seed)
    out = []
    for b, (o, i) in zip((bits[0], bits[0], bits[1]), ((DFF, D), (DFF, D), (D, DFF)), strict=True):
        w = mx.random.normal((E, o, i)) / np.sqrt(i)
        q, s, bias = mx.quantize(w, group_size=group, bits=b)
        out.append(QuantizedParts(q, s.astype(mx.bfloat16), bias.astype(mx.bfloat16), group, b, "affine"))
    mx.eval(*[p.weight for p in out])
    return tuple(out)


def _truth(x: mx.array, ids: list[int], scores: np.ndarray, parts) -> tuple[np.ndarray, np.ndarray]:
    """float64 dense: dequantized with scales and biases upcast to float32 first, then float64 matmuls."""
    def dense(p: QuantizedParts) -> np.ndarray:
        sel = mx.array(ids)
        w = mx.dequantize(p.weight[sel], p.scales[sel].astype(mx.float32), p.biases[sel].astype(mx.float32),
                          group_size=p.group_size, bits=p.bits, stream=mx.cpu)
        return np.array(w.astype(mx.float32), dtype=np.float64)

    g_w, u_w, d_w = (dense(p) for p in parts)
    xf = np.array(x.astype(mx.float32), dtype=np.float64)
    g, u = g_w @ xf, u_w @ xf
    act = g / (1 + np.exp(-g)) * u
    y = np.einsum("kdf,kf->kd", d_w, act)
    return y, (y * scores[:, None]).sum(0)


def _nrms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def _bf16(a: np.ndarray) -> np.ndarray:
    return np.array(mx.array(a.astype(np.float32)).astype(mx.bfloat16).astype(mx.float32))


@pytest.mark.parametrize("bits,group", [((4, 4), 64), ((4, 4), 32), ((4, 4), 128), ((8, 8), 64), ((4, 8), 64),
                                        ((4, 6), 64)])
def test_cuda_kernel_matches_reference_and_truth(bits, group):
    parts = _experts(bits, group, seed=bits[0] * 10 + bits[1] + group)
    rng = np.random.default_rng(group)
    x = mx.array(rng.standard_normal(D).astype(np.float32)).astype(mx.bfloat16)
    ids = [int(i) for i in rng.choice(E, K, replace=False)]
    scores_np = rng.dirichlet(np.ones(K)).astype(np.float32)
    idx, scores = mx.array(ids, dtype=mx.uint32), mx.array(scores_np)
    out, y = gpu_routed("cuda", x, idx, scores, *parts)
    with mx.stream(mx.cpu):
        ref_out, ref_y = fused_kernel.routed("reference", x, idx, scores, *parts)
        mx.eval(ref_out, ref_y)
    switch = SwitchGLU(*(SwitchLinear(p.weight, p) for p in parts))
    fb_y = switch(x[None], idx[None])
    fb_out = weighted_sum(fb_y, scores[None].astype(mx.bfloat16))[0]
    truth_y, truth_out = _truth(x, ids, scores_np, parts)
    got = {"cuda y": _nrms(y, truth_y), "reference y": _nrms(ref_y, truth_y),
           "cuda out": _nrms(out.astype(mx.float32), _bf16(truth_out)),
           "reference out": _nrms(ref_out.astype(mx.float32), _bf16(truth_out)),
           "fallback y": _nrms(fb_y[0].astype(mx.float32), truth_y),
           "fallback out": _nrms(fb_out.astype(mx.float32), _bf16(truth_out)),
           "cuda vs reference y": _nrms(y, ref_y)}
    print(f"\nbits {bits} g{group}: " + ", ".join(f"{k} nRMS {v:.2e}" for k, v in got.items()))
    assert got["cuda y"] < 5e-4 and got["cuda out"] < 5e-4
    assert got["cuda vs reference y"] < 5e-4
    assert got["cuda out"] <= got["fallback out"]


def test_cuda_kernel_is_deterministic_and_independent_of_rows_and_fold():
    parts = _experts((4, 4), 64, seed=7)
    rng = np.random.default_rng(7)
    x = mx.array(rng.standard_normal(D).astype(np.float32)).astype(mx.bfloat16)
    idx = mx.array(rng.choice(E, K, replace=False).astype(np.uint32))
    scores = mx.array(rng.dirichlet(np.ones(K)).astype(np.float32))
    first_out, first_y = (np.array(a.astype(mx.float32)) for a in gpu_routed("cuda", x, idx, scores, *parts, rows=8))
    for _ in range(10):
        out, y = gpu_routed("cuda", x, idx, scores, *parts, rows=8)
        assert np.array_equal(np.array(y), first_y) and np.array_equal(np.array(out.astype(mx.float32)), first_out)
    for rows in ROWS:
        for fold in (True, False):
            out, y = gpu_routed("cuda", x, idx, scores, *parts, rows=rows, fold=fold)
            assert np.array_equal(np.array(y), first_y), f"rows {rows} fold {fold}: y differs"
            if fold:
                assert np.array_equal(np.array(out.astype(mx.float32)), first_out), f"rows {rows}: out differs"
    print(f"\nbitwise identical over 10 repeats and rows {ROWS} (fold on and off)")


def test_decode_on_cuda_runs_the_kernel_every_step(tmp_path):
    cfg = qwen2_moe_config(num_hidden_layers=3)
    folder = write_random_checkpoint(tmp_path / "ckpt", cfg, seed=3, bits=4, group_size=64, dtype=mx.bfloat16)
    model, _ = load(folder)
    assert available_backend() == "cuda"
    runs = {}
    for on in (True, False):
        for block in model.moe_blocks().values():
            block.dispatch.reset()
        with fused_moe(on):
            runs[on] = generate(model, [1, 2, 3, 4, 5], 12).token_ids
        for block in model.moe_blocks().values():
            assert block.dispatch.fused.get("cuda", 0) == (11 if on else 0)
    same = runs[True] == runs[False]
    print(f"\ngreedy tokens fused on {runs[True]}\n             fused off {runs[False]} identical={same}")
