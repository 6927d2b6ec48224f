"""The CUDA kernels (entry, router, pair with and without the shared expert, input-norm projection, decode
attention) against the CPU reference and a float64 truth, at Qwen1.5-MoE-A2.7B shapes.

Runs only where MLX has a CUDA back-end (the H200 of the device tool); skips cleanly elsewhere.
Numbers are printed as well as asserted (run with -s to see them).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from moebench.checkpoint.loader import load
from moebench.checkpoint.quant import QuantizedParts
from moebench.decode.cache import make_cache
from moebench.decode.compiled import CompiledForward
from moebench.decode.loop import generate
from moebench.execution import attention as attention_kernel
from moebench.execution import moe as fused_kernel
from moebench.execution import norms as norm_kernels
from moebench.execution.attention import Heads, rope_frequencies
from moebench.execution.dispatch import available_backend, fused_moe
from moebench.execution.moe import gpu_routed
from moebench.models.switch import SwitchGLU, SwitchLinear, weighted_sum
from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX with a CUDA back-end")]

E, K, D, DFF, DFFS = 60, 4, 2048, 1408, 5632
ROWS = (1, 2, 3, 5, 8, 16, 32)


def _experts(bits: tuple[int, int], group: int, seed: int, n_exp: int | None = E,
             dff: int = DFF) -> tuple[QuantizedParts, ...]:
    """Routed experts [E, out, in], or with n_exp None one shared expert's matrices [out, in]."""
    mx.random.seed(seed)
    out = []
    lead = (n_exp,) if n_exp is not None else ()
    for b, (o, i) in zip((bits[0], bits[0], bits[1]), ((dff, D), (dff, D), (D, dff)), strict=True):
        w = mx.random.normal((*lead, o, i)) / np.sqrt(i)
        q, s, bias = mx.quantize(w, group_size=group, bits=b)
        out.append(QuantizedParts(q, s.astype(mx.bfloat16), bias.astype(mx.bfloat16), group, b, "affine"))
    mx.eval(*[p.weight for p in out])
    return tuple(out)


def _dense(p: QuantizedParts, ids: list[int] | None = None) -> np.ndarray:
    """float64 matrices, dequantized with scales and biases upcast to float32 first."""
    take = (lambda a: a[mx.array(ids)]) if ids is not None else (lambda a: a)
    w = mx.dequantize(take(p.weight), take(p.scales).astype(mx.float32), take(p.biases).astype(mx.float32),
                      group_size=p.group_size, bits=p.bits, stream=mx.cpu)
    return np.array(w.astype(mx.float32), dtype=np.float64)


def _swiglu_truth(gate: np.ndarray, up: np.ndarray, down: np.ndarray, xf: np.ndarray) -> np.ndarray:
    g, u = gate @ xf, up @ xf
    return down @ (g / (1 + np.exp(-g)) * u)[..., None]


def _truth(x: mx.array, ids: list[int], scores: np.ndarray, parts, shared=None,
           sgate: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """float64 dense routed outputs y [K, D] and block output (with the gated shared expert when given)."""
    xf = np.array(x.astype(mx.float32), dtype=np.float64)
    y = _swiglu_truth(*(_dense(p, ids) for p in parts), xf)[..., 0]
    out = (y * scores[:, None]).sum(0)
    if shared is not None:
        out = out + sgate * _swiglu_truth(*(_dense(p) for p in shared), xf)[..., 0]
    return y, out


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
    out, y, _ = gpu_routed("cuda", x, idx, scores, *parts)
    with mx.stream(mx.cpu):
        ref_out, ref_y, _ = fused_kernel.routed("reference", x, idx, scores, *parts)
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


@pytest.mark.parametrize("bits", [(4, 4), (8, 8), (4, 6)])
def test_cuda_kernel_with_the_shared_expert_matches_reference_and_truth(bits):
    parts = _experts(bits, 64, seed=21)
    shared_parts = _experts(bits, 64, seed=22, n_exp=None, dff=DFFS)
    rng = np.random.default_rng(23)
    x = mx.array(rng.standard_normal(D).astype(np.float32)).astype(mx.bfloat16)
    ids = [int(i) for i in rng.choice(E, K, replace=False)]
    scores_np = rng.dirichlet(np.ones(K)).astype(np.float32)
    idx, scores = mx.array(ids, dtype=mx.uint32), mx.array(scores_np)
    shared = fused_kernel.SharedExpert(*shared_parts, mx.array([0.3], dtype=mx.float32))
    out, y, ys = gpu_routed("cuda", x, idx, scores, *parts, shared)
    with mx.stream(mx.cpu):
        ref_out, ref_y, ref_ys = fused_kernel.routed("reference", x, idx, scores, *parts, shared)
        mx.eval(ref_out, ref_y, ref_ys)
    truth_y, truth_out = _truth(x, ids, scores_np, parts, shared_parts, 0.3)
    got = {"cuda out": _nrms(out.astype(mx.float32), _bf16(truth_out)), "cuda y": _nrms(y, truth_y),
           "cuda vs reference ys": _nrms(ys, ref_ys),
           "reference out": _nrms(ref_out.astype(mx.float32), _bf16(truth_out))}
    print(f"\nshared expert, bits {bits}: " + ", ".join(f"{k} nRMS {v:.2e}" for k, v in got.items()))
    assert max(got.values()) < 5e-4


@pytest.mark.parametrize("n_exp,k,norm,gate_row", [(60, 4, False, True), (128, 8, True, False), (60, 4, False, False)])
def test_cuda_router_kernel_matches_the_reference(n_exp, k, norm, gate_row):
    rng = np.random.default_rng(n_exp + k)
    logits = mx.array(rng.standard_normal((1, n_exp + gate_row)).astype(np.float32)).astype(mx.bfloat16)
    got = fused_kernel.gpu_select("cuda", logits, n_exp, k, norm, gate_row)
    with mx.stream(mx.cpu):
        ref = fused_kernel.reference_select(logits, n_exp, k, norm, gate_row)
        mx.eval(ref)
    probs, inds, scores, sgate = (np.array(a) for a in got)
    r_probs, r_inds, r_scores, r_sgate = (np.array(a) for a in ref)
    assert np.abs(probs - r_probs).max() < 1e-6
    assert list(inds[0]) == list(r_inds[0]), f"top-{k} {inds} vs reference {r_inds}"
    assert np.abs(scores - r_scores).max() < 1e-6 and np.abs(sgate - r_sgate).max() < 1e-6


@pytest.mark.parametrize("n_exp,k,norm,gate_row,bits,dtype", [
    (60, 4, False, True, 8, mx.bfloat16), (60, 4, False, True, 4, mx.bfloat16), (128, 8, True, False, 4, mx.bfloat16),
    (60, 4, False, True, 8, mx.float32)])
def test_cuda_entry_kernel_matches_reference_and_truth(n_exp, k, norm, gate_row, bits, dtype):
    """Residual add, RMSNorm, router rows and selection in one launch, at A2.7B's hidden size."""
    rng = np.random.default_rng(n_exp + bits)
    cast = lambda a: mx.array(a.astype(np.float32)).astype(dtype)  # noqa: E731
    resid, attn = cast(4 * rng.standard_normal((1, 1, D))), cast(rng.standard_normal((1, 1, D)))
    norm_w = cast(rng.uniform(0.5, 1.5, D))
    w = mx.array(rng.standard_normal((n_exp + gate_row, D)).astype(np.float32) / np.sqrt(D))
    q, sc, bi = mx.quantize(w, group_size=64, bits=bits)
    router = QuantizedParts(q, sc.astype(dtype), bi.astype(dtype), 64, bits, "affine")
    args = (resid, attn, norm_w, 1e-6, router, n_exp, k, norm, gate_row)
    got = norm_kernels.norm_router("cuda", *args)
    with mx.stream(mx.cpu):
        ref = norm_kernels.norm_router("reference", *args)
        mx.eval(ref)
    f64 = lambda a: np.array(a.astype(mx.float32), dtype=np.float64).reshape(-1)  # noqa: E731
    h_true = f64(resid) + f64(attn)
    xn_true = f64(norm_w) * h_true / np.sqrt(np.mean(h_true**2) + 1e-6)
    logits_true = _dense(router) @ xn_true
    names = ("h", "xn", "logits")
    errors = {**{f"cuda vs reference {n}": _nrms(f64(a), f64(b)) for n, a, b in zip(names, got, ref, strict=False)},
              **{f"cuda {n} vs truth": _nrms(f64(a), t) for n, a, t in zip(names, got, (h_true, xn_true, logits_true),
                                                                             strict=False)}}
    print(f"\nentry kernel E{n_exp} top-{k} {bits}-bit router {dtype}: " +
          ", ".join(f"{n} nRMS {v:.2e}" for n, v in errors.items()))
    assert max(v for n, v in errors.items() if n.startswith("cuda vs")) < 5e-4
    assert errors["cuda logits vs truth"] < (5e-4 if dtype == mx.float32 else 1e-2)  # bf16: xn rounded, as MLX's norm
    assert np.array_equal(np.array(got[4]), np.array(ref[4])), f"top-{k} {got[4]} vs reference {ref[4]}"
    with mx.stream(mx.cpu):  # the selection from the kernel's own logits: bf16 xn may round apart by one unit
        own = fused_kernel.reference_select(got[2], n_exp, k, norm, gate_row)
        mx.eval(own)
    probs, inds, scores, sgate = (np.array(a) for a in got[3:])
    r_probs, r_inds, r_scores, r_sgate = (np.array(a) for a in own)
    assert np.array_equal(inds, r_inds)
    assert max(np.abs(a - b).max() for a, b in ((probs, r_probs), (scores, r_scores), (sgate, r_sgate))) < 1e-6


@pytest.mark.parametrize("bits,group,dtype", [(4, 64, mx.bfloat16), (8, 64, mx.bfloat16), (4, 128, mx.bfloat16),
                                               (4, 64, mx.float32)])
def test_cuda_input_norm_projection_matches_reference_and_truth(bits, group, dtype):
    """RMSNorm and the stacked q/k/v rows in one launch, at A2.7B's shape (3 x 16 heads of 128)."""
    rng = np.random.default_rng(bits + group)
    cast = lambda a: mx.array(a.astype(np.float32)).astype(dtype)  # noqa: E731
    x, norm_w = cast(3 * rng.standard_normal((1, 1, D))), cast(rng.uniform(0.5, 1.5, D))
    w = mx.array(rng.standard_normal((3 * D, D)).astype(np.float32) / np.sqrt(D))
    q, sc, bi = mx.quantize(w, group_size=group, bits=bits)
    rows = QuantizedParts(q, sc.astype(dtype), bi.astype(dtype), group, bits, "affine")
    got = norm_kernels.norm_matvec("cuda", x, norm_w, 1e-6, rows)
    with mx.stream(mx.cpu):
        ref = norm_kernels.norm_matvec("reference", x, norm_w, 1e-6, rows)
        mx.eval(ref)
    f64 = lambda a: np.array(a.astype(mx.float32), dtype=np.float64).reshape(-1)  # noqa: E731
    xt = f64(x)
    truth = _dense(rows) @ (f64(norm_w) * xt / np.sqrt(np.mean(xt**2) + 1e-6))
    errors = {"cuda vs reference": _nrms(f64(got), f64(ref)), "cuda vs truth": _nrms(f64(got), truth)}
    print(f"\ninput-norm projection {bits}-bit g{group} {dtype}: " +
          ", ".join(f"{n} nRMS {v:.2e}" for n, v in errors.items()))
    assert got.shape == (1, 1, 3 * D) and got.dtype == dtype
    if dtype == mx.float32:  # no rounding between the ops: the bound, against the truth itself
        assert errors["cuda vs reference"] < 5e-4 and errors["cuda vs truth"] < 5e-4
    else:  # the norm's sum in another order can round a few bf16 xn apart by one unit, and each moves
        # many outputs across a bf16 rounding edge (measured: 3 xn apart -> 1.0e-3 nRMS at g128): so at most
        # one bf16 unit apart per output, and the truth no further than the reference is
        a, b = f64(got), f64(ref)
        assert np.all(np.abs(a - b) <= np.maximum(np.abs(a), np.abs(b)) * 2.0**-7 + 1e-30)
        assert errors["cuda vs truth"] < 1e-2


def test_cuda_kernels_are_deterministic_and_independent_of_rows():
    parts = _experts((4, 4), 64, seed=7)
    shared = fused_kernel.SharedExpert(*_experts((4, 4), 64, seed=8, n_exp=None, dff=DFFS),
                                       mx.array([0.6], dtype=mx.float32))
    rng = np.random.default_rng(7)
    x = mx.array(rng.standard_normal(D).astype(np.float32)).astype(mx.bfloat16)
    idx = mx.array(rng.choice(E, K, replace=False).astype(np.uint32))
    scores = mx.array(rng.dirichlet(np.ones(K)).astype(np.float32))

    def run(rows: int) -> list[np.ndarray]:
        return [np.array(a.astype(mx.float32)) for a in gpu_routed("cuda", x, idx, scores, *parts, shared, rows=rows)]

    first = run(8)
    for rows in [8] * 10 + list(ROWS):
        assert all(np.array_equal(a, b) for a, b in zip(run(rows), first, strict=True)), f"rows {rows} differs"
    print(f"\nbitwise identical over 10 repeats and rows {ROWS}")


def test_decode_on_cuda_runs_the_kernel_every_step(tmp_path):
    cfg = qwen2_moe_config(num_hidden_layers=3)
    folder = write_random_checkpoint(tmp_path / "ckpt", cfg, seed=3, bits=4, group_size=64, dtype=mx.bfloat16)
    model, _ = load(folder)
    assert available_backend() == "cuda"
    runs = {}
    for on in (True, False):
        for counter in model.dispatch_counters():
            counter.reset()
        with fused_moe(on):
            runs[on] = generate(model, [1, 2, 3, 4, 5], 12).token_ids
        for counter in model.dispatch_counters():  # attention and MoE of every layer
            assert counter.fused.get("cuda", 0) == (11 if on else 0), counter
    same = runs[True] == runs[False]
    print(f"\ngreedy tokens fused on {runs[True]}\n             fused off {runs[False]} identical={same}")


def test_compiled_step_writes_the_cache_in_place_and_decodes_as_the_eager_step(tmp_path):
    """The compiled step's kernels store each token's key and value in the static cache themselves (no
    update MLX sees): its tokens equal the eager step's (the same kernels, whose cache MLX updates), and
    its cache holds the eager caches' keys and values, at those slots only."""
    cfg = qwen2_moe_config(num_hidden_layers=3)
    folder = write_random_checkpoint(tmp_path / "ckpt", cfg, seed=5, bits=4, group_size=64, dtype=mx.bfloat16)
    model, _ = load(folder)
    prompt, steps = [1, 2, 3, 4, 5], 40
    with fused_moe(True):
        eager = generate(model, prompt, steps, compiled=False).token_ids
        forward = CompiledForward(model, len(prompt) + steps)
        token, compiled = mx.argmax(forward(mx.array(prompt, dtype=mx.uint32))), []
        for _ in range(steps):
            compiled.append(token.item())
            token = mx.argmax(forward(token.reshape(1).astype(mx.uint32)))
        mx.eval(token)  # the buffers hold a step's keys and values once it has run (MLX sees only reads)
        cache = make_cache(len(model.layers))  # the eager steps over the same tokens, one at a time
        for tokens in [prompt, *([t] for t in compiled)]:
            model.last_logits(mx.array(tokens, dtype=mx.uint32)[None], cache)
    assert compiled == eager
    n, f32 = len(prompt) + steps, lambda a: np.array(a.astype(mx.float32))  # noqa: E731
    for name in ("keys", "values"):
        got = f32(getattr(forward.cache, name))
        want = np.stack([f32(getattr(c, name)[0, :, :n]) for c in cache])
        # the prompt attends through two SDPA paths (a causal mask, the static cache's array mask): bf16
        # roundings apart; one slot left unwritten of 45 is ~0.15, a slot written wrong more
        assert _nrms(got[:, :, :n], want) < 1e-2, name
        assert not got[:, :, n:].any(), f"{name}: the kernels wrote past the tokens' slots"


def _attention_truth(qkv: np.ndarray, bias: np.ndarray | None, p: int, keys: np.ndarray, values: np.ndarray,
                     heads: Heads, base: float) -> np.ndarray:
    """float64 attention of one token over positions 0..p (the new one rotated here, earlier ones cached)."""
    h, kv, hd = heads.n_heads, heads.n_kv_heads, heads.head_dim
    x = qkv.astype(np.float64) + (bias.astype(np.float64) if bias is not None else 0.0)
    inv = base ** (-np.arange(0, hd, 2) / hd)
    c, s = np.cos(p * inv), np.sin(p * inv)

    def rot(a):
        a1, a2 = a[..., : hd // 2], a[..., hd // 2 :]
        return np.concatenate([a1 * c - a2 * s, a2 * c + a1 * s], axis=-1)

    q, k, v = rot(x[: h * hd].reshape(h, hd)), rot(x[h * hd : (h + kv) * hd].reshape(kv, hd)), x[(h + kv) * hd :]
    ks = np.concatenate([keys[0, :, :p].astype(np.float64), k[:, None]], axis=1)  # [KV, p + 1, HD]
    vs = np.concatenate([values[0, :, :p].astype(np.float64), v.reshape(kv, 1, hd)], axis=1)
    group = h // kv
    out = np.empty((h, hd))
    for i in range(h):
        sc = ks[i // group] @ q[i] / np.sqrt(hd)
        w = np.exp(sc - sc.max())
        out[i] = (w / w.sum()) @ vs[i // group]
    return out.reshape(-1)


@pytest.mark.parametrize("heads,bias,p,dtype", [
    (Heads(16, 16, 128), True, 0, mx.bfloat16), (Heads(16, 16, 128), True, 9, mx.bfloat16),
    (Heads(16, 16, 128), True, 191, mx.bfloat16), (Heads(16, 16, 128), False, 255, mx.bfloat16),
    (Heads(32, 4, 128), False, 100, mx.bfloat16), (Heads(8, 8, 64), True, 37, mx.bfloat16),
    (Heads(4, 2, 32), True, 17, mx.bfloat16), (Heads(16, 16, 128), True, 130, mx.float32)])
def test_cuda_attention_kernel_matches_reference_and_truth(heads, bias, p, dtype):
    cap, base = 256, 1_000_000.0
    rng = np.random.default_rng(p + heads.head_dim)
    cast = lambda a: mx.array(a.astype(np.float32)).astype(dtype)  # noqa: E731
    qkv = cast(rng.standard_normal((1, 1, heads.width)))
    b = cast(0.5 * rng.standard_normal(heads.width)) if bias else None
    block = p % 3  # the layer's block of a three-layer cache (as in a StaticCache); the others hold NaN
    caches = []
    for _ in range(2):
        c = np.full((3, heads.n_kv_heads, cap, heads.head_dim), np.nan)
        c[block] = rng.standard_normal(c.shape[1:])
        caches.append(cast(c))
    keys, values = caches
    inv, slots = rope_frequencies(heads.head_dim, base), mx.array([p, cap], dtype=mx.int32)
    out, k_new, v_new = attention_kernel.decode_attention("cuda", qkv, b, inv, slots, keys, values, heads, block)
    with mx.stream(mx.cpu):
        ref = attention_kernel.decode_attention("reference", qkv, b, inv, slots, keys, values, heads, block)
        mx.eval(ref)
    f32 = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
    truth = _attention_truth(f32(qkv).reshape(-1), None if b is None else f32(b), p, f32(keys[block : block + 1]),
                             f32(values[block : block + 1]), heads, base)
    got = {"cuda out vs truth": _nrms(f32(out).reshape(-1), truth),
           "reference out vs truth": _nrms(f32(ref[0]).reshape(-1), truth),
           "cuda vs reference out": _nrms(f32(out), f32(ref[0])),
           "cuda vs reference k_new": _nrms(f32(k_new), f32(ref[1])),
           "cuda vs reference v_new": _nrms(f32(v_new), f32(ref[2]))}
    print(f"\nattention {heads} bias {bias} P {p} block {block} {dtype}: " +
          ", ".join(f"{k} nRMS {v:.2e}" for k, v in got.items()))
    assert max(v for k, v in got.items() if k.startswith("cuda vs")) < 5e-4
    if dtype == mx.float32:  # no rounding between the ops: the bound against the truth itself
        assert got["cuda out vs truth"] < 5e-4
    assert got["cuda out vs truth"] < 1e-2  # bf16 q, k and output roundings, as MLX's own path has
