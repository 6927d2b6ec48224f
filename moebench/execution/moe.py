"""The fused single-token decode-MoE arithmetic: router top-k, routed experts and the shared expert.

All backends share one arithmetic: dequantize in float32 with float32 scales and biases (affine, at 2, 3, 4, 5, 6
or 8 bits, gate, up and down each at its own width, one group size of 32, 64 or 128) or the microscaled modes'
codes and uint8 scales decoded exactly (mxfp4, nvfp4, mxfp8), accumulate in float32, the activation in float32,
float32 unweighted outputs per routed expert y [K, D] and of the shared expert ys [D]; the combine
sum_k score_k * y_k + sigmoid_gate * ys (+ the residual) runs in float32 and casts once to the activation dtype.

Declared variants (ExpertVariant, and the router's scoring with its GroupedChoice): experts with biases (gate and
up [E, Dff] added to the float32 dot before the activation, down [E, D] to each y_k; taken in the activation
dtype), the clamped SwiGLU (gpt-oss) in place of SwiGLU; the router scoring the top-k logits by the softmax over
those k (gpt-oss), or scoring each expert by its sigmoid and choosing the top-k of score + a selection bias within
the best groups, weighted by the unbiased scores times a scaling (GLM-4.x MoE, DeepSeek-V3, Kimi-K2). Families
without them run the kernels' plain instances (template constants off, placeholders unread).

The GPU path of one MoE layer after its router logits is two launches (routed_by_router): kernel A selecting the
experts itself (softmax or sigmoid scores, top-k and the shared expert's sigmoid gate from one row of logits, by
warp 0 of each threadgroup), then gate and up of every routed slot and of the shared expert in one pass over x and
the activation, writing act [K * Dff + Dffs] in float32, and kernel B (down of every slot and of the shared expert,
and the combine) writing y, ys and the output. Where the ids are needed before the pair (experts sharded over
ranks), the router kernel selects them (select) and kernel A reads them (routed): three launches.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import mlx.core as mx

from ..errors import ConfigError, UnsupportedKernelConfig
from ..models.args import QuantizedParts
from ..models.declare import (
    CLAMPED_SWIGLU,
    SIGMOID_GROUPED,
    SOFTMAX_THEN_TOPK,
    SWIGLU,
    TOPK_THEN_SOFTMAX,
    MoeSpec,
)
from ..models.routing import route
from ..models.switch import SwitchGLU, weighted_sum
from .kernel import (
    GPU_BACKENDS,
    KERNEL_MODES,
    LANES,
    QUANT,
    SELECT,
    CheckedOnce,
    Stage,
    built_kernel,
    check_backend,
    float_bits,
    parts_signature,
    round_up,
    run_compiled,
    signature,
)
from .support import (
    ACTIVATIONS,
    ROUTER_SCORINGS,
    parts_reason,
    router_reason,
    shared_fold_reason,
)
from .weights import expert_biases

ROUTER = Stage("moebench_moe_router", "moe_router.body", ("logits", "bias"), ("probs", "inds", "scores", "sgate"),
               (SELECT,))
GATE_UP = Stage("moebench_moe_gate_up", "moe_gate_up.body",
                ("x", "indices", "gate_w", "gate_s", "gate_b", "up_w", "up_s", "up_b",
                 "sgate_w", "sgate_s", "sgate_b", "sup_w", "sup_s", "sup_b", "gate_eb", "up_eb", "logits", "bias"),
                ("act", "probs", "inds", "scores", "sgate"), (QUANT, SELECT))
DOWN = Stage("moebench_moe_down", "moe_down.body",
             ("indices", "scores", "down_w", "down_s", "down_b", "act", "sdown_w", "sdown_s", "sdown_b", "sgate",
              "resid", "down_eb"), ("y", "ys", "out"), (QUANT,))
DEFAULT_ROWS = 8  # simdgroups (output rows) per threadgroup
MAX_ROWS = 32


@dataclass(frozen=True)
class SharedExpert:
    """The shared expert as the kernel pair takes it: quantized gate/up [Dffs, D] and down [D, Dffs], and its
    sigmoid gate for this token as float32 [1] (or [1, 1] with a [1, D] token); None for routed_by_router where
    the router's stacked row gives it."""

    gate: QuantizedParts
    up: QuantizedParts
    down: QuantizedParts
    sigmoid_gate: mx.array | None


@dataclass(frozen=True)
class ExpertVariant:
    """What a block's experts compute beyond bias-free SwiGLU, as the kernel pair takes it: biases on gate and
    up [E, Dff] and on down [E, D] (None: none; cast to the activation dtype when stored in another), and the
    clamped SwiGLU's (limit, alpha) (None: SwiGLU)."""

    biases: tuple[mx.array, mx.array, mx.array] | None = None
    clamp: tuple[float, float] | None = None


def _variant_signature(variant: ExpertVariant | None) -> tuple | None:
    if variant is None:
        return None
    return (variant.biases is not None and tuple(map(signature, variant.biases)), variant.clamp)


def _shape(a: mx.array | None) -> tuple | None:
    return None if a is None else tuple(a.shape)


def _check_variant(variant: ExpertVariant, n_exp: int, d: int, dff: int, shared: SharedExpert | None) -> None:
    """Expert biases [E, Dff], [E, Dff], [E, D] in a float dtype; the clamp's limit > 0 and alpha finite."""
    if variant.biases is not None:
        for name, b, shape in zip(("gate", "up", "down"), variant.biases, ((n_exp, dff), (n_exp, dff), (n_exp, d)),
                                  strict=True):
            if tuple(b.shape) != shape or not mx.issubdtype(b.dtype, mx.floating):
                raise UnsupportedKernelConfig(f"{name} expert bias is {tuple(b.shape)} {b.dtype}, expected {shape} "
                                              f"floating point [E, out]")
    if variant.clamp is not None:
        limit, alpha = variant.clamp
        if not (math.isfinite(limit) and limit > 0 and math.isfinite(alpha)):
            raise UnsupportedKernelConfig(f"clamped SwiGLU limit {limit} and alpha {alpha}: expected a finite limit "
                                          f"> 0 and a finite alpha")
        if shared is not None:
            raise UnsupportedKernelConfig("a shared expert beside clamped-SwiGLU experts (kernel A would clamp it "
                                          "too; no family declares that)")


def _check_pair(x: mx.array, indices: mx.array, scores: mx.array, gate: QuantizedParts, up: QuantizedParts,
                down: QuantizedParts, shared: SharedExpert | None, residual: mx.array | None, rows: int,
                variant: ExpertVariant | None = None) -> None:
    """Shapes and dtypes the kernel pair assumes (a bad launch would abort the process)."""
    if not 1 <= rows <= MAX_ROWS:
        raise ConfigError(f"rows per threadgroup {rows}: expected 1 to {MAX_ROWS}")
    parts = (gate, up, down) + ((shared.gate, shared.up, shared.down) if shared is not None else ())
    if (reason := parts_reason(gate, up, down)) is not None:
        raise UnsupportedKernelConfig(f"the fused kernels cannot read these experts: {reason}")
    for p in parts:
        groups = p.in_features // p.group_size
        biases = p.scales if p.biases is None else p.biases  # the microscaled modes have none
        if p.weight.shape[-1] * 32 != p.in_features * p.bits or p.in_features % p.group_size:
            raise UnsupportedKernelConfig(f"packed rows of {p.weight.shape[-1]} words do not hold whole groups of "
                                          f"{p.group_size} {p.bits}-bit values")
        if p.scales.shape != (*p.weight.shape[:-1], groups) or biases.shape != p.scales.shape:
            raise UnsupportedKernelConfig(f"scales {tuple(p.scales.shape)} and biases {_shape(p.biases)} do not fit "
                                          f"packed weights {tuple(p.weight.shape)} at group size {p.group_size}")
    d, dff, n_exp = gate.in_features, gate.out_features, gate.weight.shape[0]
    if x.shape[-1:] != (d,) or any(n != 1 for n in x.shape[:-1]):
        raise UnsupportedKernelConfig(f"x has shape {tuple(x.shape)}, the experts expect ({d},) (one token)")
    if indices.ndim != x.ndim or indices.shape[:-1] != x.shape[:-1] or scores.shape != indices.shape:
        raise UnsupportedKernelConfig(
            f"indices {tuple(indices.shape)} and scores {tuple(scores.shape)} must both be [K] with x's leading "
            f"axes (x [D] -> [K], x [1, D] -> [1, K], ...); x is {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise UnsupportedKernelConfig(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                                      f"{tuple(x.shape)} {x.dtype}")
    if not mx.issubdtype(indices.dtype, mx.integer):
        raise UnsupportedKernelConfig(f"indices must be integers, got {indices.dtype}")
    for name, p, shape in (("gate", gate, (n_exp, dff, d)), ("up", up, (n_exp, dff, d)),
                           ("down", down, (n_exp, d, dff))):
        found = (p.weight.shape[0], p.out_features, p.in_features)
        if p.weight.ndim != 3 or found != shape:
            raise UnsupportedKernelConfig(f"{name} experts are {found} [E, out, in], expected {shape}")
        if p.weight.size >= 2**31:
            raise UnsupportedKernelConfig(f"{name} experts hold {p.weight.size} packed words (32-bit offsets)")
    if variant is not None:
        _check_variant(variant, n_exp, d, dff, shared)
    if shared is None:
        return
    dffs = shared.gate.out_features
    for name, p, shape in (("gate", shared.gate, (dffs, d)), ("up", shared.up, (dffs, d)),
                           ("down", shared.down, (d, dffs))):
        if p.weight.ndim != 2 or (p.out_features, p.in_features) != shape:
            raise UnsupportedKernelConfig(f"shared expert {name} is {tuple(p.weight.shape)} packed, expected {shape}")
    names = {f"{name}_proj": p for name, p in (("gate", shared.gate), ("up", shared.up), ("down", shared.down))}
    if (reason := shared_fold_reason((gate, up, down), names)) is not None:
        raise UnsupportedKernelConfig(f"shared expert: {reason}")
    if shared.sigmoid_gate is None or shared.sigmoid_gate.shape != (*x.shape[:-1], 1):
        raise UnsupportedKernelConfig(f"shared expert gate has shape {_shape(shared.sigmoid_gate)}, "
                                      f"expected {(*x.shape[:-1], 1)}")


check_pair = CheckedOnce(_check_pair)


def pair_signature(x: mx.array, indices: mx.array, scores: mx.array, gate: QuantizedParts, up: QuantizedParts,
                   down: QuantizedParts, shared: SharedExpert | None, residual: mx.array | None, rows: int,
                   variant: ExpertVariant | None = None) -> tuple:
    """Everything the pair's checks and launch geometry depend on (shapes, dtypes, bits, the clamp; no array
    values)."""
    return (signature(x), signature(indices), signature(scores), *map(parts_signature, (gate, up, down)),
            shared is not None and (*map(parts_signature, (shared.gate, shared.up, shared.down)),
                                    signature(shared.sigmoid_gate)), signature(residual), rows,
            _variant_signature(variant))


@dataclass(frozen=True)
class PairLaunch:
    """The kernel pair's templates, grids and output shapes for one signature."""

    gate_up_template: list
    gate_up_grid: tuple[int, int, int]
    down_template: list
    down_grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    scale_dtype: mx.Dtype  # what every projection's scales and biases are cast to (a no-op in practice)
    gate_up_shapes: list
    down_shapes: list
    down_dtypes: list


GATE_UP_DTYPES = [mx.float32, mx.float32, mx.uint32, mx.float32, mx.float32]  # act and the router's outputs


def _choice_template(norm_topk_prob: bool, gate_row: bool, scoring: str, numbers: tuple[int, int, float],
                     biased: bool) -> list:
    """The router's template constants after E and K, as the router kernel and kernel A with ROUTE take them."""
    n_group, topk_group, scaling = numbers
    return [("NORM", norm_topk_prob), ("SHARED", gate_row), ("SCORING", ROUTER_SCORINGS.index(scoring)),
            ("GROUPS", n_group), ("KEEP", topk_group), ("SCALE", float_bits(scaling)), ("BIAS", biased)]


@functools.lru_cache(maxsize=64)
def _pair_launch(lead: tuple, x_dtype: mx.Dtype, scale_dtype: mx.Dtype, scores_dtype: mx.Dtype,
                 e: int, k: int, d: int, dff: int, dffs: int, gs: int, bits: tuple[int, int, int], resid: bool,
                 rows: int, mode: str, biased: bool, clamp: tuple[float, float] | None,
                 route: tuple | None = None) -> PairLaunch:
    """`route`: kernel A's selection (the logits' and the selection bias's dtypes, then _choice_template's
    arguments), or None where it reads the ids."""
    shape = [("E", e), ("K", k), ("DIN", d), ("DFF", dff), ("DFFS", dffs), ("GS", gs)]
    choice = route or (x_dtype, x_dtype, False, False, SOFTMAX_THEN_TOPK, (1, 1, 1.0), False)
    mode_id = ("MODE", KERNEL_MODES.index(mode))
    limit, alpha = map(float_bits, clamp) if clamp is not None else (0, 0)
    activation = [("ACT", ACTIVATIONS.index(SWIGLU if clamp is None else CLAMPED_SWIGLU)), ("LIMIT", limit),
                  ("ALPHA", alpha)]
    return PairLaunch(
        gate_up_template=[("T", x_dtype), ("ST", scale_dtype), *shape, ("GATE_BITS", bits[0]), ("UP_BITS", bits[1]),
                          mode_id, *activation, ("EBIAS", biased), ("ROUTE", route is not None),
                          ("W", rows if route else 1), ("LT", choice[0]), ("BT", choice[1]),
                          *_choice_template(*choice[2:])],
        gate_up_grid=(LANES, round_up(k * dff + dffs, rows), 1),
        down_template=[("T", x_dtype), ("ST", scale_dtype), ("S", scores_dtype), *shape, ("BITS", bits[2]),
                       ("RESID", resid), mode_id, ("EBIAS", biased)],
        down_grid=(LANES, round_up(d, rows), 1),
        threadgroup=(LANES, rows, 1),
        scale_dtype=scale_dtype,
        gate_up_shapes=[(k * dff + dffs,), *([(*lead, e), (*lead, k), (*lead, k), (*lead, 1)] if route else
                                             [(1,)] * 4)],
        down_shapes=[(*lead, k, d), (*lead, d) if dffs else (1,), (*lead, d)],
        down_dtypes=[mx.float32, mx.float32, x_dtype],
    )


def gpu_routed(
    backend: str, x: mx.array, indices: mx.array, scores: mx.array, gate: QuantizedParts, up: QuantizedParts,
    down: QuantizedParts, shared: SharedExpert | None = None, residual: mx.array | None = None,
    rows: int = DEFAULT_ROWS, variant: ExpertVariant | None = None,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """The kernel pair on `backend` (see routed). Kept lean: at decode the Python cost of building a layer's
    graph is of the same order as the GPU work. A kernel's inputs are fixed, so without a shared expert the
    routed arrays stand in for its (unread) inputs, without a residual x does, and without expert biases x
    (kernel A) and the residual or x (kernel B); x stands in for kernel A's logits and selection bias."""
    key = pair_signature(x, indices, scores, gate, up, down, shared, residual, rows, variant)
    check_pair(key, x, indices, scores, gate, up, down, shared, residual, rows, variant)
    biases = variant.biases if variant is not None else None
    launch = _pair_launch(tuple(x.shape[:-1]), x.dtype, gate.scales.dtype, scores.dtype,
                          gate.weight.shape[0], indices.shape[-1], gate.in_features, gate.out_features,
                          shared.gate.out_features if shared is not None else 0, gate.group_size,
                          (gate.bits, up.bits, down.bits), residual is not None, rows, gate.mode, biases is not None,
                          variant.clamp if variant is not None else None)
    indices = indices.astype(mx.uint32)
    act = _gate_up(backend, launch, x, indices, x, x, gate, up, shared, biases)[0]
    return _down(backend, launch, x, indices, scores, act, down, shared,
                 shared.sigmoid_gate if shared is not None else scores, residual, biases)


def _gate_up(backend: str, launch: PairLaunch, x: mx.array, indices: mx.array, logits: mx.array, bias: mx.array,
             gate: QuantizedParts, up: QuantizedParts, shared: SharedExpert | None,
             biases: tuple[mx.array, ...] | None) -> list[mx.array]:
    """Kernel A: [act, probs, inds, scores, sgate] (the router's outputs (1,) placeholders without ROUTE)."""
    st = launch.scale_dtype
    s_gate, s_up = (shared.gate, shared.up) if shared is not None else (gate, up)
    gate_eb, up_eb = _expert_biases(biases[:2], x.dtype) if biases is not None else (x, x)
    return built_kernel(backend, GATE_UP)(
        inputs=[x, indices, gate.weight, *_scales_biases(gate, st), up.weight, *_scales_biases(up, st),
                s_gate.weight, *_scales_biases(s_gate, st), s_up.weight, *_scales_biases(s_up, st), gate_eb, up_eb,
                logits, bias],
        template=launch.gate_up_template, grid=launch.gate_up_grid, threadgroup=launch.threadgroup,
        output_shapes=launch.gate_up_shapes, output_dtypes=GATE_UP_DTYPES,
    )


def _down(backend: str, launch: PairLaunch, x: mx.array, indices: mx.array, scores: mx.array, act: mx.array,
          down: QuantizedParts, shared: SharedExpert | None, sigmoid_gate: mx.array, residual: mx.array | None,
          biases: tuple[mx.array, ...] | None) -> tuple[mx.array, mx.array, mx.array | None]:
    """Kernel B: (out, y, ys or None without a shared expert); `sigmoid_gate` read with the shared expert only."""
    st = launch.scale_dtype
    s_down = shared.down if shared is not None else down
    resid = residual if residual is not None else x
    down_eb = _expert_biases(biases[2:], x.dtype)[0] if biases is not None else resid
    y, ys, out = built_kernel(backend, DOWN)(
        inputs=[indices, scores, down.weight, *_scales_biases(down, st), act, s_down.weight,
                *_scales_biases(s_down, st), sigmoid_gate, resid, down_eb],
        template=launch.down_template, grid=launch.down_grid, threadgroup=launch.threadgroup,
        output_shapes=launch.down_shapes, output_dtypes=launch.down_dtypes,
    )
    return out, y, ys if shared is not None else None


def _expert_biases(biases: tuple[mx.array, ...], dtype: mx.Dtype) -> tuple[mx.array, ...]:
    """The experts' biases in the activation dtype, as the kernels read them (no cast when stored in it)."""
    return tuple(b if b.dtype == dtype else b.astype(dtype) for b in biases)


def _scales_biases(p: QuantizedParts, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """A projection's scales and biases as the kernels take them, in `dtype`; without biases (the microscaled
    modes, which the kernels read none of) the scales stand in for them."""
    scales = p.scales.astype(dtype)
    return scales, scales if p.biases is None else p.biases.astype(dtype)


@dataclass(frozen=True)
class GroupedChoice:
    """How a SIGMOID_GROUPED router chooses, as the router kernel takes it (the block's MoeSpec declares the
    numbers): the selection bias [E] added to the sigmoid scores only to choose (None: none), the experts in
    `n_group` equal groups of which the best `topk_group` are chosen from, the chosen experts' weights times
    `routed_scaling`."""

    selection_bias: mx.array | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0

    @classmethod
    def of(cls, spec: MoeSpec, selection_bias: mx.array | None) -> GroupedChoice:
        """The choice a block declaring `spec` makes, with its selection bias [E] (None when it declares none)."""
        return cls(selection_bias, spec.n_group, spec.topk_group, spec.routed_scaling)

    def spec(self, num_experts: int, top_k: int, renormalize: bool) -> MoeSpec:
        """The block declaration routing.route computes this choice for."""
        return MoeSpec(num_experts, top_k, SIGMOID_GROUPED, renormalize, selection_bias=self.selection_bias is not None,
                       n_group=self.n_group, topk_group=self.topk_group, routed_scaling=self.routed_scaling)

    @property
    def numbers(self) -> tuple[int, int, float]:
        return self.n_group, self.topk_group, self.routed_scaling


def _check_select(logits: mx.array, num_experts: int, top_k: int, norm_topk_prob: bool, gate_row: bool, scoring: str,
                  grouped: GroupedChoice | None) -> None:
    lead = tuple(logits.shape[:-1])
    if logits.shape[-1:] != (num_experts + gate_row,) or any(n != 1 for n in lead) or not 1 <= top_k <= num_experts:
        raise UnsupportedKernelConfig(f"router logits {tuple(logits.shape)} with top-{top_k}: expected one token's "
                                      f"{num_experts + gate_row} logits and 1 <= top_k <= {num_experts}")
    if (scoring == SIGMOID_GROUPED) != (grouped is not None):
        raise UnsupportedKernelConfig(f"routing by {scoring} {'without' if grouped is None else 'with'} a "
                                      f"GroupedChoice: {SIGMOID_GROUPED} takes one, the other scorings none")
    bias = grouped.selection_bias if grouped is not None else None
    if bias is not None and (bias.shape != (num_experts,) or not mx.issubdtype(bias.dtype, mx.floating)):
        raise UnsupportedKernelConfig(f"selection bias {tuple(bias.shape)} {bias.dtype}: expected ({num_experts},) "
                                      f"floating point")
    try:
        spec = MoeSpec(num_experts, top_k, scoring, norm_topk_prob) if grouped is None else \
            grouped.spec(num_experts, top_k, norm_topk_prob)
    except ValueError as e:
        raise UnsupportedKernelConfig(str(e)) from e
    if (reason := router_reason(spec)) is not None:
        raise UnsupportedKernelConfig(f"the router kernel cannot route this block: {reason}")


check_select = CheckedOnce(_check_select)


def _select_key(logits: mx.array, num_experts: int, top_k: int, norm_topk_prob: bool, gate_row: bool, scoring: str,
                grouped: GroupedChoice | None) -> tuple:
    """Everything the router's checks depend on (no array values)."""
    return (tuple(logits.shape), num_experts, top_k, norm_topk_prob, gate_row, scoring,
            grouped is not None and (signature(grouped.selection_bias), grouped.numbers))


def gpu_select(backend: str, logits: mx.array, num_experts: int, top_k: int, norm_topk_prob: bool,
               gate_row: bool, scoring: str = SOFTMAX_THEN_TOPK, grouped: GroupedChoice | None = None
               ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The router kernel on `backend` (see select). Without a selection bias the logits stand in for it (unread)."""
    lead = tuple(logits.shape[:-1])
    bias = grouped.selection_bias if grouped is not None else None
    choice = _choice_template(norm_topk_prob, gate_row, scoring, grouped.numbers if grouped is not None else
                              (1, 1, 1.0), bias is not None)
    return tuple(built_kernel(backend, ROUTER)(
        inputs=[logits, logits if bias is None else bias],
        template=[("LT", logits.dtype), ("BT", logits.dtype if bias is None else bias.dtype), ("E", num_experts),
                  ("K", top_k), *choice],
        grid=(LANES, 1, 1), threadgroup=(LANES, 1, 1),
        output_shapes=[(*lead, num_experts), (*lead, top_k), (*lead, top_k), (*lead, 1)],
        output_dtypes=[mx.float32, mx.uint32, mx.float32, mx.float32],
    ))


def reference_select(logits: mx.array, num_experts: int, top_k: int, norm_topk_prob: bool, gate_row: bool,
                     scoring: str = SOFTMAX_THEN_TOPK, grouped: GroupedChoice | None = None
                     ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The router kernel's arithmetic: moebench's router (models.routing.route) with the selection ordered
    highest first, as the kernel returns it, and the shared expert's sigmoid gate. For TOPK_THEN_SOFTMAX the
    top-k logits scored by the softmax over those k (the numbers route gives as the renormalised top-k
    probabilities), `probs` the softmax over all experts, as route records it; for SIGMOID_GROUPED route's
    choice by `grouped`, `probs` the sigmoid scores."""
    lf = logits.astype(mx.float32)
    if scoring == SIGMOID_GROUPED:
        spec, bias = grouped.spec(num_experts, top_k, norm_topk_prob), grouped.selection_bias
    else:
        spec, bias = MoeSpec(num_experts, top_k, renormalize=norm_topk_prob), None
    probs, inds, scores = route(lf[..., :num_experts], spec, ordered=True, selection_bias=bias)
    if scoring == TOPK_THEN_SOFTMAX:
        inds = mx.argsort(-lf[..., :num_experts], axis=-1)[..., :top_k].astype(mx.uint32)
        scores = mx.softmax(mx.take_along_axis(lf, inds, axis=-1), axis=-1, precise=True)
    sgate = mx.sigmoid(lf[..., num_experts:]) if gate_row else mx.zeros((*lf.shape[:-1], 1), mx.float32)
    return probs, inds, scores, sgate


def _traced_select(logits: mx.array, bias: mx.array | None, num_experts: int, top_k: int, norm_topk_prob: bool,
                   gate_row: bool, scoring: str, numbers: tuple[int, int, float] | None
                   ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """reference_select with the GroupedChoice given as its bias and its numbers (run_compiled takes arrays)."""
    grouped = GroupedChoice(bias, *numbers) if numbers is not None else None
    return reference_select(logits, num_experts, top_k, norm_topk_prob, gate_row, scoring, grouped)


def select(backend: str, logits: mx.array, num_experts: int, top_k: int, norm_topk_prob: bool,
           gate_row: bool, scoring: str = SOFTMAX_THEN_TOPK, grouped: GroupedChoice | None = None
           ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """One token's router selection on `backend`: logits [..., E (+1)] -> (probs [..., E] f32, ids [..., K]
    uint32 highest first, scores [..., K] f32, shared sigmoid gate [..., 1] f32, 0 without `gate_row`), the
    leading axes all 1 and kept. `gate_row`: the last logit is the shared expert gate's. `scoring`: the block's
    declared scoring (moebench.models.declare); with TOPK_THEN_SOFTMAX `norm_topk_prob` is unread (the scores
    sum to one); SIGMOID_GROUPED takes `grouped` (GroupedChoice.of(spec, selection_bias)), the ids ordered by
    score + selection bias, `norm_topk_prob` the block's `renormalize`."""
    check_backend(backend)
    key = _select_key(logits, num_experts, top_k, norm_topk_prob, gate_row, scoring, grouped)
    check_select(key, logits, num_experts, top_k, norm_topk_prob, gate_row, scoring, grouped)
    if backend in GPU_BACKENDS:
        return gpu_select(backend, logits, num_experts, top_k, norm_topk_prob, gate_row, scoring, grouped)
    return _run_reference_select(logits, num_experts, top_k, norm_topk_prob, gate_row, scoring, grouped)


def _run_reference_select(logits: mx.array, num_experts: int, top_k: int, norm_topk_prob: bool, gate_row: bool,
                          scoring: str, grouped: GroupedChoice | None) -> tuple[mx.array, ...]:
    """select on the reference backend, its inputs checked: one compiled graph."""
    return run_compiled(_traced_select, (num_experts, top_k, norm_topk_prob, gate_row, scoring,
                                         grouped.numbers if grouped is not None else None),
                        logits, grouped.selection_bias if grouped is not None else None)


def matmul_f32(p: QuantizedParts, v: mx.array, indices: mx.array | None = None) -> mx.array:
    """v @ W^T in float32 with W dequantized in float32 (affine scales and biases upcast first; the microscaled
    modes' uint8 scales are decoded by MLX): v [D] -> [out], or with `indices` [K] and v [D] or [K, 1, in] ->
    [K, 1, out] (the selected experts' matrices)."""
    if p.biases is None:
        scales, biases = p.scales, None
    else:
        scales, biases = p.scales.astype(mx.float32), p.biases.astype(mx.float32)
    fmt = {"transpose": True, "group_size": p.group_size, "bits": p.bits, "mode": p.mode}
    if indices is None:
        return mx.quantized_matmul(v[None], p.weight, scales, biases, **fmt)[0]
    return mx.gather_qmm(v.reshape(-1, 1, v.shape[-1]), p.weight, scales, biases, rhs_indices=indices, **fmt)


def swiglu_f32(g: mx.array, u: mx.array) -> mx.array:
    """silu(g) * u in float32, written out as the kernels compute it."""
    return g / (1.0 + mx.exp(-g)) * u


def activation_f32(g: mx.array, u: mx.array, clamp: tuple[float, float] | None) -> mx.array:
    """The experts' activation in float32 as kernel A computes it: SwiGLU, or with `clamp` (limit, alpha) the
    clamped SwiGLU (clip(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit)."""
    if clamp is None:
        return swiglu_f32(g, u)
    limit, alpha = (mx.array(v, mx.float32) for v in clamp)
    g, u = mx.minimum(g, limit), mx.clip(u, -limit, limit)
    return (u + 1.0) * g / (1.0 + mx.exp(-alpha * g))


def reference_expert_outputs(
    x: mx.array, indices: mx.array, gate: QuantizedParts, up: QuantizedParts, down: QuantizedParts,
    variant: ExpertVariant | None = None,
) -> mx.array:
    """x [D], indices [K] -> unweighted expert outputs [K, D] in float32 (the down bias included), with MLX
    ops; `variant`'s biases read in x's dtype, as the kernels read them."""
    xf = x.astype(mx.float32)
    g, u = matmul_f32(gate, xf, indices), matmul_f32(up, xf, indices)
    biases = None
    if variant is not None and variant.biases is not None:
        biases = [b[indices].astype(x.dtype).astype(mx.float32)[:, None] for b in variant.biases]  # [K, 1, out]
        g, u = g + biases[0], u + biases[1]
    y = matmul_f32(down, activation_f32(g, u, variant.clamp if variant is not None else None), indices)
    return (y if biases is None else y + biases[2])[:, 0]


def reference_shared_output(x: mx.array, shared: SharedExpert) -> mx.array:
    """x [D] -> the shared expert's unweighted output [D] in float32, with MLX ops."""
    xf = x.astype(mx.float32)
    return matmul_f32(shared.down, swiglu_f32(matmul_f32(shared.gate, xf), matmul_f32(shared.up, xf)))


def routed(
    backend: str, x: mx.array, indices: mx.array, scores: mx.array, gate: QuantizedParts, up: QuantizedParts,
    down: QuantizedParts, shared: SharedExpert | None = None, residual: mx.array | None = None,
    rows: int = DEFAULT_ROWS, variant: ExpertVariant | None = None,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """One token's expert output on `backend`: ((residual +) sum_k score_k y_k (+ gate * ys) [D] in x.dtype,
    unweighted routed outputs y [K, D] f32 (with their down biases), unweighted shared output ys [D] f32 or None
    without a shared expert). `rows`: output rows per threadgroup of the GPU kernels; `variant`: the experts'
    biases and clamped SwiGLU (None: bias-free SwiGLU).

    x [D] with indices and scores [K], or with leading axes of 1 (x [1, 1, D] with [1, 1, K], as a decode
    step holds it): the outputs keep them, without reshape ops on the GPU path.
    """
    check_backend(backend)
    if backend in GPU_BACKENDS:
        return gpu_routed(backend, x, indices, scores, gate, up, down, shared, residual, rows, variant)
    key = pair_signature(x, indices, scores, gate, up, down, shared, residual, rows, variant)
    check_pair(key, x, indices, scores, gate, up, down, shared, residual, rows, variant)
    return _run_reference_routed(x, indices, scores, gate, up, down, shared, residual, variant)


def _run_reference_routed(x: mx.array, indices: mx.array, scores: mx.array, gate: QuantizedParts, up: QuantizedParts,
                          down: QuantizedParts, shared: SharedExpert | None, residual: mx.array | None,
                          variant: ExpertVariant | None) -> tuple[mx.array, mx.array, mx.array | None]:
    """routed on the reference backend, its inputs checked: one compiled graph."""
    parts = (gate, up, down, *((shared.gate, shared.up, shared.down) if shared is not None else ()))
    arrays = tuple((p.weight, p.scales, p.biases) for p in parts)
    formats = tuple((p.group_size, p.bits, p.mode) for p in parts)
    biases = variant.biases if variant is not None else None
    clamp = variant.clamp if variant is not None else None
    return run_compiled(_traced_reference, (formats, clamp), x, indices, scores, arrays,
                        None if shared is None else shared.sigmoid_gate, residual, biases)


def _traced_reference(x: mx.array, indices: mx.array, scores: mx.array, arrays: tuple, sigmoid_gate: mx.array | None,
                      residual: mx.array | None, biases: tuple | None, formats: tuple,
                      clamp: tuple[float, float] | None) -> tuple[mx.array, mx.array, mx.array | None]:
    """reference_routed with each QuantizedParts given as its arrays and its format, and the variant as its
    biases and clamp (run_compiled takes arrays)."""
    parts = [QuantizedParts(*a, *f) for a, f in zip(arrays, formats, strict=True)]
    shared = SharedExpert(*parts[3:], sigmoid_gate) if sigmoid_gate is not None else None
    return reference_routed(x, indices, scores, *parts[:3], shared, residual, ExpertVariant(biases, clamp))


def reference_routed(x: mx.array, indices: mx.array, scores: mx.array, gate: QuantizedParts, up: QuantizedParts,
                     down: QuantizedParts, shared: SharedExpert | None, residual: mx.array | None,
                     variant: ExpertVariant | None = None) -> tuple[mx.array, mx.array, mx.array | None]:
    """routed's arithmetic with MLX ops (the reference backend)."""
    lead = tuple(x.shape[:-1])
    flat_x = x.reshape(-1)
    y = reference_expert_outputs(flat_x, indices.reshape(-1), gate, up, down, variant)
    out = weighted_sum(y, scores.reshape(-1))  # in float32, as y is
    ys = None
    if shared is not None:
        ys = reference_shared_output(flat_x, shared)
        out = out + shared.sigmoid_gate.reshape(-1).astype(mx.float32) * ys
        ys = ys.reshape(x.shape)
    if residual is not None:
        out = residual.reshape(-1).astype(mx.float32) + out
    return out.astype(x.dtype).reshape(x.shape), y.reshape(*lead, *y.shape), ys


def _check_routed_by_router(x: mx.array, logits: mx.array, num_experts: int, top_k: int, norm_topk_prob: bool,
                            gate_row: bool, scoring: str, grouped: GroupedChoice | None, gate: QuantizedParts,
                            up: QuantizedParts, down: QuantizedParts, shared: SharedExpert | None,
                            residual: mx.array | None, rows: int, variant: ExpertVariant | None) -> None:
    """select's and routed's checks, with the ids, scores (and the stacked row's shared gate) the selection will
    give; the router's experts the pair's."""
    _check_select(logits, num_experts, top_k, norm_topk_prob, gate_row, scoring, grouped)
    if logits.shape[:-1] != x.shape[:-1]:
        raise UnsupportedKernelConfig(f"router logits {tuple(logits.shape)} and x {tuple(x.shape)}: expected the "
                                      f"same leading axes")
    if shared is not None and (shared.sigmoid_gate is None) != gate_row:
        raise UnsupportedKernelConfig("the shared expert's gate: with gate_row the router's stacked row gives it "
                                      "(sigmoid_gate None), else the caller does")
    lead = tuple(x.shape[:-1])
    slots = mx.zeros((*lead, top_k), mx.uint32)
    if shared is not None and gate_row:
        shared = replace(shared, sigmoid_gate=mx.zeros((*lead, 1), mx.float32))
    _check_pair(x, slots, slots.astype(mx.float32), gate, up, down, shared, residual, rows, variant)
    if gate.weight.shape[0] != num_experts:
        raise UnsupportedKernelConfig(f"the router chooses among {num_experts} experts, the experts are "
                                      f"{gate.weight.shape[0]}")


check_routed_by_router = CheckedOnce(_check_routed_by_router)


def routed_by_router(
    backend: str, x: mx.array, logits: mx.array, num_experts: int, top_k: int, norm_topk_prob: bool, gate_row: bool,
    scoring: str, grouped: GroupedChoice | None, gate: QuantizedParts, up: QuantizedParts, down: QuantizedParts,
    shared: SharedExpert | None = None, residual: mx.array | None = None, rows: int = DEFAULT_ROWS,
    variant: ExpertVariant | None = None,
) -> tuple[mx.array, ...]:
    """select then routed for one token's input x [..., D] (the normed input) and its router logits [..., E (+1)]:
    (out, y, ys as routed returns them, probs, ids, scores, shared gate as select returns them). The arguments
    are select's choice and routed's experts; with `gate_row` the shared expert's gate is the stacked row's
    sigmoid (its sigmoid_gate None), else the shared expert's own. On a GPU two launches, not three: kernel A
    selects the experts itself (no router kernel)."""
    check_backend(backend)
    key = (pair_signature(x, None, None, gate, up, down, shared, residual, rows, variant),
           _select_key(logits, num_experts, top_k, norm_topk_prob, gate_row, scoring, grouped))
    check_routed_by_router(key, x, logits, num_experts, top_k, norm_topk_prob, gate_row, scoring, grouped, gate, up,
                           down, shared, residual, rows, variant)
    if backend in GPU_BACKENDS:
        return gpu_routed_by_router(backend, x, logits, num_experts, top_k, norm_topk_prob, gate_row, scoring,
                                    grouped, gate, up, down, shared, residual, rows, variant)
    # checked above, with the ids and scores the selection gives: each part runs as its one compiled graph
    probs, inds, scores, sgate = _run_reference_select(logits, num_experts, top_k, norm_topk_prob, gate_row, scoring,
                                                       grouped)
    if shared is not None and gate_row:
        shared = replace(shared, sigmoid_gate=sgate)
    return (*_run_reference_routed(x, inds, scores, gate, up, down, shared, residual, variant), probs, inds, scores,
            sgate)


def gpu_routed_by_router(
    backend: str, x: mx.array, logits: mx.array, num_experts: int, top_k: int, norm_topk_prob: bool, gate_row: bool,
    scoring: str, grouped: GroupedChoice | None, gate: QuantizedParts, up: QuantizedParts, down: QuantizedParts,
    shared: SharedExpert | None, residual: mx.array | None, rows: int, variant: ExpertVariant | None,
) -> tuple[mx.array, ...]:
    """Kernel A with ROUTE, then kernel B on its ids, scores (and shared gate) (see routed_by_router; checked
    there). The packed gate weights (uint32) stand in for kernel A's unread indices, the logits for an absent
    selection bias."""
    biases = variant.biases if variant is not None else None
    bias = grouped.selection_bias if grouped is not None else None
    route = (logits.dtype, logits.dtype if bias is None else bias.dtype, norm_topk_prob, gate_row, scoring,
             grouped.numbers if grouped is not None else (1, 1, 1.0), bias is not None)
    launch = _pair_launch(tuple(x.shape[:-1]), x.dtype, gate.scales.dtype, mx.float32, num_experts, top_k,
                          gate.in_features, gate.out_features, shared.gate.out_features if shared is not None else 0,
                          gate.group_size, (gate.bits, up.bits, down.bits), residual is not None, rows, gate.mode,
                          biases is not None, variant.clamp if variant is not None else None, route)
    act, probs, inds, scores, sgate = _gate_up(backend, launch, x, gate.weight, logits,
                                               logits if bias is None else bias, gate, up, shared, biases)
    sigmoid_gate = scores if shared is None else sgate if gate_row else shared.sigmoid_gate
    return (*_down(backend, launch, x, inds, scores, act, down, shared, sigmoid_gate, residual, biases), probs, inds,
            scores, sgate)


def routed_experts(path: str, experts: SwitchGLU, x: mx.array, indices: mx.array, scores: mx.array,
                   rows: int = DEFAULT_ROWS) -> tuple[mx.array, mx.array]:
    """The routed part of a MoE block on one token x [1, D] with indices and scores [1, K], by `path` (a
    backend, or 'fallback'): (weighted sum [1, D], unweighted per-expert outputs [1, K, D]).

    Fused: the kernel pair, per-expert outputs in float32, weighted and summed over K in float32, one final
    cast. Fallback: SwitchGLU (gather_qmm) in the activation dtype and the weighted sum in that dtype."""
    if path == "fallback":
        y = experts(x, indices)
        return weighted_sum(y, scores), y
    parts = [p.quantized_parts() for p in (experts.gate_proj, experts.up_proj, experts.down_proj)]
    out, y, _ = routed(path, x, indices, scores, *parts, rows=rows, variant=expert_variant(experts))
    return out, y


def expert_variant(experts: SwitchGLU) -> ExpertVariant | None:
    """What `experts` compute beyond bias-free SwiGLU, from what they hold (their projections' biases, their
    clamp), or None when nothing."""
    biases, clamp = expert_biases(experts.gate_proj, experts.up_proj, experts.down_proj), experts.clamp
    return None if biases is None and clamp is None else ExpertVariant(biases, clamp)
