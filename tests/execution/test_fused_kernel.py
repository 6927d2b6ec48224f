"""The fused decode-MoE arithmetic on the CPU: the 'reference' backend against the float64 truth
(moebench.inspect.truth) and against the gather_qmm fallback, its determinism, the checks that stand
between a bad launch and the process, the rows per threadgroup the GPU launches get, and launch plans that are
reused without keeping weights alive."""

from __future__ import annotations

import gc
import inspect
import math
import weakref
from itertools import product

import mlx.core as mx
import numpy as np
import pytest

from moebench.checkpoint.loader import load
from moebench.decode.loop import generate
from moebench.errors import ConfigError, UnsupportedKernelConfig
from moebench.execution import moe
from moebench.execution.executor import fused_moe
from moebench.execution.kernel import LANES
from moebench.execution.settings import ENV_ROWS
from moebench.execution.support import AFFINE_BITS, GROUP_SIZES, MICROSCALED
from moebench.execution.weights import expert_biases
from moebench.inspect.truth import expert_outputs, f64, nrms
from moebench.models.args import FP_MODES, QuantizedParts
from moebench.models.declare import SIGMOID_GROUPED, TOPK_THEN_SOFTMAX, MoeSpec
from moebench.models.gpt_oss import Experts
from moebench.models.routing import route
from moebench.models.switch import BiasedSwitchLinear, SwitchGLU, weighted_sum


def make_experts(n_exp: int, d: int, dff: int, bits: tuple[int, ...] = (4, 4), group: int = 64, seed: int = 0,
                 scale_dtype: mx.Dtype = mx.float32) -> tuple[QuantizedParts, QuantizedParts, QuantizedParts]:
    """Random gate/up [E, Dff, D] and down [E, D, Dff] experts, affine-quantized at `bits` (gate and up, down) or
    (gate, up, down)."""
    rng = np.random.default_rng(seed)
    parts = []
    widths = bits if len(bits) == 3 else (bits[0], bits[0], bits[1])
    for b, (o, i) in zip(widths, ((dff, d), (dff, d), (d, dff)), strict=True):
        w = mx.array((rng.standard_normal((n_exp, o, i)) / np.sqrt(i)).astype(np.float32))
        q, s, bias = mx.quantize(w, group_size=group, bits=b)
        parts.append(QuantizedParts(q, s.astype(scale_dtype), bias.astype(scale_dtype), group, b, "affine"))
    return tuple(parts)


def make_microscaled(n_exp: int, d: int, dff: int, mode: str, seed: int = 0,
                     dtype: mx.Dtype = mx.float32) -> tuple[QuantizedParts, QuantizedParts, QuantizedParts]:
    """Random gate/up [E, Dff, D] and down [E, D, Dff] experts (weights in `dtype`) quantized in a microscaled
    mode: uint8 scales, no biases."""
    rng = np.random.default_rng(seed)
    group, bits = FP_MODES[mode]
    parts = []
    for o, i in ((dff, d), (dff, d), (d, dff)):
        w = mx.array((rng.standard_normal((n_exp, o, i)) / np.sqrt(i)).astype(np.float32)).astype(dtype)
        parts.append(QuantizedParts(*mx.quantize(w, mode=mode), None, group, bits, mode))
    return tuple(parts)


def truth(x: mx.array, ids: list[int], scores: np.ndarray, parts) -> tuple[np.ndarray, np.ndarray]:
    """float64 unweighted expert outputs y [K, D] and their score-weighted sum [D]."""
    y = expert_outputs(list(parts), f64(x), ids)
    return y, (y * scores.astype(np.float64)[:, None]).sum(axis=0)


def routing(n_exp: int, k: int, seed: int) -> tuple[list[int], np.ndarray]:
    rng = np.random.default_rng(seed)
    return [int(i) for i in rng.choice(n_exp, k, replace=False)], rng.dirichlet(np.ones(k)).astype(np.float32)


# (gate/up bits, down bits) at every affine width, and gate, up and down at three widths of their own
WIDTHS = [*product(AFFINE_BITS, AFFINE_BITS), (3, 4, 6), (8, 2, 5), (6, 3, 3)]


@pytest.mark.parametrize("bits", WIDTHS, ids=str)
@pytest.mark.parametrize("group", GROUP_SIZES)
def test_reference_matches_the_float64_truth_on_small_shapes(bits, group):
    parts = make_experts(6, 256, 128, bits, group, seed=group + 10 * bits[0] + bits[-1])
    ids, scores = routing(6, 3, seed=group)
    x = mx.array(np.random.default_rng(1).standard_normal(256).astype(np.float32))
    out, y, ys = moe.routed("reference", x, mx.array(ids, dtype=mx.uint32), mx.array(scores), *parts)
    truth_y, truth_out = truth(x, ids, scores, parts)
    assert y.dtype == mx.float32 and y.shape == (3, 256) and out.dtype == x.dtype and out.shape == (256,)
    assert ys is None
    assert nrms(y, truth_y) < 5e-4 and nrms(out, truth_out) < 5e-4


REAL_EXPERT_SHAPES = {"qwen1.5-moe-a2.7b": (2048, 1408, 4), "qwen3-30b-a3b": (2048, 768, 8)}  # D, Dff, top-k


@pytest.mark.parametrize("model", sorted(REAL_EXPERT_SHAPES))
@pytest.mark.parametrize("bits,group", [((4, 4), 64), ((8, 8), 128), ((4, 4), 32), ((3, 6), 64), ((3, 3), 64),
                                        ((5, 5), 32), ((2, 6), 128), ((6, 6), 64)])
def test_reference_matches_the_float64_truth_at_real_expert_shapes(model, bits, group):
    """Qwen1.5-MoE-A2.7B (top-4) and Qwen3-30B-A3B (top-8) experts, with 10 experts per stack to stay fast."""
    d, dff, k = REAL_EXPERT_SHAPES[model]
    parts = make_experts(10, d, dff, bits, group, seed=3)
    ids, scores = routing(10, k, seed=4)
    x = mx.array(np.random.default_rng(5).standard_normal(d).astype(np.float32))
    out, y, _ = moe.routed("reference", x, mx.array(ids, dtype=mx.uint32), mx.array(scores), *parts)
    truth_y, truth_out = truth(x, ids, scores, parts)
    assert nrms(y, truth_y) < 5e-4 and nrms(out, truth_out) < 5e-4


@pytest.mark.parametrize("mode", MICROSCALED)
@pytest.mark.parametrize("model", sorted(REAL_EXPERT_SHAPES))
def test_reference_matches_the_float64_truth_in_the_microscaled_modes(mode, model):
    """mxfp4, nvfp4 and mxfp8 experts at real expert shapes, in the bounds the affine kernels meet."""
    d, dff, k = REAL_EXPERT_SHAPES[model]
    parts = make_microscaled(k + 2, d, dff, mode, seed=21)
    assert parts[0].scales.dtype == mx.uint8 and parts[0].biases is None
    ids, scores = routing(k + 2, k, seed=22)
    x = mx.array(np.random.default_rng(23).standard_normal(d).astype(np.float32))
    out, y, _ = moe.routed("reference", x, mx.array(ids, dtype=mx.uint32), mx.array(scores), *parts)
    truth_y, truth_out = truth(x, ids, scores, parts)
    assert nrms(y, truth_y) < 5e-4 and nrms(out, truth_out) < 5e-4


@pytest.mark.parametrize("mode", MICROSCALED)
def test_microscaled_shared_expert_and_residual_inside_the_pair_match_the_truth(mode):
    parts = make_microscaled(6, 256, 128, mode, seed=24)
    shared_parts = [QuantizedParts(p.weight[0], p.scales[0], None, p.group_size, p.bits, p.mode)
                    for p in make_microscaled(1, 256, 384, mode, seed=25)]
    ids, scores = routing(6, 3, seed=24)
    rng = np.random.default_rng(24)
    x, resid = (mx.array(rng.standard_normal(256).astype(np.float32)) for _ in range(2))
    shared = moe.SharedExpert(*shared_parts, mx.array([0.3], mx.float32))
    out, y, ys = moe.routed("reference", x, mx.array(ids, dtype=mx.uint32), mx.array(scores), *parts, shared, resid)
    truth_y, truth_routed = truth(x, ids, scores, parts)
    truth_ys = expert_outputs(shared_parts, f64(x))
    assert nrms(y, truth_y) < 5e-4 and nrms(ys, truth_ys) < 5e-4
    assert nrms(out, f64(resid) + truth_routed + 0.3 * truth_ys) < 5e-4


@pytest.mark.parametrize("mode", MICROSCALED)
def test_fused_is_no_farther_from_truth_than_the_fallback_in_bfloat16_microscaled(mode):
    parts = make_microscaled(8, 256, 128, mode, seed=26, dtype=mx.bfloat16)
    ids, scores = routing(8, 4, seed=27)
    x = mx.array(np.random.default_rng(28).standard_normal(256).astype(np.float32)).astype(mx.bfloat16)
    idx, sc = mx.array(ids, dtype=mx.uint32), mx.array(scores)
    out, _, _ = moe.routed("reference", x, idx, sc, *parts)
    fallback = weighted_sum(SwitchGLU.from_parts(*parts)(x[None], idx[None]), sc[None])[0]
    _, truth_out = truth(x, ids, scores, parts)
    fused_err, fallback_err = nrms(f64(out), truth_out), nrms(f64(fallback), truth_out)
    assert out.dtype == mx.bfloat16
    assert fused_err <= fallback_err, f"fused nRMS {fused_err:.2e} vs fallback {fallback_err:.2e}"


def make_biases(n_exp: int, d: int, dff: int, seed: int, dtype: mx.Dtype = mx.float32) -> tuple[mx.array, ...]:
    """Random expert biases gate and up [E, Dff], down [E, D], about as large as the projections' outputs."""
    rng = np.random.default_rng(seed)
    return tuple(mx.array(rng.standard_normal((n_exp, n)).astype(np.float32)).astype(dtype) for n in (dff, dff, d))


def variant_experts(fmt: str, n_exp: int, d: int, dff: int, seed: int, dtype: mx.Dtype = mx.float32):
    """gate/up/down in `fmt`: 'affine4' (4-bit g32), 'affine8' (8-bit g64) or a microscaled mode."""
    if fmt.startswith("affine"):
        bits = int(fmt.removeprefix("affine"))
        return make_experts(n_exp, d, dff, (bits, bits), 32 if bits == 4 else 64, seed, scale_dtype=dtype)
    return make_microscaled(n_exp, d, dff, fmt, seed, dtype)


VARIANT_FORMATS = ("affine4", "affine8", *MICROSCALED)
CLAMP = (1.0, 1.702)  # gpt-oss's alpha; a limit that bites on these activations (gpt-oss's is 7.0)
# (biases, clamp): each variant alone and together
VARIANTS = [(True, None), (False, CLAMP), (True, CLAMP)]


@pytest.mark.parametrize("biased,clamp", VARIANTS, ids=["biases", "clamp", "biases+clamp"])
@pytest.mark.parametrize("fmt", VARIANT_FORMATS)
def test_expert_variants_match_the_float64_truth(fmt, biased, clamp):
    """Expert biases on gate, up and down and the clamped SwiGLU, in every format the pair reads, in the bounds
    the affine kernels meet; the clamp really bites, and the down bias is in each unweighted y_k."""
    d, dff, k = 256, 192, 4
    parts = variant_experts(fmt, k + 2, d, dff, seed=40)
    variant = moe.ExpertVariant(make_biases(k + 2, d, dff, seed=41) if biased else None, clamp)
    ids, scores = routing(k + 2, k, seed=42)
    x = mx.array(np.random.default_rng(43).standard_normal(d).astype(np.float32))
    out, y, _ = moe.routed("reference", x, mx.array(ids, dtype=mx.uint32), mx.array(scores), *parts,
                           variant=variant)
    truth_y = expert_outputs(list(parts), f64(x), ids, variant)
    truth_out = (truth_y * scores.astype(np.float64)[:, None]).sum(axis=0)
    assert nrms(y, truth_y) < 5e-4 and nrms(out, truth_out) < 5e-4
    plain = expert_outputs(list(parts), f64(x), ids, moe.ExpertVariant(variant.biases, None))
    assert (clamp is None) == (nrms(truth_y, plain) < 1e-12), "the clamp must change these outputs"


def test_expert_variants_at_gpt_oss_20b_expert_shapes_match_the_truth():
    """gpt-oss-20b's experts (D 2880, Dff 2880, top-4) in mxfp4 as published, biases and the clamp at 7.0."""
    d = dff = 2880
    parts = make_microscaled(6, d, dff, "mxfp4", seed=44)
    variant = moe.ExpertVariant(make_biases(6, d, dff, seed=45), (7.0, 1.702))
    ids, scores = routing(6, 4, seed=46)
    x = mx.array(np.random.default_rng(47).standard_normal(d).astype(np.float32))
    out, y, _ = moe.routed("reference", x, mx.array(ids, dtype=mx.uint32), mx.array(scores), *parts,
                           variant=variant)
    truth_y = expert_outputs(list(parts), f64(x), ids, variant)
    assert nrms(y, truth_y) < 5e-4 and nrms(out, (truth_y * scores[:, None]).sum(axis=0)) < 5e-4


@pytest.mark.parametrize("fmt", ("affine4", "mxfp4"))
def test_fused_variant_matches_the_biased_clamped_fallback(fmt):
    """The fused reference and the fallback (gather_qmm with bias adds and the family's clamped SwiGLU) agree
    on gpt-oss experts: routed_experts reads the variant from what the experts hold."""
    d, dff, n_exp = 256, 192, 6
    parts = variant_experts(fmt, n_exp, d, dff, seed=48)
    experts = Experts(d, dff, n_exp, *CLAMP)
    for proj, p, b in zip((experts.gate_proj, experts.up_proj, experts.down_proj), parts,
                          make_biases(n_exp, d, dff, seed=49), strict=True):
        proj.set_weight(p.weight, p)
        proj.bias = b
    ids, scores = routing(n_exp, 4, seed=50)
    x = mx.array(np.random.default_rng(51).standard_normal((1, d)).astype(np.float32))
    idx, sc = mx.array([ids], dtype=mx.uint32), mx.array(scores[None])
    fused_out, fused_y = moe.routed_experts("reference", experts, x, idx, sc)
    fb_out, fb_y = moe.routed_experts("fallback", experts, x, idx, sc)
    assert nrms(fused_y, f64(fb_y)) < 1e-5 and nrms(fused_out, f64(fb_out)) < 1e-5


def test_expert_variants_the_pair_cannot_take_raise_named_errors():
    parts = make_experts(4, 128, 64, seed=52)
    biases = make_biases(4, 128, 64, seed=53)
    idx, sc, x = mx.array([0, 1], dtype=mx.uint32), mx.array([0.5, 0.5]), mx.zeros((128,))
    one = [QuantizedParts(p.weight[0], p.scales[0], p.biases[0], p.group_size, p.bits, p.mode) for p in parts]
    bad = {
        r"down expert bias is \(4, 64\)": moe.ExpertVariant((biases[0], biases[1], biases[0]), None),
        r"gate expert bias is \(4, 64\) mlx.core.int32": moe.ExpertVariant(
            (biases[0].astype(mx.int32), *biases[1:]), None),
        "clamped SwiGLU limit 0.0": moe.ExpertVariant(None, (0.0, 1.0)),
        "clamped SwiGLU limit 1.0 and alpha nan": moe.ExpertVariant(None, (1.0, math.nan)),
    }
    for message, variant in bad.items():
        with pytest.raises(UnsupportedKernelConfig, match=message):
            moe.routed("reference", x, idx, sc, *parts, variant=variant)
        with pytest.raises(UnsupportedKernelConfig, match=message):
            moe.gpu_routed("metal", x, idx, sc, *parts, variant=variant)
    with pytest.raises(UnsupportedKernelConfig, match="shared expert beside clamped-SwiGLU experts"):
        moe.routed("reference", x, idx, sc, *parts, moe.SharedExpert(*one, mx.array([0.5])),
                   variant=moe.ExpertVariant(None, CLAMP))


def test_biases_on_some_expert_projections_only_are_refused():
    """The pair adds all three biases or none: experts biased on some projections only would lose the others."""
    gate, down = BiasedSwitchLinear(8, 4, 2), BiasedSwitchLinear(4, 8, 2)
    up = SwitchGLU(8, 4, 2).up_proj
    with pytest.raises(UnsupportedKernelConfig, match=r"some projections only \(up_proj without\)"):
        expert_biases(gate, up, down)
    assert expert_biases(up, up, up) is None
    assert [b.shape for b in expert_biases(gate, gate, down)] == [(2, 4), (2, 4), (2, 8)]


def test_top_k_then_softmax_routing_matches_the_float64_truth_and_what_route_records():
    """The router's TOPK_THEN_SOFTMAX variant: the top-k logits (highest first), scored by the softmax over those
    k in float64's bounds; probs the softmax over all experts, as moebench.models.routing.route records it for
    the fallback, whose renormalised top-k probabilities are the same scores."""
    for n_exp, k in ((32, 4), (128, 4), (60, 8)):
        logits = mx.array(3 * np.random.default_rng(n_exp).standard_normal((1, n_exp)).astype(np.float32))
        probs, inds, scores, _ = moe.select("reference", logits, n_exp, k, False, False, TOPK_THEN_SOFTMAX)
        l64 = f64(logits)[0]
        want = np.argsort(-l64, kind="stable")[:k]
        assert np.array(inds)[0].tolist() == want.tolist()
        e = np.exp(l64[want] - l64[want].max())
        assert np.abs(np.array(scores)[0] - e / e.sum()).max() < 1e-6
        spec = MoeSpec(n_exp, k, TOPK_THEN_SOFTMAX, renormalize=True)
        route_probs, route_ids, route_scores = route(logits, spec, ordered=True)
        assert np.array_equal(np.array(probs), np.array(route_probs))
        assert np.array(route_ids).tolist() == np.array(inds).tolist()
        assert np.abs(np.array(route_scores) - np.array(scores)).max() < 1e-6


def grouped_route_f64(logits: np.ndarray, bias: np.ndarray, top_k: int, n_group: int, keep: int, renormalize: bool,
                      scaling: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """SIGMOID_GROUPED from its definition in float64 (transformers' DeepseekV3 / Glm4Moe routing): sigmoid scores;
    choice values score + bias; groups ranked by their two best choice values, the best `keep` kept and the others'
    experts out of the choice; the top-k choice values (highest first, the lower id on a tie); weights the unbiased
    scores, renormalised when asked, times the scaling. -> (scores [E], ids [K], weights [K])."""
    scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + bias
    groups = choice.reshape(n_group, -1)
    ranks = np.sort(groups, axis=-1)[:, -2:].sum(axis=-1)
    kept = np.zeros(n_group, bool)
    kept[np.argsort(-ranks, kind="stable")[:keep]] = True
    choice = np.where(kept[:, None], groups, -np.inf).reshape(-1)
    ids = np.argsort(-choice, kind="stable")[:top_k]
    weights = scores[ids] / (scores[ids].sum() if renormalize else 1.0)
    return scores, ids, weights * scaling


# (E, K, groups, kept groups, scaling, renormalise): Kimi-K2's, DeepSeek-V3's, GLM-4.5's and GLM-4.5-Air's routers,
# and one not renormalised
GROUPED_ROUTERS = [(384, 8, 1, 1, 2.827, True), (256, 8, 8, 4, 2.5, True), (160, 8, 1, 1, 2.5, True),
                   (128, 8, 1, 1, 1.0, True), (64, 6, 8, 2, 1.5, False)]


@pytest.mark.parametrize("n_exp,k,n_group,keep,scaling,norm", GROUPED_ROUTERS)
def test_grouped_routing_matches_the_float64_truth_and_route(n_exp, k, n_group, keep, scaling, norm):
    """The router kernel's SIGMOID_GROUPED arithmetic (the reference backend) against its float64 definition (ids in
    order, scores and weights within float32 rounding) and against what route records for the fallback (the same
    experts, each with the same weight)."""
    rng = np.random.default_rng(n_exp + n_group)
    logits = rng.standard_normal((1, n_exp)).astype(np.float32)
    bias = (0.3 * rng.standard_normal(n_exp)).astype(np.float32)
    grouped = moe.GroupedChoice(mx.array(bias), n_group, keep, scaling)
    probs, inds, scores, gate = moe.select("reference", mx.array(logits), n_exp, k, norm, False, SIGMOID_GROUPED,
                                           grouped)
    want_probs, want_ids, want_weights = grouped_route_f64(logits[0].astype(np.float64), bias.astype(np.float64), k,
                                                           n_group, keep, norm, scaling)
    assert np.array(inds)[0].tolist() == want_ids.tolist()
    assert np.abs(np.array(probs)[0] - want_probs).max() < 1e-6
    assert np.abs(np.array(scores)[0] - want_weights).max() < 1e-6 * scaling
    assert np.array(gate).tolist() == [[0.0]]
    spec = MoeSpec(n_exp, k, SIGMOID_GROUPED, norm, selection_bias=True, n_group=n_group, topk_group=keep,
                   routed_scaling=scaling)
    route_probs, route_ids, route_scores = route(mx.array(logits), spec, selection_bias=mx.array(bias))
    assert np.array_equal(np.array(route_probs), np.array(probs))
    by_id = dict(zip(np.array(route_ids)[0].tolist(), np.array(route_scores)[0].tolist(), strict=True))
    assert set(by_id) == set(np.array(inds)[0].tolist())
    assert max(abs(by_id[i] - w) for i, w in zip(np.array(inds)[0].tolist(), np.array(scores)[0].tolist(),
                                                   strict=True)) < 1e-6 * scaling


@pytest.mark.parametrize("preset", ["glm4-moe-tiny", "deepseek-v3-tiny"])
def test_the_router_kernel_chooses_for_glm_and_deepseek_blocks_as_route_does(tmp_path, preset):
    """A GLM-4.x MoE and a DeepSeek-V3 block's router (4 groups, the best 2 kept, its stored selection bias), given
    to the router kernel as a decode step gives it (GroupedChoice.of(spec, parts.selection_bias)): the experts route
    chooses, each with route's weight, and route's probabilities."""
    from moebench.tools.presets import write_random

    model, _ = load(write_random(tmp_path / preset, preset, bits=4, group_size=64, dtype="float32", seed=3,
                                 progress=False))
    rng = np.random.default_rng(5)
    for block in model.moe_blocks().values():
        spec, parts = block.spec, block.parts()
        assert spec.scoring == SIGMOID_GROUPED and spec.n_group > spec.topk_group and parts.selection_bias is not None
        logits = parts.router(mx.array(rng.standard_normal((1, model.args.hidden_size)).astype(np.float32)))
        probs, inds, scores, _ = moe.select("reference", logits, spec.num_experts, spec.top_k, spec.renormalize, False,
                                            spec.scoring, moe.GroupedChoice.of(spec, parts.selection_bias))
        route_probs, route_ids, route_scores = route(logits, spec, selection_bias=parts.selection_bias)
        assert np.array_equal(np.array(probs), np.array(route_probs))
        by_id = dict(zip(np.array(route_ids)[0].tolist(), np.array(route_scores)[0].tolist(), strict=True))
        assert set(by_id) == set(np.array(inds)[0].tolist())
        assert max(abs(by_id[i] - w) for i, w in zip(np.array(inds)[0].tolist(), np.array(scores)[0].tolist(),
                                                       strict=True)) < 1e-6 * spec.routed_scaling


def test_router_calls_the_kernel_cannot_take_raise_named_errors():
    """The grouped choice goes with SIGMOID_GROUPED and no other scoring, with a selection bias of [E] floats and
    groups the router kernel ranks; on the reference and on a GPU backend alike, before any launch."""
    logits = mx.zeros((1, 128))
    bias = mx.zeros((128,))
    bad = {
        "without a GroupedChoice": (SIGMOID_GROUPED, None),
        "with a GroupedChoice": (TOPK_THEN_SOFTMAX, moe.GroupedChoice(bias)),
        r"selection bias \(127,\)": (SIGMOID_GROUPED, moe.GroupedChoice(bias[:127])),
        "selection bias .*int32": (SIGMOID_GROUPED, moe.GroupedChoice(bias.astype(mx.int32))),
        "groups must divide the experts": (SIGMOID_GROUPED, moe.GroupedChoice(bias, 5, 1)),
        "64 expert groups .*ranks up to 32": (SIGMOID_GROUPED, moe.GroupedChoice(bias, 64, 2)),
    }
    moe.select("reference", logits, 128, 4, True, False, SIGMOID_GROUPED, moe.GroupedChoice(bias, 8, 2, 2.5))
    for message, (scoring, grouped) in bad.items():
        for backend in ("reference", "metal"):
            with pytest.raises(UnsupportedKernelConfig, match=message):
                moe.select(backend, logits, 128, 4, True, False, scoring, grouped)


def test_shared_expert_and_residual_inside_the_pair_match_the_truth():
    """out = residual + sum_k s_k y_k + gate * ys, with the unweighted ys handed back; leading axes kept."""
    parts = make_experts(6, 256, 128, seed=13)
    shared_parts = [QuantizedParts(p.weight[0], p.scales[0], p.biases[0], p.group_size, p.bits, p.mode)
                    for p in make_experts(1, 256, 384, seed=14)]
    ids, scores = routing(6, 3, seed=13)
    rng = np.random.default_rng(13)
    x, resid = (mx.array(rng.standard_normal((1, 1, 256)).astype(np.float32)) for _ in range(2))
    shared = moe.SharedExpert(*shared_parts, mx.array([[[0.3]]], mx.float32))
    idx, sc = mx.array(ids, dtype=mx.uint32)[None, None], mx.array(scores)[None, None]
    out, y, ys = moe.routed("reference", x, idx, sc, *parts, shared, resid)
    assert out.shape == ys.shape == (1, 1, 256) and y.shape == (1, 1, 3, 256)
    truth_y, truth_routed = truth(x[0, 0], ids, scores, parts)
    truth_ys = expert_outputs(shared_parts, f64(x[0, 0]))
    assert nrms(y[0, 0], truth_y) < 5e-4 and nrms(ys[0, 0], truth_ys) < 5e-4
    assert nrms(out[0, 0], f64(resid[0, 0]) + truth_routed + 0.3 * truth_ys) < 5e-4


def test_fused_is_no_farther_from_truth_than_the_fallback_in_bfloat16():
    """bfloat16 activations and scales (as on a GPU): the fused path rounds once, gather_qmm all along."""
    parts = make_experts(8, 256, 128, (4, 4), 64, seed=6, scale_dtype=mx.bfloat16)
    ids, scores = routing(8, 4, seed=7)
    x = mx.array(np.random.default_rng(8).standard_normal(256).astype(np.float32)).astype(mx.bfloat16)
    idx, sc = mx.array(ids, dtype=mx.uint32), mx.array(scores)
    out, _, _ = moe.routed("reference", x, idx, sc, *parts)
    fallback = weighted_sum(SwitchGLU.from_parts(*parts)(x[None], idx[None]), sc[None])[0]
    _, truth_out = truth(x, ids, scores, parts)
    fused_err, fallback_err = nrms(f64(out), truth_out), nrms(f64(fallback), truth_out)
    assert out.dtype == mx.bfloat16
    assert fused_err <= fallback_err, f"fused nRMS {fused_err:.2e} vs fallback {fallback_err:.2e}"


def test_reference_is_bitwise_deterministic():
    parts = make_experts(6, 256, 128, seed=9)
    ids, scores = routing(6, 3, seed=9)
    x = mx.array(np.random.default_rng(9).standard_normal(256).astype(np.float32))
    args = (x, mx.array(ids, dtype=mx.uint32), mx.array(scores), *parts)
    first = [np.array(a) for a in moe.routed("reference", *args)[:2]]
    for _ in range(5):
        again = [np.array(a) for a in moe.routed("reference", *args)[:2]]
        assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


def _bad_calls(parts):
    """(message, routed's arguments after the backend) for inputs the kernel pair must never be launched on;
    the first is a good call, and each bad one differs from it in one respect."""
    idx, sc, x = mx.array([0, 1], dtype=mx.uint32), mx.array([0.5, 0.5]), mx.zeros((128,))
    one = [QuantizedParts(p.weight[0], p.scales[0], p.biases[0], p.group_size, p.bits, p.mode) for p in parts]
    gate = mx.array([0.5])
    g = parts[0]
    short_scales = QuantizedParts(g.weight, g.scales[..., :1], g.biases[..., :1], g.group_size, g.bits, g.mode)
    one_bit = [QuantizedParts(*mx.quantize(mx.zeros(shape), group_size=64, bits=1), 64, 1, "affine")
               for shape in ((4, 64, 128), (4, 64, 128), (4, 128, 64))]
    # 4-bit down rows read as 3-bit: 8 words are 64 values of 4 bits, 85.3 of 3
    misread = QuantizedParts(*mx.quantize(mx.zeros((4, 128, 64)), group_size=64, bits=4), 64, 3, "affine")
    return {
        None: (x, idx, sc, *parts, moe.SharedExpert(*one, gate), x),
        "one token": (mx.zeros((2, 128)), idx, sc, *parts),
        r"must both be \[K\]": (x, idx, mx.array([1.0]), *parts),
        "down experts": (x, idx, sc, parts[0], parts[1], parts[0]),
        "indices must be integers": (x, sc, sc, *parts),
        "residual": (x, idx, sc, *parts, None, x.astype(mx.bfloat16)),
        "shared expert gate is": (x, idx, sc, *parts, moe.SharedExpert(*parts, gate)),  # stacks, not one expert
        "shared expert gate has shape": (x, idx, sc, *parts, moe.SharedExpert(*one, gate[None])),
        "do not fit packed weights": (x, idx, sc, short_scales, parts[1], parts[2]),  # reads out of bounds
        "gate bits 1 not in": (x, idx, sc, *one_bit),
        "packed rows of 8 words do not hold whole groups of 64 3-bit values": (x, idx, sc, *parts[:2], misread),
    }


def _microscaled_bad_calls():
    """(message, routed's arguments after the backend) for microscaled experts the pair cannot read; the first
    is a good call."""
    idx, sc, x = mx.array([0, 1], dtype=mx.uint32), mx.array([0.5, 0.5]), mx.zeros((128,))
    fp4 = make_microscaled(4, 128, 64, "mxfp4", seed=30)
    g = fp4[0]
    nv = make_microscaled(4, 128, 64, "nvfp4", seed=31)
    as_nvfp4_group = QuantizedParts(g.weight, g.scales, None, 16, 4, "mxfp4")  # MLX's mxfp4 groups are 32
    with_biases = QuantizedParts(g.weight, g.scales, g.scales.astype(mx.float32), 32, 4, "mxfp4")
    float_scales = QuantizedParts(g.weight, g.scales.astype(mx.float32), None, 32, 4, "mxfp4")
    affine = make_experts(4, 128, 64, seed=32)
    return {
        None: (x, idx, sc, *fp4),
        r"quantization modes differ \['affine', 'mxfp4'\]": (x, idx, sc, fp4[0], fp4[1], affine[2]),
        r"quantization modes differ \['mxfp4', 'nvfp4'\]": (x, idx, sc, *fp4[:2], nv[2]),
        r"gate is mxfp4 at 4 bits, group 16 \(mxfp4 is 4 bits, group 32\)": (x, idx, sc, as_nvfp4_group, *fp4[1:]),
        "gate is mxfp4 with biases": (x, idx, sc, with_biases, *fp4[1:]),
        "gate is mxfp4 with float32 scales": (x, idx, sc, float_scales, *fp4[1:]),
    }


def test_microscaled_experts_the_pair_cannot_read_raise_named_errors():
    calls = _microscaled_bad_calls()
    moe.routed("reference", *calls.pop(None))
    for message, args in calls.items():
        with pytest.raises(UnsupportedKernelConfig, match=message):
            moe.routed("reference", *args)
        with pytest.raises(UnsupportedKernelConfig, match=message):
            moe.gpu_routed("metal", *args)


def test_bad_inputs_raise_named_errors_before_any_launch():
    """On the reference and on a GPU backend alike (where a bad launch would abort the process), after a good
    call of nearly the same inputs, and every time: a failed check is never remembered as passed."""
    parts = make_experts(4, 128, 64, seed=10)
    calls = _bad_calls(parts)
    moe.routed("reference", *calls.pop(None))
    for message, args in calls.items():
        for _ in range(2):
            with pytest.raises(UnsupportedKernelConfig, match=message):
                moe.routed("reference", *args)
            with pytest.raises(UnsupportedKernelConfig, match=message):  # not "not available": checked first
                moe.gpu_routed("metal", *args)
    with pytest.raises(UnsupportedKernelConfig, match="unknown fused backend"):
        moe.routed("rocm", mx.zeros((128,)), mx.array([0, 1], dtype=mx.uint32), mx.array([0.5, 0.5]), *parts)


@pytest.mark.parametrize("rows", [0, moe.MAX_ROWS + 1, -1])
def test_rows_per_threadgroup_outside_the_kernels_range_is_a_config_error(rows):
    parts = make_experts(4, 128, 64, seed=10)
    args = (mx.zeros((128,)), mx.array([0, 1], dtype=mx.uint32), mx.array([0.5, 0.5]), *parts)
    with pytest.raises(ConfigError, match=f"rows per threadgroup {rows}"):
        moe.routed("reference", *args, rows=rows)
    with pytest.raises(ConfigError, match=f"rows per threadgroup {rows}"):
        moe.gpu_routed("metal", *args, rows=rows)


def test_gpu_backend_without_its_runtime_says_so():
    parts = make_experts(4, 128, 64, seed=11)
    backend = "cuda" if not mx.cuda.is_available() else "metal"
    with pytest.raises(UnsupportedKernelConfig, match="not available"):
        moe.gpu_routed(backend, mx.zeros((128,)), mx.array([0, 1], dtype=mx.uint32), mx.array([0.5, 0.5]), *parts)


@pytest.mark.parametrize("rows", [1, 3, moe.DEFAULT_ROWS, moe.MAX_ROWS])
def test_gpu_launches_take_the_rows_asked_for(monkeypatch, rows):
    """Both kernels of the pair run threadgroups of `rows` simdgroups over grids rounded up to them; the outputs
    keep x's leading axes (a decode step's [1, 1, D])."""
    seen = {}

    def launch(stage, output_shapes, output_dtypes, **kwargs):
        seen[stage] = kwargs["grid"], kwargs["threadgroup"]
        return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes, strict=True)]

    monkeypatch.setattr(moe, "built_kernel", lambda backend, stage: lambda **kw: launch(stage, **kw))
    parts = make_experts(4, 128, 64, seed=12, scale_dtype=mx.bfloat16)
    x, idx, sc = mx.zeros((1, 1, 128), mx.bfloat16), mx.array([[[0, 1]]], dtype=mx.uint32), mx.array([[[0.5, 0.5]]])
    out, y, ys = moe.gpu_routed("metal", x, idx, sc, *parts, rows=rows)
    assert out.shape == (1, 1, 128) and out.dtype == mx.bfloat16 and y.shape == (1, 1, 2, 128) and ys is None
    assert seen == {moe.GATE_UP: ((LANES, math.ceil(2 * 64 / rows) * rows, 1), (LANES, rows, 1)),  # K * Dff rows
                    moe.DOWN: ((LANES, math.ceil(128 / rows) * rows, 1), (LANES, rows, 1))}  # D rows


def test_launch_plans_are_reused_per_shape_and_never_keep_weights_alive(monkeypatch):
    """A decode repeats one signature per layer: its launch geometry is worked out once and reused, and neither
    it nor the input checks remembered as passed hold on to a layer's weights."""
    monkeypatch.setattr(moe, "built_kernel", lambda backend, stage: lambda *, output_shapes, output_dtypes, **_: [
        mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes, strict=True)])
    parts = make_experts(4, 128, 64, seed=12, scale_dtype=mx.bfloat16)
    x, idx, sc = mx.zeros((1, 1, 128), mx.bfloat16), mx.array([[[0, 1]]], dtype=mx.uint32), mx.array([[[0.5, 0.5]]])
    moe._pair_launch.cache_clear()
    for _ in range(3):
        moe.gpu_routed("metal", x, idx, sc, *parts, rows=8)
    moe.gpu_routed("metal", x, idx, sc, *make_experts(4, 128, 64, seed=13, scale_dtype=mx.bfloat16), rows=8)
    info = moe._pair_launch.cache_info()
    assert (info.misses, info.hits) == (1, 3)  # other weights of the same shapes: the same plan
    watch = weakref.ref(parts[0])
    del parts
    gc.collect()
    assert watch() is None, "a launch plan or a passed check kept a layer's weights alive"


def test_the_rows_variable_reaches_every_fused_moe_launch_of_a_decode(quantized_checkpoint, monkeypatch):
    """MOEBENCH_FUSED_MOE_ROWS, read when the model's kernel settings are made, is what each fused MoE step
    launches with."""
    monkeypatch.setenv(ENV_ROWS, "3")
    model, _ = load(quantized_checkpoint)
    asked = []
    real, signature = moe.routed_by_router, inspect.signature(moe.routed_by_router)

    def routed_by_router(*args, **kwargs):
        asked.append(signature.bind(*args, **kwargs).arguments.get("rows", "the default"))
        return real(*args, **kwargs)

    monkeypatch.setattr(moe, "routed_by_router", routed_by_router)
    with fused_moe(True, model):
        generate(model, [3, 1, 4], 3, compiled=False)  # the prefill falls back, two decode steps fused
    assert len(asked) == 2 * len(model.moe_blocks()) and set(asked) == {3}
