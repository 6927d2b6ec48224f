"""moebench selfcheck: one command that checks the fused decode-MoE kernel on the machine it runs on.

Reports the platform; runs the fused kernel on this machine's backend (metal, cuda, or the CPU
'reference', named as such) against the CPU-reference arithmetic and a float64 truth at
Qwen1.5-MoE-A2.7B's expert shapes and the model's own, for every supported affine bits / group-size
combination and each microscaled mode (mxfp4, nvfp4, mxfp8), with gpt-oss's expert variants (biases and the
clamped SwiGLU) in each format, and with the shared expert inside the kernel pair; checks the router kernel
(both scorings), the decode-attention kernel against the reference and a float64 truth (with each of the model's
attention declarations: partial rotary, output gate, window, sinks, scaled rotary), a hybrid's Gated DeltaNet step
kernel likewise; checks bitwise determinism; decodes the model greedily with the kernels on and off (bench's timing
code) to check dispatch (MoE, attention and linear-attention layers), greedy parity and speed. Exits 1 when a check
fails.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import chain, groupby, product
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..checkpoint.loader import default_model_path, load
from ..checkpoint.weights import nonfinite_weights
from ..execution import attention, linear_attention, moe, support
from ..execution import rows as rows_kernel
from ..execution.attention import rope_frequencies
from ..execution.kernel import available_backend
from ..execution.linear_attention import GatedDeltaWeights
from ..execution.moe import ExpertVariant, SharedExpert
from ..execution.steps import rotary
from ..execution.support import AFFINE_BITS, GROUP_SIZES, MICROSCALED
from ..inspect.truth import attention_f64, e8m0, expert_outputs, f64, gated_delta_f64, minifloat, nmax, nrms
from ..models.args import FP_MODES, QuantizedParts
from ..models.declare import (
    PER_HEAD,
    SIGMOID_GROUPED,
    SOFTMAX_THEN_TOPK,
    TOPK_THEN_SOFTMAX,
    AttentionSpec,
    LinearAttentionSpec,
)
from ..models.gpt_oss import Experts as ClampedExperts
from ..models.qwen2_moe import MLP
from ..models.run import token_mixer
from ..models.switch import SwitchGLU, weighted_sum
from .bench import compare_traces, moebench_arms, platform_info, prompt_token_ids, reference_arm, run_arms, summary
from .bench_table import spread
from .flags import at_least
from .json_option import add_json_option, check_json_target, report
from .progress import Progress
from .text_table import fitted, markdown_table

SCHEMA = "moebench.tools.selfcheck/1"
FUSED_NRMS = 5e-4  # fused vs float truth (and vs the CPU reference): the parity class of the fused kernel
FUSED_NMAX = 2e-2
FALLBACK_NRMS = 5e-2  # gather_qmm vs truth is ~1e-2; beyond this MLX's own path is broken
CLEAR_DIVERGENCE = 1.0  # nats: a greedy flip with a larger reference margin is no near-tie
DETERMINISM_RUNS = {"reference": 2}  # per backend, default 5: GPU runs are cheap, the CPU reference is not
A27B_SHAPE = ("Qwen1.5-MoE-A2.7B experts", 2048, 1408, 4)  # name, D, Dff, K
A27B_SHARED = 5632  # its shared expert's width
ROUTER_TOLERANCE = 1e-5  # probabilities, scores and the sigmoid gate, router kernel vs CPU reference
A27B_HEADS = AttentionSpec(16, 16, 128, qkv_bias=True)  # its attention: 16 heads of 128, q/k/v biases
QWEN3_HEADS = AttentionSpec(32, 4, 128, qk_norm=PER_HEAD)  # Qwen3-30B-A3B's, which normalises each head of q and k
# (position, cache slots): the first token, a block boundary of the kernel, deep in a short cache (one
# threadgroup a head); in a long one (several a head, their partials joined), early and deep
ATTENTION_CASES = ((0, 256), (8, 256), (200, 256), (600, 4352), (4000, 4352))
GATED_DELTA_F32 = 1e-5  # gated delta step in float32: vs the float64 truth and vs the reference (a few ulps)
GATED_DELTA_ROUNDED = 2e-2  # in bfloat16 / float16: the reference vs the truth (it rounds where the model rounds)
GATED_DELTA_VS_REFERENCE = 2**-7  # in bfloat16 / float16: a kernel vs the reference on its device (flipped last bits)


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    width: int
    top_k: int

    @property
    def experts(self) -> int:
        """Only the K selected experts are read: one more than K keeps the gather honest and the check fast."""
        return self.top_k + 1


def same_bits(a: mx.array, b: mx.array) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included)."""
    as_uint = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.itemsize]
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a.view(as_uint), b.view(as_uint)))


def truth_outputs(x: mx.array, indices: mx.array, scores: mx.array, gate: QuantizedParts, up: QuantizedParts,
                  down: QuantizedParts, shared: SharedExpert | None = None,
                  variant: ExpertVariant | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(weighted sum [D] (+ the gated shared expert), unweighted y [K, D]) in float64 (moebench.inspect.truth):
    independent of both MLX paths' arithmetic."""
    xv = f64(x)
    y = expert_outputs([gate, up, down], xv, np.array(indices).tolist(), variant)
    out = (y * f64(scores)[:, None]).sum(axis=0)
    if shared is not None:
        out = out + f64(shared.sigmoid_gate)[0] * expert_outputs([shared.gate, shared.up, shared.down], xv)
    return out, y


def random_parts(key: mx.array, experts: int, out_features: int, in_features: int, bits: int, group_size: int,
                 dtype: mx.Dtype) -> QuantizedParts:
    """Random packed codes with per-group scales and biases (what the kernel reads; no float model to quantize,
    which on a CPU costs more than the check): dequantized values uniform in about +-1/sqrt(in_features)."""
    k_codes, k_scales = mx.random.split(key)
    levels = 2**bits - 1
    halves = mx.random.randint(0, 1 << 16, (experts, out_features, in_features * bits // 32, 2), mx.uint32,
                               key=k_codes)  # 16 random bits each: randint is exact only below 2**24
    codes = halves[..., 0] | (halves[..., 1] << 16)
    spread = mx.random.uniform(0.5, 1.5, (experts, out_features, in_features // group_size), key=k_scales)
    scales = (spread * 2 / (levels * in_features**0.5)).astype(dtype)
    biases = (-scales.astype(mx.float32) * levels / 2).astype(dtype)
    return QuantizedParts(codes, scales, biases, group_size, bits, "affine")


def random_microscaled_parts(key: mx.array, experts: int, out_features: int, in_features: int,
                             mode: str) -> QuantizedParts:
    """Random codes of microscaled `mode` (e4m3's NaN codes left out) with random uint8 scales about the one that
    puts the dequantized values' RMS near 1/sqrt(in_features), as random_parts does for affine."""
    group_size, bits = FP_MODES[mode]
    k_codes, k_signs, k_scales = mx.random.split(key, 3)
    per = 32 // bits
    shape = (experts, out_features, in_features // per, per)
    magnitudes = 2 ** (bits - 1) - (bits == 8)  # every e2m1 magnitude; e4m3's but the NaN
    codes = mx.random.randint(0, magnitudes, shape, mx.uint32, key=k_codes)
    codes = codes | (mx.random.randint(0, 2, shape, mx.uint32, key=k_signs) << (bits - 1))
    weight = (codes << (mx.arange(per, dtype=mx.uint32) * bits)).sum(axis=-1).astype(mx.uint32)  # disjoint bits
    values = minifloat(np.arange(magnitudes), 2, 1) if bits == 4 else minifloat(np.arange(magnitudes), 4, 3)
    target = 1.0 / (np.sqrt(np.mean(values**2)) * in_features**0.5)  # the scale for an RMS of 1/sqrt(in)
    if mode == "nvfp4":  # e4m3 scales: the nearest code, give or take 4 (about +-40%)
        base, spread = int(np.argmin(np.abs(minifloat(np.arange(0x7f), 4, 3) - target))), 4
    else:  # e8m0: the nearest power of two, give or take one
        base, spread = int(np.argmin(np.abs(np.log2(e8m0(np.arange(255))) - np.log2(target)))), 1
    groups = (experts, out_features, in_features // group_size)
    scales = mx.random.randint(max(base - spread, 1), min(base + spread, 0x7e) + 1, groups, mx.int32, key=k_scales)
    return QuantizedParts(weight, scales.astype(mx.uint8), None, group_size, bits, mode)


def _format(row: dict) -> str:
    """A parity row's storage: affine bits gate/up/down, or the microscaled mode with its bits."""
    return row["bits"] if row.get("mode", "affine") == "affine" else f"{row['mode']} {row['bits']}"


def parity_case(backend: str, label: str, x: mx.array, indices: mx.array, scores: mx.array,
                gate: QuantizedParts, up: QuantizedParts, down: QuantizedParts,
                experts: SwitchGLU | None = None) -> dict:
    """One bits/group-size case: fused on `backend` vs truth, vs the CPU reference and determinism;
    gather_qmm beside it. `experts`: the fallback's experts holding these parts, when they compute more than
    bias-free SwiGLU (their biases and clamp, moe.expert_variant, are what the kernels are given too)."""
    row = {"case": label, "backend": backend, "bits": f"{gate.bits}/{up.bits}/{down.bits}", "mode": gate.mode,
           "group_size": gate.group_size, "dtype": str(x.dtype).replace("mlx.core.", "")}
    experts = experts if experts is not None else SwitchGLU.from_parts(gate, up, down)
    reason = support.experts_reason(experts.quantized_parts(), backend)
    if reason:
        return {**row, "status": "declined", "reason": reason, "passed": True}
    try:
        row.update(_measure(backend, experts, x, indices, scores))
    except Exception as e:  # a kernel that cannot run here is a failed check, reported with its reason
        return {**row, "status": "error", "reason": f"{type(e).__name__}: {e}", "passed": False}
    checks = [row["fused_nrms"] < FUSED_NRMS, row["fused_nmax"] < FUSED_NMAX, row["fused_y_nrms"] < FUSED_NRMS,
              row["deterministic"], row["fallback_nrms"] < FALLBACK_NRMS]
    if row["vs_reference_nrms"] is not None:
        checks.append(row["vs_reference_nrms"] < FUSED_NRMS)
    return {**row, "status": "ran", "passed": all(checks)}


def determinism_runs(backend: str) -> int:
    return DETERMINISM_RUNS.get(backend, 5)


def _measure(backend: str, experts: SwitchGLU, x: mx.array, indices: mx.array, scores: mx.array) -> dict:
    parts, variant = experts.quantized_parts(), moe.expert_variant(experts)
    truth_out, truth_y = truth_outputs(x, indices, scores, *parts, variant=variant)
    truth_rounded = f64(mx.array(truth_out.astype(np.float32)).astype(x.dtype))
    runs = [moe.routed(backend, x, indices, scores, *parts, variant=variant)[:2]
            for _ in range(determinism_runs(backend))]
    mx.eval(runs)
    out, y = f64(runs[0][0]), f64(runs[0][1])
    row = {"deterministic": all(same_bits(o, runs[0][0]) and same_bits(yy, runs[0][1]) for o, yy in runs[1:]),
           "fused_nrms": nrms(out, truth_rounded), "fused_nmax": nmax(out, truth_rounded),
           "fused_y_nrms": nrms(y, truth_y), "vs_reference_nrms": None}
    if backend != "reference":  # on a CPU the fused path IS the reference: nothing separate to compare
        with mx.stream(mx.cpu):
            ref_out, ref_y, _ = moe.routed("reference", x, indices, scores, *parts, variant=variant)
            mx.eval(ref_out, ref_y)
        row["vs_reference_nrms"] = max(nrms(out, f64(ref_out)), nrms(y, f64(ref_y)))
    fallback = weighted_sum(experts(x[None], indices[None]), scores[None])[0]
    row["fallback_nrms"] = nrms(f64(fallback), truth_rounded)
    return row


def parity_widths(group_size: int) -> list[tuple[int, int]]:
    """The (gate/up bits, down bits) checked at a group size: every pair of affine widths at 64, each width for all
    three projections at the others."""
    return list(product(AFFINE_BITS, AFFINE_BITS)) if group_size == 64 else [(b, b) for b in AFFINE_BITS]


# x, router, every affine expert stack (gate, up and down at each width and group size), the microscaled ones
KEYS_PER_SHAPE = 2 + len(GROUP_SIZES) * 3 * len(AFFINE_BITS) + 3 * len(MICROSCALED)


def kernel_parity(backend: str, shapes: list[Shape], dtype: mx.Dtype, seed: int = 0) -> Iterator[dict]:
    """Every supported affine width and group size (parity_widths) and each microscaled mode at each shape, with
    random quantized experts: a row as each case is checked."""
    for shape in shapes:
        keys = iter(mx.random.split(mx.random.key(seed), KEYS_PER_SHAPE))
        e, d, f, k = shape.experts, shape.hidden, shape.width, shape.top_k
        label = f"{shape.name} D{d} Dff{f} K{k}"
        x = mx.random.normal((d,), key=next(keys)).astype(dtype)
        probs = mx.softmax(mx.random.normal((e,), key=next(keys)), precise=True)
        indices = mx.array(np.random.default_rng(seed).permutation(e)[:k], dtype=mx.uint32)
        for gs in GROUP_SIZES:
            if d % gs or f % gs:
                yield {"case": label, "group_size": gs, "status": "not applicable", "passed": True,
                       "reason": f"D {d} or Dff {f} is not a multiple of the group size"}
                continue
            gate_up = {bits: (random_parts(next(keys), e, f, d, bits, gs, dtype),
                              random_parts(next(keys), e, f, d, bits, gs, dtype)) for bits in AFFINE_BITS}
            down = {bits: random_parts(next(keys), e, d, f, bits, gs, dtype) for bits in AFFINE_BITS}
            for gate_up_bits, down_bits in parity_widths(gs):
                yield parity_case(backend, label, x, indices, probs[indices], *gate_up[gate_up_bits], down[down_bits])
        for mode in MICROSCALED:
            parts = [random_microscaled_parts(next(keys), e, o, i, mode) for o, i in ((f, d), (f, d), (d, f))]
            yield parity_case(backend, label, x, indices, probs[indices], *parts)


GPT_OSS_CLAMP = (1.0, 1.702)  # gpt-oss's alpha; a limit that bites on random_parts' activations (gpt-oss's is 7.0)
VARIANT_BITS = (4, 8)  # the affine widths gpt-oss's expert variants are checked at (their arithmetic is width-blind)


def clamped_experts(gate: QuantizedParts, up: QuantizedParts, down: QuantizedParts,
                    biases: tuple[mx.array, mx.array, mx.array]) -> SwitchGLU:
    """gpt-oss's experts (biases, the clamped SwiGLU at GPT_OSS_CLAMP) holding these parts, as the fallback runs
    them."""
    experts = ClampedExperts(gate.in_features, gate.out_features, gate.weight.shape[0], *GPT_OSS_CLAMP)
    for proj, p, b in zip((experts.gate_proj, experts.up_proj, experts.down_proj), (gate, up, down), biases,
                          strict=True):
        proj.set_weight(p.weight, p)
        proj.bias = b
    return experts


def variant_parity(backend: str, dtype: mx.Dtype, seed: int = 0) -> Iterator[dict]:
    """gpt-oss's experts (biases on gate, up and down, the clamped SwiGLU) in each format the pair reads (affine
    4-bit and 8-bit g64, each microscaled mode), at Qwen1.5-MoE-A2.7B's expert shapes with random weights: a row as
    each is checked."""
    name, d, f, k = A27B_SHAPE
    label = f"{name} + biases + clamped SwiGLU (limit {GPT_OSS_CLAMP[0]:g}, alpha {GPT_OSS_CLAMP[1]:g})"
    keys = iter(mx.random.split(mx.random.key(seed + 2), 6 + 3 * (len(VARIANT_BITS) + len(MICROSCALED))))
    x = mx.random.normal((d,), key=next(keys)).astype(dtype)
    scores = mx.softmax(mx.random.normal((k,), key=next(keys)), precise=True)
    indices = mx.array(np.random.default_rng(seed).permutation(k + 1)[:k], dtype=mx.uint32)
    biases = tuple(mx.random.normal((k + 1, n), key=next(keys)).astype(dtype) for n in (f, f, d))
    shapes = ((f, d), (f, d), (d, f))
    stacks = [[random_parts(next(keys), k + 1, o, i, bits, 64, dtype) for o, i in shapes] for bits in VARIANT_BITS]
    stacks += [[random_microscaled_parts(next(keys), k + 1, o, i, mode) for o, i in shapes] for mode in MICROSCALED]
    return (parity_case(backend, label, x, indices, scores, *parts, experts=clamped_experts(*parts, biases))
            for parts in stacks)


def model_weights_parity(backend: str, model, seed: int = 0) -> list[dict]:
    """The fused kernel on the model's own quantized experts (first MoE layer) with a random token."""
    blocks = model.moe_blocks()
    if not blocks:
        return []
    layer, block = next(iter(blocks.items()))
    experts = block.parts().experts
    parts = experts.quantized_parts()
    if support.parts_reason(*parts) is not None:
        return [{"case": f"model layer {layer} experts", "status": "declined", "passed": True,
                 "reason": support.moe_reason(block.spec, parts, backend)}]
    key_x, key_s = mx.random.split(mx.random.key(seed), 2)
    d, e, k = model.args.hidden_size, model.args.num_experts, model.args.num_experts_per_tok
    dtype = parts[0].scales.dtype if parts[0].mode == "affine" else model.dtype  # microscaled scales are uint8
    x = mx.random.normal((d,), key=key_x).astype(dtype)
    probs = mx.softmax(mx.random.normal((e,), key=key_s), precise=True)
    indices = mx.array(np.random.default_rng(seed).permutation(e)[:k], dtype=mx.uint32)
    return [parity_case(backend, f"model layer {layer} experts", x, indices, probs[indices], *parts,
                        experts=experts)]


def shared_expert_parity(backend: str, dtype: mx.Dtype, seed: int = 0) -> dict:
    """The kernel pair with the shared expert inside, at Qwen1.5-MoE-A2.7B's shapes (Dffs 5632, 4-bit g64):
    block output vs truth, vs the CPU reference, determinism; the unfused MLX ops beside it."""
    name, d, f, k = A27B_SHAPE
    label = f"{name} + shared expert Dffs {A27B_SHARED}"
    keys = iter(mx.random.split(mx.random.key(seed + 1), 8))
    x = mx.random.normal((d,), key=next(keys)).astype(dtype)
    scores = mx.softmax(mx.random.normal((k,), key=next(keys)), precise=True)
    indices = mx.arange(k, dtype=mx.uint32)
    gate, up = (random_parts(next(keys), k + 1, f, d, 4, 64, dtype) for _ in range(2))
    down = random_parts(next(keys), k + 1, d, f, 4, 64, dtype)
    s_parts = [random_parts(next(keys), 1, o, i, 4, 64, dtype) for o, i in ((A27B_SHARED, d), (A27B_SHARED, d),
                                                                          (d, A27B_SHARED))]
    one = [QuantizedParts(p.weight[0], p.scales[0], p.biases[0], p.group_size, p.bits, p.mode) for p in s_parts]
    shared = SharedExpert(*one, mx.array([0.4], mx.float32))
    row = {"case": label, "backend": backend, "bits": "4/4/4", "mode": "affine", "group_size": 64,
           "dtype": str(dtype).replace("mlx.core.", "")}
    try:
        runs = [moe.routed(backend, x, indices, scores, gate, up, down, shared)[0]
                for _ in range(determinism_runs(backend))]
        mx.eval(runs)
        truth, _ = truth_outputs(x, indices, scores, gate, up, down, shared)
        truth_rounded = f64(mx.array(truth.astype(np.float32)).astype(x.dtype))
        out = f64(runs[0])
        row.update({"deterministic": all(same_bits(o, runs[0]) for o in runs[1:]),
                    "fused_nrms": nrms(out, truth_rounded), "fused_nmax": nmax(out, truth_rounded),
                    "vs_reference_nrms": None})
        if backend != "reference":
            with mx.stream(mx.cpu):
                ref = moe.routed("reference", x, indices, scores, gate, up, down, shared)[0]
                row["vs_reference_nrms"] = nrms(out, f64(ref))
        experts = SwitchGLU.from_parts(gate, up, down)
        mlp = MLP(d, A27B_SHARED)  # the shared expert as the fallback runs it
        for proj, p in zip((mlp.gate_proj, mlp.up_proj, mlp.down_proj), one, strict=True):
            proj.set_weight(p.weight, p)
        s_y = mlp(x[None])
        unfused = weighted_sum(experts(x[None], indices[None]), scores[None]) + shared.sigmoid_gate.astype(dtype) * s_y
        row["fallback_nrms"] = nrms(f64(unfused[0]), truth_rounded)
    except Exception as e:  # a kernel that cannot run here is a failed check, reported with its reason
        return {**row, "status": "error", "reason": f"{type(e).__name__}: {e}", "passed": False}
    checks = [row["fused_nrms"] < FUSED_NRMS, row["fused_nmax"] < FUSED_NMAX, row["deterministic"],
              row["fallback_nrms"] < FALLBACK_NRMS]
    if row["vs_reference_nrms"] is not None:
        checks.append(row["vs_reference_nrms"] < FUSED_NRMS)
    return {**row, "fused_y_nrms": None, "status": "ran", "passed": all(checks)}


# (E, K, renormalise, shared gate row, scoring, SIGMOID_GROUPED's (groups, kept groups, scaling)):
# Qwen1.5-MoE-A2.7B's, Qwen3-30B-A3B's, gpt-oss-20b's and -120b's, Kimi-K2's, DeepSeek-V3's, GLM-4.5's, GLM-4.5-Air's
ROUTER_CASES = ((60, 4, False, True, SOFTMAX_THEN_TOPK, None), (128, 8, True, False, SOFTMAX_THEN_TOPK, None),
                (32, 4, True, False, TOPK_THEN_SOFTMAX, None), (128, 4, True, False, TOPK_THEN_SOFTMAX, None),
                (384, 8, True, False, SIGMOID_GROUPED, (1, 1, 2.827)),
                (256, 8, True, False, SIGMOID_GROUPED, (8, 4, 2.5)),
                (160, 8, True, False, SIGMOID_GROUPED, (1, 1, 2.5)),
                (128, 8, True, False, SIGMOID_GROUPED, (1, 1, 1.0)))


def router_label(n_exp: int, top_k: int, norm: bool, gate_row: bool, scoring: str,
                 groups: tuple[int, int, float] | None) -> str:
    if scoring == SIGMOID_GROUPED:
        n_group, keep, scale = groups
        scored = f" sigmoid + selection bias, best {keep} of {n_group} groups, x{scale:g}"
    else:
        scored = " top-k logits then softmax" if scoring == TOPK_THEN_SOFTMAX else ""
    return (f"router E{n_exp} top-{top_k}{scored}" + (" renormalised" if norm and scoring != TOPK_THEN_SOFTMAX else "")
            + (" + shared gate" if gate_row else ""))


def router_parity(backend: str, dtype: mx.Dtype, seed: int = 0) -> list[dict]:
    """The router kernel (softmax or sigmoid scores, top-k by each scoring, shared sigmoid gate) on `backend` against
    the CPU reference; a SIGMOID_GROUPED router with a random selection bias."""
    rows = []
    for n_exp, top_k, norm, gate_row, scoring, groups in ROUTER_CASES:
        row = {"case": router_label(n_exp, top_k, norm, gate_row, scoring, groups), "backend": backend}
        if backend == "reference":
            rows.append({**row, "status": "not applicable", "passed": True,
                         "reason": "on a CPU the reference is the router: nothing separate to compare"})
            continue
        key_logits, key_bias = mx.random.split(mx.random.key(seed + n_exp))
        logits = mx.random.normal((1, n_exp + gate_row), key=key_logits).astype(dtype)
        grouped = None
        if groups is not None:
            grouped = moe.GroupedChoice(0.3 * mx.random.normal((n_exp,), key=key_bias), *groups)
        try:
            got = [np.array(a) for a in moe.select(backend, logits, n_exp, top_k, norm, gate_row, scoring, grouped)]
            with mx.stream(mx.cpu):
                want = [np.array(a) for a in moe.reference_select(logits, n_exp, top_k, norm, gate_row, scoring,
                                                                  grouped)]
        except Exception as e:  # noqa: BLE001 -- reported as a failed row
            rows.append({**row, "status": "error", "reason": f"{type(e).__name__}: {e}", "passed": False})
            continue
        diff = max(float(np.abs(g - w).max()) for i, (g, w) in enumerate(zip(got, want, strict=True)) if i != 1)
        same = sorted(got[1].ravel().tolist()) == sorted(want[1].ravel().tolist())
        rows.append({**row, "status": "ran", "max_abs_diff": diff, "same_experts": same,
                     "passed": same and diff < ROUTER_TOLERANCE})
    return rows


# The rows kernel as the steps launch it: the norm and the router's logits at Qwen1.5-MoE-A2.7B's router (the shared
# gate's row stacked, 4-bit), Qwen3-30B-A3B's (8-bit, as mlx-lm quantizes routers), gpt-oss-20b's (mxfp4, a bias)
# and DeepSeek-V3's (a hidden size of 7168); o_proj with the residual add at Qwen3-30B-A3B's and gpt-oss-20b's
# (mxfp4, a bias): (what, rows, inputs, bits or mode, bias, norm, residual)
ROWS_CASES = (("norm + router logits", 61, 2048, 4, False, True, False),
              ("norm + router logits", 128, 2048, 8, False, True, False),
              ("norm + router logits", 32, 2880, "mxfp4", True, True, False),
              ("norm + router logits", 256, 7168, 4, False, True, False),
              ("o_proj + residual", 2048, 4096, 4, False, False, True),
              ("o_proj + residual", 2880, 4096, "mxfp4", True, False, True))
# xn and y, the rows kernel vs the unfused ops on the same GPU: a unit of the last place of the activations' dtype
# (the order of float32 sums), relative to the value
ROWS_ULP = {mx.bfloat16: 2.0**-7, mx.float16: 2.0**-10, mx.float32: 2.0**-22}


def rows_parity(backend: str, dtype: mx.Dtype, seed: int = 0) -> list[dict]:
    """The rows kernel (a quantized Linear on one token with the RMSNorm before it or the residual add after it, in
    one launch) on `backend` against what it replaces, on the same device: mx.fast.rms_norm, the quantized matmul,
    the bias and residual adds."""
    checks = []
    for what, r, d, fmt, biased, normed, resid in ROWS_CASES:
        row = {"case": f"{what}, D {d}, {r} rows, {fmt if isinstance(fmt, str) else f'{fmt}-bit'}"
                       + (" + bias" if biased else ""), "backend": backend}
        if backend == "reference":
            checks.append({**row, "status": "not applicable", "passed": True,
                           "reason": "on a CPU the reference is the unfused ops: nothing separate to compare"})
            continue
        keys = mx.random.split(mx.random.key(seed + r + d), 5)
        w = (mx.random.normal((r, d), key=keys[0]) / d**0.5).astype(dtype)
        parts = QuantizedParts(*mx.quantize(w, mode=fmt), None, *FP_MODES[fmt], fmt) if isinstance(fmt, str) else \
            QuantizedParts(*mx.quantize(w, group_size=64, bits=fmt), 64, fmt, "affine")
        linear = rows_kernel.Rows(parts, mx.random.normal((r,), key=keys[2]).astype(dtype) if biased else None)
        weight = mx.random.uniform(0.5, 1.5, (d,), key=keys[1]).astype(dtype)
        norm = rows_kernel.Norm(weight, 1e-6, mx.array([1e-6], mx.float32)) if normed else None
        residual = (4 * mx.random.normal((1, 1, r), key=keys[4])).astype(dtype) if resid else None
        x = (3 * mx.random.normal((1, 1, d), key=keys[3])).astype(dtype)
        try:
            got = [a for a in rows_kernel.linear(backend, x, linear, norm, residual) if a is not None]
            want = [a for a in rows_kernel.reference_linear(x, linear, norm, residual) if a is not None]  # same device
            ulps = max(float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))
                                    / mx.maximum(mx.abs(b.astype(mx.float32)), 1e-30)).item())
                       for a, b in zip(got, want, strict=True)) / ROWS_ULP[dtype]
        except Exception as e:  # noqa: BLE001 -- reported as a failed row
            checks.append({**row, "status": "error", "reason": f"{type(e).__name__}: {e}", "passed": False})
            continue
        checks.append({**row, "status": "ran", "max_ulps": ulps, "passed": ulps <= 1.0})
    return checks


@dataclass(frozen=True, eq=False)
class AttentionGeometry:
    """An attention the kernel is checked at: its declaration (variants included), the rotation frequencies and
    attention factor it turns q and k by, and its sink logits (None without)."""

    heads: AttentionSpec
    inv_freq: mx.array
    rope_scale: float = 1.0
    sinks: mx.array | None = None

    def label(self) -> str:
        """The geometry and every variant it declares, as a row names it."""
        h, dims = self.heads, support.rotary_dims(self.heads)
        variants = [("bias", h.qkv_bias), ("q/k norm", h.qk_norm == PER_HEAD),
                    (f"rotary on {dims} of {h.head_dim} dims", dims != h.head_dim), ("output gate", h.output_gate),
                    (f"window {h.window}", h.window is not None), ("sinks", self.sinks is not None),
                    (f"scaled rotary (factor {self.rope_scale:.4g})", h.scaled_rope)]
        return (f"attention {h.n_heads}x{h.head_dim} ({h.n_kv_heads} kv heads)" +
                "".join(f" + {name}" for name, declared in variants if declared))

    def cases(self) -> tuple[tuple[int, int], ...]:
        """ATTENTION_CASES and, with a window, its last position and the first past it (in the shortest cache of
        ATTENTION_CASES longer than the window)."""
        w = self.heads.window
        if w is None:
            return ATTENTION_CASES
        slots = next((s for _, s in ATTENTION_CASES if s > w), w + 1)
        return tuple(sorted({*ATTENTION_CASES, (w - 1, slots), (w, slots)}))


def attention_geometries(model) -> list[AttentionGeometry]:
    """Qwen1.5-MoE-A2.7B's and Qwen3-30B-A3B's attention at the model's rope_theta, then each attention declaration
    of the model's layers (linear ones have none) with the layer's own rotary (partial, or scaled with its attention
    factor) and sinks, as steps.AttentionKernel hands them to the kernel: one geometry a declaration."""
    theta = model.args.rope_theta
    found = {h: AttentionGeometry(h, rope_frequencies(h.head_dim, theta)) for h in (A27B_HEADS, QWEN3_HEADS)}
    for attn in map(token_mixer, model.layers):
        if isinstance(attn.spec, AttentionSpec):
            heads = replace(attn.spec, clip_qkv=None)  # the kernel is handed q, k and v clamped
            parts = attn.parts()
            found[heads] = AttentionGeometry(heads, *rotary(attn.spec, parts), parts.sinks if heads.sinks else None)
    return sorted(found.values(), key=lambda g: str(g.heads))


def attention_parity(backend: str, model, seed: int = 0) -> list[dict]:
    """The decode-attention kernel on `backend` against the reference and the float64 truth, at
    attention_geometries' declarations with random inputs, at each geometry's cases (positions of short and long
    caches; inside and past a window); and its in-place cache write."""
    rows = []
    for g in attention_geometries(model):
        for position, slots in g.cases():
            rows.append(attention_case(backend, g, position, slots, model.dtype, model.args.rms_norm_eps, seed))
    return rows


def attention_case(backend: str, g: AttentionGeometry, position: int, slots: int, dtype: mx.Dtype, eps: float,
                   seed: int) -> dict:
    """One position of one geometry in `dtype`: the kernel's output vs the float64 truth, the kernel (output, key,
    value) vs the reference run on the same device (the GPU's stream: the CPU's sigmoid rounds the output gate
    otherwise, see kernels/attn_decode.body), and its in-place write."""
    heads = g.heads
    row = {"case": f"{g.label()} at position {position} of {slots} "
           f"({attention.splits(attention.attended(heads, slots), heads.n_kv_heads)} "
           "threadgroups a key/value head)", "backend": backend,
           "dtype": str(dtype).replace("mlx.core.", "")}
    if backend == "reference":
        return {**row, "status": "not applicable", "passed": True,
                "reason": "on a CPU the reference is the attention: nothing separate to compare"}
    reason = support.attention_reason(heads)
    if reason:
        return {**row, "status": "declined", "reason": reason, "passed": True}
    keys = mx.random.split(mx.random.key(seed + position + heads.head_dim), 6)
    width = attention.projection_width(heads)
    cache_shape = (1, heads.n_kv_heads, slots, heads.head_dim)
    qkv = mx.random.normal((1, 1, width), key=keys[0]).astype(dtype)
    b = mx.random.normal((width,), key=keys[1]).astype(dtype) if heads.qkv_bias else None
    k_cache, v_cache = (mx.random.normal(cache_shape, key=k).astype(dtype) for k in keys[2:4])
    qk_norm = attention.QKNorm(*(mx.random.uniform(0.5, 1.5, (heads.head_dim,), key=k).astype(dtype)
                                 for k in keys[4:]), eps) if heads.qk_norm == PER_HEAD else None
    args = (qkv, b, g.inv_freq, mx.array([position, slots], dtype=mx.int32), k_cache, v_cache, heads)
    variants = {"qk_norm": qk_norm, "sinks": None if g.sinks is None else g.sinks.astype(dtype),
                "rope_scale": g.rope_scale}
    try:
        got = [f64(t) for t in attention.decode_attention(backend, *args, **variants)]
        want = [f64(t) for t in attention.decode_attention("reference", *args, **variants)]
        in_place = writes_in_place(backend, *args, **variants)
    except Exception as e:  # noqa: BLE001 -- reported as a failed row
        return {**row, "status": "error", "reason": f"{type(e).__name__}: {e}", "passed": False}
    truth = attention_f64(*args, **variants)
    row.update({"out_nrms": nrms(got[0].reshape(-1), truth), "reference_nrms": nrms(want[0].reshape(-1), truth),
                "vs_reference_nrms": max(nrms(a, r) for a, r in zip(got, want, strict=True)),
                "in_place_write": in_place})
    return {**row, "status": "ran", "passed": attention_passed(row, dtype)}


def attention_passed(row: dict, dtype: mx.Dtype) -> bool:
    """float32: the kernel within FUSED_NRMS of the truth and of the reference. Rounded dtypes: within FUSED_NRMS
    of the reference and as near the truth as the reference is (tests/gpu/test_cuda_kernel.py's bounds); and the
    in-place write exact."""
    return near_truth(row["out_nrms"], row["reference_nrms"], row["vs_reference_nrms"], dtype, FUSED_NRMS,
                      FUSED_NRMS) and row["in_place_write"]


def writes_in_place(backend: str, qkv: mx.array, bias: mx.array | None, inv_freq: mx.array, slots: mx.array,
                    keys: mx.array, values: mx.array, heads: AttentionSpec, **variants) -> bool:
    """Whether the kernel with `write` (as the compiled decode step runs it) stores the token's key and value
    at its slot of the cache buffers, exactly as it outputs them, and changes nothing else there. `variants`:
    decode_attention's qk_norm, sinks and rope_scale."""
    caches = [keys + 0, values + 0]  # buffers of their own, for the kernel to write into
    mx.eval(caches)
    before = [f64(c) for c in caches]
    _, k_new, v_new = out = attention.decode_attention(backend, qkv, bias, inv_freq, slots, *caches, heads,
                                                       write=True, **variants)
    mx.eval(out)
    position = int(slots[0].item())
    for cache, was, new in zip(caches, before, (k_new, v_new), strict=True):
        was[0, :, position] = f64(new)[0, :, 0]
        if not np.array_equal(f64(cache), was):  # float64 holds every 16- and 32-bit value exactly
            return False
    return True


def gated_delta_parity(backend: str, model, seed: int = 0) -> list[dict]:
    """The gated delta step kernel on `backend` at the model's first linear-attention layer (its declaration and
    weights, random inputs and states), in float32 and in the model's dtype; no rows without such a layer."""
    linear = [(i, m) for i, m in enumerate(map(token_mixer, model.layers)) if isinstance(m.spec, LinearAttentionSpec)]
    if not linear:
        return []
    layer, net = linear[0]
    s = net.spec
    label = (f"model layer {layer} gated delta step: {s.num_key_heads} key heads of {s.key_head_dim}, "
             f"{s.num_value_heads} value heads of {s.value_head_dim}, {s.conv_kernel} taps")
    weights = GatedDeltaWeights.of(net.parts())
    return [gated_delta_case(backend, label, s, weights, dtype, seed) for dtype in dict.fromkeys((mx.float32,
                                                                                                model.dtype))]


def gated_delta_inputs(spec: LinearAttentionSpec, dtype: mx.Dtype, seed: int) -> tuple[mx.array, ...]:
    """One token's in-projections (qkv, z, b, a) and states that are not zero (conv, float32 delta), random."""
    hv, taps = spec.num_value_heads, spec.conv_kernel
    channels = 2 * spec.num_key_heads * spec.key_head_dim + hv * spec.value_head_dim
    keys = iter(mx.random.split(mx.random.key(seed), 6))
    shapes = ((1, 1, channels), (1, 1, hv, spec.value_head_dim), (1, 1, hv), (1, 1, hv), (1, taps - 1, channels))
    inputs = [mx.random.normal(shape, key=next(keys)).astype(dtype) for shape in shapes]
    state = 0.3 * mx.random.normal((1, hv, spec.value_head_dim, spec.key_head_dim), key=next(keys))
    return (*inputs, state)


def gated_delta_case(backend: str, label: str, spec: LinearAttentionSpec, weights: GatedDeltaWeights,
                     dtype: mx.Dtype, seed: int) -> dict:
    """The step on `backend` vs the float64 truth (output, delta state; the conv state moves on exactly), vs the
    reference run on the same device (the GPU's stream: the CPU's bfloat16 SiLU rounds otherwise, see
    moebench.execution.linear_attention), and determinism; in `dtype` (the layer's weights cast to it)."""
    row = {"case": label, "backend": backend, "dtype": str(dtype).replace("mlx.core.", "")}
    reason = support.linear_attention_reason(spec)
    if reason:
        return {**row, "status": "declined", "reason": reason, "passed": True}
    w = GatedDeltaWeights(weights.conv.astype(dtype), weights.a_log.astype(mx.float32),
                          weights.dt_bias.astype(dtype), weights.norm.astype(dtype), weights.eps)
    inputs = gated_delta_inputs(spec, dtype, seed)
    try:
        runs = [linear_attention.gated_delta_step(backend, *inputs, w, spec) for _ in range(determinism_runs(backend))]
        ref = runs[0] if backend == "reference" else linear_attention.gated_delta_step("reference", *inputs, w, spec)
        mx.eval(runs, ref)
    except Exception as e:  # noqa: BLE001 -- reported as a failed row
        return {**row, "status": "error", "reason": f"{type(e).__name__}: {e}", "passed": False}
    truth_out, truth_conv, truth_state = gated_delta_f64(*inputs, w, spec)
    out, conv, state = (f64(a) for a in runs[0])
    row.update({"out_nrms": nrms(out.reshape(-1), truth_out), "state_nrms": nrms(state[0], truth_state),
                "reference_nrms": max(nrms(f64(ref[0]).reshape(-1), truth_out), nrms(f64(ref[2])[0], truth_state)),
                "vs_reference_nrms": None if backend == "reference" else
                max(nrms(out, f64(ref[0])), nrms(state, f64(ref[2]))),
                "conv_exact": bool(np.array_equal(conv[0], truth_conv)),
                "deterministic": all(same_bits(a, b) for run in runs[1:] for a, b in zip(run, runs[0], strict=True))})
    return {**row, "status": "ran", "passed": gated_delta_passed(row, dtype)}


def gated_delta_passed(row: dict, dtype: mx.Dtype) -> bool:
    """float32: the kernel within GATED_DELTA_F32 of the truth and of the reference. Rounded dtypes: the reference
    within its rounding class of the truth, the kernel as near the truth as the reference is and within a carried
    last bit of it (tests/gpu/test_cuda_gated_delta.py's bounds)."""
    kernel = near_truth(max(row["out_nrms"], row["state_nrms"]), row["reference_nrms"], row["vs_reference_nrms"],
                        dtype, GATED_DELTA_F32, GATED_DELTA_VS_REFERENCE)
    reference = dtype == mx.float32 or row["reference_nrms"] < GATED_DELTA_ROUNDED
    return kernel and reference and row["conv_exact"] and row["deterministic"]


def near_truth(out_nrms: float, reference_nrms: float, vs_reference: float | None, dtype: mx.Dtype, exact: float,
               vs_rounded: float) -> bool:
    """Whether a kernel's outputs are in their class: `out_nrms` from the float64 truth (`reference_nrms` the
    reference's), `vs_reference` from the reference run on the kernel's device (None: the backend is the reference).
    float32: within `exact` of the truth and of the reference. Rounded dtypes, where the reference itself is a
    rounding class from the truth: within `vs_rounded` of the reference and as near the truth as the reference is
    (under 1.5 x its nRMS + 1e-3)."""
    if dtype == mx.float32:
        return out_nrms < exact and (vs_reference is None or vs_reference < exact)
    return out_nrms < 1.5 * reference_nrms + 1e-3 and (vs_reference is None or vs_reference < vs_rounded)


def mixer_kinds(model) -> dict[str, int]:
    """Layers per token mixing: 'attention' and each linear kind (a hybrid's Gated DeltaNet layers). The decode
    checks count every one of them as an attention layer: fused when its kernel (decode attention, the gated delta
    step) ran."""
    kinds = ("attention" if isinstance(m.spec, AttentionSpec) else m.spec.kind for m in map(token_mixer, model.layers))
    return dict(Counter(kinds))


def decode_checks(model, prompt_tokens: int, gen_tokens: int, repeats: int, progress: bool) -> dict:
    """Greedy decode with the kernel off and on (bench's interleaved timing): dispatch, parity, speed."""
    results, failures = run_arms(moebench_arms(model, "both"),
                                 prompt_token_ids(model.args.vocab_size, prompt_tokens), gen_tokens, repeats, progress)
    if failures:
        return {"error": "; ".join(f"{f['arm']}: {f['reason']}" for f in failures)}
    off = reference_arm(results)
    on = next(r for r in results if r is not off)
    backend = on.arm.experts
    d = on.runs[-1].dispatch
    steps = gen_tokens - 1
    expected_fallback = d["moe_layers"] if prompt_tokens > 1 else 0  # prefill (more than one token) falls back
    dispatch_ok = d["fused"].get(backend, 0) == d["moe_layers"] * steps and d["fallback"] == expected_fallback
    attn, layers = d["attention"], d["attention"]["layers"]
    attention_ok = attn["fused"].get(backend, 0) == layers * steps
    attention_ok = attention_ok and attn["fallback"] == (layers if prompt_tokens > 1 else 0)
    greedy = compare_traces(off.trace, on.trace)
    if greedy["identical"]:
        parity_class, greedy_ok = "byte-identical", True
    elif greedy["margin"] is not None and greedy["margin"] <= CLEAR_DIVERGENCE:
        parity_class, greedy_ok = f"near-tie divergence at token {greedy['first_divergence']}", True
    else:
        parity_class, greedy_ok = f"diverged at token {greedy['first_divergence']}", False
    speed_off, speed_on = summary([r.decode_tps for r in off.runs]), summary([r.decode_tps for r in on.runs])
    deterministic = all(r.deterministic for r in results)
    return {
        "backend": backend, "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens, "repeats": repeats,
        "dispatch": {**d, "expected_fused": d["moe_layers"] * steps, "expected_fallback": expected_fallback,
                     "passed": dispatch_ok, "attention_passed": attention_ok, "mixers": mixer_kinds(model)},
        "greedy": {**greedy, "parity_class": parity_class, "passed": greedy_ok, "off_tokens": off.trace.token_ids,
                   "on_tokens": on.trace.token_ids},
        "deterministic": deterministic,
        "speed": {"off_tps": speed_off, "on_tps": speed_on, "gain": speed_on["median"] / speed_off["median"] - 1},
    }


def decode_failures(decode: dict) -> list[str]:
    if "error" in decode:
        return [f"decode: {decode['error']}"]
    failures = []
    if not decode["dispatch"]["passed"]:
        failures.append("dispatch: the kernel did not run on every decode step")
    if not decode["dispatch"]["attention_passed"]:
        failures.append("dispatch: the token-mixing kernels (decode attention, gated delta step) did not run on every "
                        "decode step of every layer")
    if not decode["greedy"]["passed"]:
        failures.append(f"greedy: {decode['greedy']['parity_class']} at a clear margin")
    if not decode["deterministic"]:
        failures.append("decode: repeated greedy runs gave different tokens")
    return failures


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2e}"


def report_text(record: dict) -> str:
    p, lines = record["platform"], []
    info = ", ".join(f"{k} {v}" for k, v in p["device_info"].items())
    lines.append(f"platform: MLX {p['mlx']}, device {p['device']} ({info}), fused backend '{p['backend']}'")
    if p["backend"] == "reference":
        lines.append("  no Metal or CUDA GPU here: the fused path ran as the CPU reference; no GPU kernel was tested")
    w = record["weights"]
    more = " ..." if len(w["nonfinite"]) > 5 else ""
    lines.append(f"weights: every value finite ({w['seconds']:.1f} s)" if w["passed"] else
                 f"weights: NaN or Inf in {', '.join(w['nonfinite'][:5])}{more}")
    lines.append(f"\nkernel parity (bounds: fused vs truth nRMS < {FUSED_NRMS:g}, nMax < {FUSED_NMAX:g}; gather_qmm "
                 f"vs truth < {FALLBACK_NRMS:g}). {PARITY_COLUMNS}")
    for case, group in groupby(record["parity"], key=lambda r: r["case"]):
        lines += ["", *parity_table(case, list(group))]
    lines += check_lines(f"router kernel vs the CPU reference (bound: max |difference| < {ROUTER_TOLERANCE:g}, same "
                         "experts)", record["router"],
                         lambda r: f"max |difference| {_fmt(r['max_abs_diff'])}, same experts "
                                   f"{'yes' if r['same_experts'] else 'NO'}")
    lines += check_lines("rows kernel vs the unfused norm, matmul and adds on the same device (bound: xn and the "
                         "outputs within a unit of the last place)", record["rows"],
                         lambda r: f"at most {r['max_ulps']:.2f} units of the last place")
    lines.append(f"\ndecode-attention kernel vs the float64 truth and the reference (bounds: float32 nRMS < "
                 f"{FUSED_NRMS:g} from both; rounded dtypes: vs reference < {FUSED_NRMS:g}, output vs truth < 1.5 x "
                 "the reference's + 1e-3)")
    for r in record["attention"]:
        if r["status"] != "ran":
            lines.append(f"- {r['case']} {r['dtype']}: {r['status']}: {r['reason']}")
            continue
        lines.append(f"- {r['case']} {r['dtype']}: output nRMS {_fmt(r['out_nrms'])} (reference's "
                     f"{_fmt(r['reference_nrms'])}), vs reference {_fmt(r['vs_reference_nrms'])}, in-place write "
                     f"{'exact' if r['in_place_write'] else 'WRONG'}: {'pass' if r['passed'] else 'FAIL'}")
    lines.extend(gated_delta_lines(record["gated_delta"]))
    dec = record["decode"]
    if "error" in dec:
        lines.append(f"\ndecode: FAIL: {dec['error']}")
        return "\n".join(fitted([*lines, _verdict(record)]))
    d, g, s = dec["dispatch"], dec["greedy"], dec["speed"]
    lines.append(f"\ndispatch: {d['fused'].get(dec['backend'], 0)} fused / {d['expected_fused']} expected "
                 f"({d['moe_layers']} MoE layers x {dec['gen_tokens'] - 1} decode steps), {d['fallback']} fallback "
                 f"(expected {d['expected_fallback']}: prefill); {'pass' if d['passed'] else 'FAIL'}")
    at = d["attention"]
    kinds = ", ".join(f"{n} {kind}" for kind, n in d["mixers"].items())
    lines.append(f"attention dispatch: {at['fused'].get(dec['backend'], 0)} fused ({at['layers']} layers: {kinds}; x "
                 f"{dec['gen_tokens'] - 1} decode steps), {at['fallback']} fallback; "
                 f"{'pass' if d['attention_passed'] else 'FAIL'}")
    margin = "" if g["margin"] is None else f", reference margin {g['margin']:.3g} nats"
    lines.append(f"greedy on vs off ({dec['gen_tokens']} tokens): {g['parity_class']}{margin}; "
                 f"{'pass' if g['passed'] else 'FAIL'}; decode deterministic: {dec['deterministic']}")
    model = record["model"]
    lines.append(f"\ndecode of {model['name']} ({model['bits']}), tok/s median [min-max] over {dec['repeats']} "
                 "repeats:")
    lines += markdown_table([["kernels off", f"on [{dec['backend']}]", "gain", "parity class"],
                             [spread(s["off_tps"]), spread(s["on_tps"]), f"{100 * s['gain']:+.1f}%",
                              g["parity_class"]]])
    return "\n".join(fitted([*lines, _verdict(record)]))


PARITY_COLUMNS = ("nRMS, nMax: fused vs the float64 truth; vs ref: fused vs the CPU reference; qmm nRMS: gather_qmm "
                  "vs the truth; same: bitwise equal when run again")


def parity_table(case: str, rows: list[dict]) -> list[str]:
    """One case's kernel parity rows as a table under its name; a row that did not run says why below it."""
    cells = [["bits g/u/d", "group", "nRMS", "nMax", "vs ref", "qmm nRMS", "same", "result"]]
    notes = []
    for r in rows:
        storage, group = _format(r) if "bits" in r else "-", str(r.get("group_size", "-"))
        if r["status"] != "ran":
            cells.append([storage, group, "-", "-", "-", "-", "-", r["status"]])
            notes.append(f"  {storage} g{group}: {r['status']}: {r['reason']}")
            continue
        cells.append([storage, group, _fmt(r["fused_nrms"]), _fmt(r["fused_nmax"]), _fmt(r["vs_reference_nrms"]),
                      _fmt(r["fallback_nrms"]), "yes" if r["deterministic"] else "NO",
                      "pass" if r["passed"] else "FAIL"])
    return [f"{case}:", *markdown_table(cells), *notes]


def gated_delta_lines(rows: list[dict]) -> list[str]:
    """The gated delta rows of the text report (none without a linear-attention layer)."""
    if not rows:
        return []
    lines = [f"\ngated delta step kernel vs the float64 truth and the reference (bounds: float32 nRMS < "
             f"{GATED_DELTA_F32:g}; rounded dtypes: reference vs truth < {GATED_DELTA_ROUNDED:g}, kernel vs truth < "
             f"1.5 x the reference's + 1e-3, vs reference < {GATED_DELTA_VS_REFERENCE:g})"]
    for r in rows:
        if r["status"] != "ran":
            lines.append(f"- {r['case']} {r['dtype']} [{r['backend']}]: {r['status']}: {r['reason']}")
            continue
        lines.append(f"- {r['case']} {r['dtype']} [{r['backend']}]: output nRMS {_fmt(r['out_nrms'])}, state nRMS "
                     f"{_fmt(r['state_nrms'])} (reference's {_fmt(r['reference_nrms'])}), vs reference "
                     f"{_fmt(r['vs_reference_nrms'])}, conv state {'exact' if r['conv_exact'] else 'WRONG'}, "
                     f"deterministic {'yes' if r['deterministic'] else 'NO'}: {'pass' if r['passed'] else 'FAIL'}")
    return lines


def _verdict(record: dict) -> str:
    return f"\n{'PASS' if record['passed'] else 'FAIL: ' + '; '.join(record['failures'])} ({record['seconds']:.1f} s)"


def selfcheck(model_path: str | Path | None = None, prompt_tokens: int = 16, gen_tokens: int = 32,
              repeats: int = 5, progress: bool = True) -> dict:
    """Run every check and return the record; record['passed'] is False when any check failed. With `progress`, a
    bar on stderr counts the checks as they run and names the stage (the decode checks have bench's)."""
    start = time.perf_counter()
    path = Path(model_path) if model_path else default_model_path()
    with Progress(desc="selfcheck", unit=" checks", disable=not progress) as bar:
        bar.set_postfix_str(f"loading {path.name}")
        model, _ = load(path)
        bar.set_postfix_str("reading every weight")
        checked = time.perf_counter()
        nonfinite = nonfinite_weights(model)  # every value of every weight (load samples the large float matrices)
        weights = {"nonfinite": nonfinite, "seconds": time.perf_counter() - checked, "passed": not nonfinite}
        bar.update()
        backend = available_backend()
        dtype = model.dtype
        a = model.args
        shapes = [Shape(*A27B_SHAPE)]
        own = Shape(f"model {path.name}", a.hidden_size, a.moe_intermediate_size, a.num_experts_per_tok)
        if (own.hidden, own.width, own.top_k) != A27B_SHAPE[1:]:  # a real A2.7B model: one set of rows serves both
            shapes.append(own)
        bar.set_postfix_str("kernel parity")
        parity = counted(bar, chain(kernel_parity(backend, shapes, dtype), variant_parity(backend, dtype)))
        parity += counted(bar, model_weights_parity(backend, model) + [shared_expert_parity(backend, dtype)])
        bar.set_postfix_str("router kernel")
        router = counted(bar, router_parity(backend, dtype))
        bar.set_postfix_str("rows kernel")
        rows_checks = counted(bar, rows_parity(backend, dtype))
        bar.set_postfix_str("decode-attention kernel")
        attention_rows = counted(bar, attention_parity(backend, model))
        bar.set_postfix_str("gated delta kernel")
        linear_rows = counted(bar, gated_delta_parity(backend, model))
    decode = decode_checks(model, prompt_tokens, gen_tokens, repeats, progress)
    failures = [f"parity {r['case']} bits {_format(r) if 'bits' in r else None} g{r.get('group_size')}"
                for r in parity if not r["passed"]]
    failures += [f"parity {r['case']}" for r in router + rows_checks + attention_rows if not r["passed"]]
    failures += [f"parity {r['case']} {r['dtype']}" for r in linear_rows if not r["passed"]]
    failures += decode_failures(decode)
    failures += [f"weights: NaN or Inf in {name}" for name in nonfinite]
    bits = model.load_info.bits.get("mlp.switch_mlp.gate_proj", "?")
    return {"schema": SCHEMA, "platform": platform_info(), "model": {"path": str(path), "name": path.name,
            "bits": bits}, "weights": weights, "parity": parity, "router": router, "rows": rows_checks,
            "attention": attention_rows,
            "gated_delta": linear_rows, "decode": decode, "failures": failures, "passed": not failures,
            "seconds": time.perf_counter() - start}


def check_lines(title: str, rows: list[dict], ran: Callable[[dict], str]) -> list[str]:
    """A blank line, `title`, and a line a row: its case and `ran(row)` with its verdict, or why it did not run."""
    return [f"\n{title}", *(f"- {r['case']}: {ran(r)}: {'pass' if r['passed'] else 'FAIL'}" if r["status"] == "ran"
                            else f"- {r['case']}: {r['status']}: {r['reason']}" for r in rows)]


def counted(bar: Progress, rows: Iterable[dict]) -> list[dict]:
    """The rows, each counted on the bar as it is checked (as it comes, when `rows` is an iterator)."""
    done = []
    for row in rows:
        done.append(row)
        bar.update()
    return done


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("selfcheck", help="check the fused kernel on this machine: parity, determinism, dispatch, "
                                         "greedy on vs off, speed; exits 1 on a failed check")
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: MOEBENCH_MODEL or shipped)")
    add_json_option(p, "the full record (every check's numbers)")
    p.add_argument("--prompt-tokens", type=at_least(1), default=16,
                   help="length of the random prompt the decode checks start from (default %(default)s)")
    p.add_argument("--gen-tokens", type=at_least(1), default=32,
                   help="tokens each decode check generates, fused on and off (default %(default)s)")
    p.add_argument("--repeats", type=at_least(1), default=5,
                   help="timed decodes per arm for the tok/s table, interleaved (default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=_run)


def _run(a: argparse.Namespace) -> int:
    check_json_target(a.json)
    record = selfcheck(a.model, a.prompt_tokens, a.gen_tokens, a.repeats, progress=not a.no_progress)
    report(a.json, report_text(record), record)
    return 0 if record["passed"] else 1

