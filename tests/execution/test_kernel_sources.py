"""The kernel sources in kernels/ compile and compute right without a GPU.

CI has no Apple GPU, so the Metal prelude plus the shared bodies of the four stages (the MoE's router,
kernel A and kernel B, and decode attention) are wrapped in the signature MLX's metal_kernel would write
and compiled as C++ against kernels/metal_cpu_shim.h (every supported quantization mode / bits / group size /
shared-expert / router-flag combination, attention with and without bias and with and without the in-place cache write
at MHA, GQA and MQA head shapes, and its declared variants: partial rotary, the output gate, a sliding window, sinks
and the rotary attention factor; float32 and bfloat16; split threadgroups' partials joined by a second launch or by the
kernel itself), then run on the CPU against the references (the
attention kernel as threadgroups of simdgroups meeting at barriers; the hybrids' gated attention in bfloat16 too,
against the reference as it rounds on Metal and CUDA). The emulated signatures and launch
geometry are checked against what moebench.execution.moe and moebench.execution.attention actually
launch. Where nvcc exists, the CUDA prelude plus the same bodies compile the way MLX's cuda_kernel wraps
them.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from dataclasses import dataclass, replace
from itertools import product

import mlx.core as mx
import numpy as np
import pytest
from execution.gpu_rounding import gpu_rounded_attention

from moebench.errors import UnsupportedKernelConfig
from moebench.execution import attention, moe
from moebench.execution import rows as rows_module
from moebench.execution.attention import (
    ATTENTION,
    COMBINE,
    SPLIT_POSITIONS,
    WARPS_PER_HEAD,
    QKNorm,
    reference_decode_attention,
    rope_frequencies,
)
from moebench.execution.kernel import (
    JOIN,
    KERNEL_DIR,
    LANES,
    QUANT,
    SELECT,
    Stage,
    compact,
    float_bits,
    kernel_header,
    kernel_source,
)
from moebench.execution.moe import (
    DEFAULT_ROWS,
    DOWN,
    GATE_UP,
    KERNEL_MODES,
    ROUTER,
    SharedExpert,
    reference_select,
    routed,
)
from moebench.execution.rows import ROWS, ROWS_WARPS, Norm, Rows, reference_linear
from moebench.execution.support import AFFINE_BITS, GROUP_SIZES, MICROSCALED, ROUTER_SCORINGS
from moebench.inspect.truth import dequantize_f64, expert_outputs, nrms
from moebench.models.args import FP_MODES, QuantizedParts
from moebench.models.declare import (
    CLAMPED_SWIGLU,
    SIGMOID_GROUPED,
    SOFTMAX_THEN_TOPK,
    TOPK_THEN_SOFTMAX,
    AttentionSpec,
)

EXPERTS = {"E": 4, "K": 3, "DIN": 256, "DFF": 128}  # DFF divides by every group size and by 16 (6-bit)
E, K, DIN, DFF = EXPERTS.values()
DFFS = 640  # shared expert width: a multiple of every group size and of 16, unlike DIN, DFF and K * DFF
ROUTER_SHAPES = ((4, 2), (60, 4), (128, 8))  # (E, K): logits in `constant`, E % 32 != 0, E % 32 == 0
# (H, KV, HD): MHA at Qwen1.5-MoE-A2.7B's shape, GQA with 2 dims a lane, MQA with 8; HD 96 and 32 put a
# dim's rotate-half partner in lane ^ 16
# (H, KV, HD): among them 16 query heads a key/value head, where a warp's block is 4 keys
ATTENTION_SHAPES = ((16, 16, 128), (8, 2, 64), (4, 1, 256), (6, 2, 96), (2, 1, 32), (16, 1, 32))
CAP = 80  # cache slots of the attention runs: past one round of the warps' blocks (8 warps x 8 keys)

_SHAPE = [("int", n) for n in ("E", "K", "DIN", "DFF", "DFFS", "GS")]
# The router's choice after E and K, as the router kernel and kernel A take it.
_CHOICE = [("bool", "NORM"), ("bool", "SHARED"), ("int", "SCORING"), ("int", "GROUPS"), ("int", "KEEP"),
           ("int", "SCALE"), ("bool", "BIAS")]
# Template parameters in the order the wrappers pass them (MLX emits `template <...>` in that order).
TEMPLATE_PARAMS: dict[Stage, list[tuple[str, str]]] = {
    ROUTER: [("typename", "LT"), ("typename", "BT"), ("int", "E"), ("int", "K"), *_CHOICE],
    ROWS: [("typename", "T"), ("typename", "ST"), ("int", "D"), ("int", "R"), ("int", "BITS"), ("int", "GS"),
           ("int", "MODE"), ("bool", "NORM"), ("bool", "BIAS"), ("bool", "RESID"), ("int", "W")],
    GATE_UP: [("typename", "T"), ("typename", "ST"), *_SHAPE, ("int", "GATE_BITS"), ("int", "UP_BITS"), ("int", "MODE"),
              ("int", "ACT"), ("int", "LIMIT"), ("int", "ALPHA"), ("bool", "EBIAS"), ("bool", "ROUTE"), ("int", "W"),
              ("typename", "LT"), ("typename", "BT"), *_CHOICE],
    DOWN: [("typename", "T"), ("typename", "ST"), ("typename", "S"), *_SHAPE, ("int", "BITS"), ("bool", "RESID"),
           ("int", "MODE"), ("bool", "EBIAS")],
    ATTENTION: [("typename", "T"), ("int", "H"), ("int", "KV"), ("int", "HD"), ("bool", "BIAS"),
                ("bool", "QKNORM"), ("int", "ROPE_DIMS"), ("int", "FACTOR"), ("bool", "GATE"), ("int", "WINDOW"),
                ("bool", "SINKS"), ("int", "W"), ("int", "S"), ("bool", "WRITE"), ("bool", "FOLD")],
    COMBINE: [("typename", "T"), ("int", "H"), ("int", "HD"), ("int", "S"), ("bool", "GATE")],
}
# Element type of each kernel parameter: a C type or a template type name; uint32_t when not listed.
PARAM_TYPES: dict[Stage, dict[str, str]] = {
    ROUTER: {"logits": "LT", "bias": "BT", "probs": "float", "scores": "float", "sgate": "float"},
    ROWS: {"x": "T", "norm_w": "T", "eps": "float", "s": "ST", "b": "ST", "bias": "T", "resid": "T", "xn": "T",
           "y": "T"},
    GATE_UP: {"x": "T", "act": "float", "gate_eb": "T", "up_eb": "T", "logits": "LT", "bias": "BT", "probs": "float",
              "scores": "float", "sgate": "float",
              **{f"{p}_{q}": "ST" for p in ("gate", "up", "sgate", "sup") for q in "sb"}},
    DOWN: {"scores": "S", "act": "float", "sgate": "float", "y": "float", "ys": "float", "out": "T", "resid": "T",
           "down_eb": "T", **{f"{p}_{q}": "ST" for p in ("down", "sdown") for q in "sb"}},
    ATTENTION: {**dict.fromkeys(ATTENTION.inputs + ATTENTION.outputs, "T"), "inv_freq": "float", "pos": "int",
                "block": "int", "eps": "float", "parts": "float", "counter": "uint32_t"},
    COMBINE: {"parts": "float", "out": "T"},
}
FLAVORS = {"f32": {"T": "float", "ST": "float", "S": "float", "LT": "float", "BT": "float"},
           "bf16": {"T": "bfloat16_t", "ST": "bfloat16_t", "S": "float", "LT": "bfloat16_t", "BT": "bfloat16_t"}}
MX_TYPES = {mx.float32: "float", mx.bfloat16: "bfloat16_t", mx.uint32: "uint32_t", mx.int32: "int", mx.uint8: "uint8_t"}
NP_TYPES = {"float": np.float32, "uint32_t": np.uint32, "int": np.int32, "bfloat16_t": np.uint16,  # bf16: bits
            "uint8_t": np.uint8}
CUDA_TYPES = {"float": "float", "bfloat16_t": "__nv_bfloat16", "uint32_t": "uint32_t", "int": "int32_t",
              "uint8_t": "uint8_t"}

Instance = dict[str, object]  # template parameter name -> C type name, int or bool, in template order


def _format(mode: str) -> dict[str, object]:
    """The pair's template values for quantization `mode`: its MODE id, and uint8 scales in the microscaled
    modes (the activations' flavor decides the affine scales' type)."""
    return {"MODE": KERNEL_MODES.index(mode), **({"ST": "uint8_t"} if mode != "affine" else {})}


# The declared variants off (SwiGLU without biases, softmax then top-k): what an instance takes unless told.
VARIANTS_OFF = {"ACT": 0, "LIMIT": 0, "ALPHA": 0, "EBIAS": False, "SCORING": 0, "GROUPS": 1, "KEEP": 1,
                "SCALE": float_bits(1.0), "BIAS": False, "ROUTE": False}
# Kernel A reading the ids: the router's flags off, W the wrappers' rows a threadgroup (unread without ROUTE).
CHOICE_OFF = {"NORM": False, "SHARED": False, "W": DEFAULT_ROWS}
CLAMP = (1.0, 1.702)  # a limit that bites on the test activations; gpt-oss's alpha
_CLAMPED = {"ACT": moe.ACTIVATIONS.index(CLAMPED_SWIGLU), "LIMIT": float_bits(CLAMP[0]),
            "ALPHA": float_bits(CLAMP[1])}


def _instance(stage: Stage, flavor: str = "f32", **values) -> Instance:
    """One template instance of `stage`: type parameters from the dtype flavor unless `values` names them, the
    variants off unless `values` sets them, the rest from `values`."""
    defaults = {**FLAVORS[flavor], **VARIANTS_OFF, **CHOICE_OFF}
    return {n: values[n] if n in values else defaults[n] for _, n in TEMPLATE_PARAMS[stage]}


def _cpp(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _args(inst: Instance) -> str:
    return ", ".join(map(_cpp, inst.values()))


def _param_type(stage: Stage, name: str, inst: Instance) -> str:
    """The C element type of kernel parameter `name` in this instance (template type names resolved)."""
    t = PARAM_TYPES[stage].get(name, "uint32_t")
    return str(inst.get(t, t))


def _constant_inputs(stage: Stage, inst: Instance) -> tuple[str, ...]:
    """The inputs MLX's metal_kernel puts in `constant` (under 8 elements) at this instance's shapes."""
    if stage is ROUTER:  # without a selection bias the logits stand in for it
        sizes = {"logits": inst["E"] + inst["SHARED"], "bias": inst["E"] + (not inst["BIAS"] and inst["SHARED"])}
    elif stage is ROWS:  # x [D] stands in for the inputs a call does not read (a float32 [1] for eps)
        d = inst["D"]
        sizes = {"eps": 1, "bias": inst["R"] if inst["BIAS"] else d,
                 "resid": inst["R"] if inst["RESID"] else d}
    elif stage is ATTENTION:  # [P, CAP], [block], eps [1] (inv_freq stands in without the q/k norm), inv_freq
        half = inst["ROPE_DIMS"] // 2  # [ROPE_DIMS / 2], sinks [H] (qkv stands in without them), the counter [KV]
        sizes = {"pos": 2, "block": 1, "eps": 1 if inst["QKNORM"] else half, "inv_freq": half,  # (folding; else
                 "sinks": inst["H"] if inst["SINKS"] else 8, "counter": inst["KV"] if inst["FOLD"] else 8}  # [8])
    elif stage is COMBINE:
        sizes = {}
    elif stage is GATE_UP and inst["ROUTE"]:  # the packed gate rows stand in for the ids, the logits for a bias
        logits = inst["E"] + inst["SHARED"]
        sizes = {"logits": logits, "bias": inst["E"] if inst["BIAS"] else logits}
    else:  # without a shared expert the caller passes scores in place of B's sgate [1]; x stands in for A's logits
        sizes = {"indices": inst["K"], "scores": inst["K"], "sgate": 1 if inst["DFFS"] else inst["K"]}
    return tuple(n for n in stage.inputs if sizes.get(n, 8) < 8)


def _metal_name(stage: Stage, inst: Instance) -> str:
    """One template kernel per distinct MLX signature: its element types and its `constant` inputs."""
    types = [str(inst[n]) for kind, n in TEMPLATE_PARAMS[stage] if kind == "typename"]
    constant = _constant_inputs(stage, inst)
    return "_".join([stage.name, *types, *(["constant", *constant] if constant else [])])


def _metal_template(stage: Stage, inst: Instance) -> str:
    """The template kernel as MLX's metal_kernel writes it (the shim erases the address spaces)."""
    _, source = kernel_source("metal", stage)
    constant = _constant_inputs(stage, inst)
    params = [f"const {'constant' if n in constant else 'device'} {_param_type(stage, n, inst)}* {n}"
              for n in stage.inputs]
    params += [f"device {_param_type(stage, n, inst)}* {n}" for n in stage.outputs]
    params.append("uint3 thread_position_in_grid")
    tparams = ", ".join(f"{kind} {name}" for kind, name in TEMPLATE_PARAMS[stage])
    return (f"template <{tparams}>\nvoid {_metal_name(stage, inst)}(\n    " + ",\n    ".join(params) +
            f") {{\n{source}\n}}")


def _entry(stage: Stage, inst: Instance) -> str:
    return "_".join(["run", stage.name, *map(_cpp, inst.values())])


def _launcher(stage: Stage, inst: Instance) -> str:
    """extern "C" entry for ctypes: the stage's buffers in input-then-output order, over `rows` simdgroups."""
    buffers = [f"static_cast<{'const ' * (n in stage.inputs)}{_param_type(stage, n, inst)}*>(buf[{i}])"
               for i, n in enumerate(stage.inputs + stage.outputs)]
    if stage in (ATTENTION, ROWS) or stage is GATE_UP and inst["ROUTE"]:  # threadgroups of W simdgroups
        # (attention: a key/value head and split; kernel A: its warp 0 selects for them)
        launch = f"mb_shim_launch_threadgroups(rows / {inst['W']}, {inst['W']}, "
    else:
        launch = "mb_shim_launch(rows, 1, "
    return (f'extern "C" void {_entry(stage, inst)}(void* const* buf, uint rows) {{\n'
            f"  {launch}[&](uint3 t) {{ {_metal_name(stage, inst)}<{_args(inst)}>("
            f"{', '.join(buffers)}, t); }});\n}}")


@dataclass(frozen=True)
class Declared:
    """The attention kernel's declared variants of one instance: rotated dims (None: the whole head), the
    rotary attention factor (1: none), the output gate, a window (None: every position), sinks."""

    rope_dims: int | None = None
    factor: float = 1.0
    gate: bool = False
    window: int | None = None
    sinks: bool = False

    def heads(self, shape: tuple[int, int, int]) -> AttentionSpec:
        rotated = self.rope_dims or shape[2]
        return AttentionSpec(*shape, rope_fraction=rotated / shape[2], output_gate=self.gate, window=self.window,
                             sinks=self.sinks, scaled_rope=self.factor != 1.0)


PLAIN = Declared()


def _attention_instance(shape: tuple[int, int, int], bias: bool, write: bool, flavor: str = "f32", qknorm: bool = False,
                        splits: int = 1, declared: Declared = PLAIN, fold: bool = False) -> Instance:
    return _instance(ATTENTION, flavor, **dict(zip(("H", "KV", "HD"), shape, strict=True)), BIAS=bias, QKNORM=qknorm,
                     ROPE_DIMS=declared.rope_dims or shape[2],
                     FACTOR=float_bits(declared.factor) if declared.factor != 1.0 else 0, GATE=declared.gate,
                     WINDOW=declared.window or 0, SINKS=declared.sinks, W=WARPS_PER_HEAD, S=splits, WRITE=write,
                     FOLD=fold)


def _combine_instance(shape: tuple[int, int, int], splits: int, flavor: str = "f32", gate: bool = False) -> Instance:
    return _instance(COMBINE, flavor, H=shape[0], HD=shape[2], S=splits, GATE=gate)


# Beside every bias x write case with one threadgroup a head: the q/k norm, and two, three and five threadgroups a
# head (the positions' chunks of 64, so with CAP 80 one split holds 0..63, one 64..79, the others none).
ATTENTION_VARIANTS = [(bias, write, False, 1) for bias, write in product((False, True), (False, True))] + [
    (False, False, True, 1), (True, False, False, 3), (False, True, False, 3), (False, True, True, 3),
    (False, True, False, 2), (True, True, True, 5)]
# The declared variants, each at shapes that exercise it, one threadgroup a head and three:
# (shape, bias, q/k norm, Declared). The hybrids' full attention (the q/k norm, the output gate, a quarter of each
# head rotated: 8 of 32 dims in lanes < 8, 16 of 64, 64 of 256 in the lane itself) and 96 of 128 (the partner in
# lane ^ 16); gpt-oss's (biases, sinks, YaRN's factor, with and without a window of 70 positions, which the
# three splits share, and of 5).
DECLARED_RUNS = [((2, 1, 32), False, True, Declared(rope_dims=8, gate=True)),
                 ((4, 2, 64), False, True, Declared(rope_dims=16, gate=True)),
                 ((2, 1, 256), True, True, Declared(rope_dims=64, gate=True)),
                 ((4, 4, 128), False, False, Declared(rope_dims=96)),
                 ((8, 2, 64), True, False, Declared(factor=1.35, window=70, sinks=True)),
                 ((4, 1, 32), True, False, Declared(factor=1.35, sinks=True)),
                 ((4, 2, 64), True, False, Declared(window=5))]
# The hybrids' runs (the q/k norm, partial rotary, the output gate), also in bfloat16
GATED_RUNS = [run for run in DECLARED_RUNS if run[3].gate]


def _compile_instances(flavors, experts: dict[str, int], dffs: int, router_shapes, attention_shapes):
    """(stage, instance) for every supported combination at these shapes (gate and up at one width; mixed widths
    and the routers' variants compile in the run instances)."""
    formats = [("affine", bits, group) for bits, group in product(AFFINE_BITS, GROUP_SIZES)]
    formats += [(mode, FP_MODES[mode][1], FP_MODES[mode][0]) for mode in MICROSCALED]
    for flavor in flavors:
        for (mode, bits, group), width in product(formats, (0, dffs)):
            widths = {"GATE_BITS": bits, "UP_BITS": bits}
            yield GATE_UP, _instance(GATE_UP, flavor, **experts, DFFS=width, GS=group, **widths, **_format(mode))
            if not width:  # the variants: biases, the clamp (never beside a shared expert), both
                for variant in ({"EBIAS": True}, _CLAMPED, {**_CLAMPED, "EBIAS": True}):
                    yield GATE_UP, _instance(GATE_UP, flavor, **experts, DFFS=0, GS=group, **widths, **_format(mode),
                                             **variant)
            for resid, ebias in product((False, True), (False, True)):
                yield DOWN, _instance(DOWN, flavor, **experts, DFFS=width, GS=group, BITS=bits, RESID=resid,
                                      EBIAS=ebias, **_format(mode))
        for (n_exp, top_k), norm, shared, scoring in product(router_shapes, (True, False), (True, False),
                                                             (SOFTMAX_THEN_TOPK, TOPK_THEN_SOFTMAX)):
            yield ROUTER, _router_instance(n_exp, top_k, norm, shared, scoring, flavor=flavor)
        for router, norm, shared, bias in product(GROUPED_ROUTERS, (True, False), (True, False), (True, False)):
            yield ROUTER, _router_instance(*router[:2], norm, shared, SIGMOID_GROUPED, router[2:], bias, flavor)
        for (scoring, groups, bias, norm), width in product(ROUTE_CHOICES, (0, dffs)):  # kernel A selecting
            yield GATE_UP, _instance(GATE_UP, flavor, **experts, DFFS=width, GS=64, GATE_BITS=4, UP_BITS=4, MODE=0,
                                     ROUTE=True, **_choice(norm, width > 0, scoring, groups, bias))
        for (mode, bits, group), (norm, bias, resid) in product(formats, ROWS_VARIANTS):  # the real launch's rows a
            case = RowsCase(flavor, mode, bits, group, router_shapes[-1][0] + 1, bias, ROWS_WARPS, norm, resid)
            yield ROWS, _rows_instance(case, experts["DIN"])  # threadgroup, the last router shape's rows
        for shape, (bias, write, qknorm, splits) in product(attention_shapes, ATTENTION_VARIANTS):
            for fold in (False, True) if splits > 1 else (False,):
                yield ATTENTION, _attention_instance(shape, bias, write, flavor, qknorm, splits, fold=fold)
        for shape in attention_shapes:
            yield COMBINE, _combine_instance(shape, 3, flavor)
        for (shape, bias, qknorm, declared), splits in product(DECLARED_RUNS, (1, 3)):
            yield ATTENTION, _attention_instance(shape, bias, splits == 3, flavor, qknorm, splits, declared)
            if splits == 3:
                yield ATTENTION, _attention_instance(shape, bias, True, flavor, qknorm, splits, declared, True)
            yield COMBINE, _combine_instance(shape, 3, flavor, declared.gate)


def _router_instance(n_exp: int, top_k: int, norm: bool, shared: bool, scoring: str = SOFTMAX_THEN_TOPK,
                     groups: tuple[int, int, float] = (1, 1, 1.0), bias: bool = False, flavor: str = "f32") -> Instance:
    """The router kernel by `scoring`; with SIGMOID_GROUPED its (groups, kept groups, scaling) and selection bias."""
    return _instance(ROUTER, flavor, E=n_exp, K=top_k, **_choice(norm, shared, scoring, groups, bias))


def _choice(norm: bool, shared: bool, scoring: str, groups: tuple[int, int, float], bias: bool) -> Instance:
    """The router's template values after E and K (the router kernel's, kernel A's with ROUTE)."""
    n_group, keep, scale = groups
    return {"NORM": norm, "SHARED": shared, "SCORING": ROUTER_SCORINGS.index(scoring), "GROUPS": n_group,
            "KEEP": keep, "SCALE": float_bits(scale), "BIAS": bias}


# Kernel A selecting the experts itself (ROUTE), by each scoring: (scoring, (groups, kept groups, scaling), selection
# bias, NORM): softmax then top-k, top-k then softmax, sigmoid within the best groups with and without a bias.
ROUTE_CHOICES = [(SOFTMAX_THEN_TOPK, (1, 1, 1.0), False, True), (TOPK_THEN_SOFTMAX, (1, 1, 1.0), False, False),
                 (SIGMOID_GROUPED, (4, 2, 2.5), True, True), (SIGMOID_GROUPED, (4, 2, 2.5), False, False)]
ROUTE_EXPERTS = {**EXPERTS, "E": 40}  # two experts a lane for some lanes, groups of 10
# (choice, the shared gate's row stacked (with the shared expert folded in), warps a threadgroup): 5 leaves padding
# warps in the last threadgroup (K * DFF and DFFS are multiples of every group size, so of 8 too), 1 none
ROUTE_RUNS = list(product(ROUTE_CHOICES, (False, True), (1, 5)))


def _route_instances(choice: tuple, gate_row: bool, warps: int) -> tuple[Instance, Instance, Instance]:
    """The router kernel, kernel A reading its ids (as gpu_routed launches it) and kernel A selecting them."""
    scoring, groups, bias, norm = choice
    experts = {**ROUTE_EXPERTS, "DFFS": DFFS if gate_row else 0, "GS": 64, "GATE_BITS": 4, "UP_BITS": 4, "MODE": 0,
               "W": warps}
    return (_router_instance(ROUTE_EXPERTS["E"], K, norm, gate_row, scoring, groups, bias),
            _instance(GATE_UP, **experts),
            _instance(GATE_UP, **experts, ROUTE=True, **_choice(norm, gate_row, scoring, groups, bias)))


@dataclass(frozen=True)
class RowsCase:
    """One run of the rows kernel: the dtype flavor, the Linear's format and rows, its bias, the rows (warps) a
    threadgroup, and what it folds in: the norm before it, the residual add after it."""

    flavor: str
    mode: str
    bits: int
    group: int
    rows: int
    bias: bool = False
    warps: int = 4
    norm: bool = True
    resid: bool = False


def _rows_instance(case: RowsCase, d: int = DIN) -> Instance:
    return _instance(ROWS, case.flavor, **_format(case.mode), D=d, R=case.rows, BITS=case.bits, GS=case.group,
                     NORM=case.norm, BIAS=case.bias, RESID=case.resid, W=case.warps)


# (NORM, BIAS, RESID): a router's logits (without and with its bias), o_proj with the residual add (without and with
# its bias), as the steps launch the kernel
ROWS_VARIANTS = ((True, False, False), (True, True, False), (False, False, True), (False, True, True))
# Qwen3-MoE's router as mlx-lm quantizes it (8 bits) in the real launch's threadgroups; Qwen2-MoE's with the shared
# gate's row stacked, at 4 and 3 bits (codes straddling words); gpt-oss's (mxfp4, its bias); 6 bits; nvfp4 and
# mxfp8; rows fewer than a threadgroup's; then o_proj's (no norm, the residual added), with and without its bias
ROWS_CASES = [RowsCase("bf16", "affine", 8, 64, 128, warps=ROWS_WARPS),
              RowsCase("f32", "affine", 4, 64, 61),
              RowsCase("bf16", "affine", 3, 128, 61),
              RowsCase("bf16", "mxfp4", 4, 32, 32, bias=True),
              RowsCase("f32", "affine", 6, 32, 64, warps=8),
              RowsCase("f32", "nvfp4", 4, 16, 16, bias=True),
              RowsCase("bf16", "mxfp8", 8, 32, 3),
              RowsCase("bf16", "affine", 4, 64, 96, warps=ROWS_WARPS, norm=False, resid=True),
              RowsCase("f32", "affine", 5, 32, 40, norm=False, resid=True),
              RowsCase("bf16", "mxfp4", 4, 32, 64, bias=True, warps=ROWS_WARPS, norm=False, resid=True),
              RowsCase("bf16", "affine", 6, 128, 21, bias=True, norm=False)]


# (mode, gate bits, up bits, down bits, group): every affine width at gate/up and at down (group 64), run as the
# plain pair; then, run with the shared expert and every expert variant too, each group size at a few widths, gate
# and up at different widths, and each microscaled mode at MLX's fixed bits and group size
_WIDTH_GRID = [("affine", g, g, d, 64) for g, d in product(AFFINE_BITS, AFFINE_BITS)]
_FEATURE_CASES = [("affine", 4, 4, 4, 32), ("affine", 8, 8, 8, 64), ("affine", 4, 4, 6, 128), ("affine", 8, 8, 6, 32),
                  ("affine", 4, 4, 8, 128), ("affine", 3, 3, 6, 32), ("affine", 5, 5, 3, 128), ("affine", 2, 2, 6, 128),
                  ("affine", 3, 4, 6, 64), ("affine", 8, 2, 5, 32),
                  *((mode, FP_MODES[mode][1], FP_MODES[mode][1], FP_MODES[mode][1], FP_MODES[mode][0])
                    for mode in MICROSCALED)]
_ROUTER_RUN_CASES = [(60, 4, True, True, SOFTMAX_THEN_TOPK), (60, 8, False, True, SOFTMAX_THEN_TOPK),
                     (128, 8, True, False, SOFTMAX_THEN_TOPK), (128, 4, False, False, SOFTMAX_THEN_TOPK),
                     (4, 2, True, True, SOFTMAX_THEN_TOPK), (32, 4, False, False, TOPK_THEN_SOFTMAX),
                     (128, 4, True, False, TOPK_THEN_SOFTMAX), (60, 8, False, True, TOPK_THEN_SOFTMAX)]
# SIGMOID_GROUPED routers (E, K, groups, kept groups, scaling): Kimi-K2's, DeepSeek-V3's, GLM-4.5's, GLM-4.5-Air's;
# groups of 15 experts (across lanes); 8 groups of 8; logits and bias in `constant`
GROUPED_ROUTERS = [(384, 8, 1, 1, 2.827), (256, 8, 8, 4, 2.5), (160, 8, 1, 1, 2.5), (128, 8, 1, 1, 1.0),
                   (60, 4, 4, 2, 1.5), (64, 6, 8, 2, 1.0), (4, 1, 2, 1, 1.0)]
# (router, NORM, SHARED, the selection bias's mean, None: no bias); a mean of -1 puts most choice values below 0,
# where mlx-lm's 0 for the dropped groups' experts would choose them: route() and the kernel leave those out
_GROUPED_RUN_CASES = [(GROUPED_ROUTERS[0], True, False, 0.0), (GROUPED_ROUTERS[1], True, False, 0.0),
                      (GROUPED_ROUTERS[2], True, True, 0.0), (GROUPED_ROUTERS[3], True, False, 0.0),
                      (GROUPED_ROUTERS[4], False, True, None), (GROUPED_ROUTERS[5], True, False, -1.0),
                      (GROUPED_ROUTERS[6], False, True, 0.0)]
# Expert variants run on the CPU, each format: (biases, clamped)
_VARIANT_RUNS = [(True, False), (False, True), (True, True)]
# (shared expert width, expert biases, clamped SwiGLU): the plain pair with and without the shared expert, and
# each expert variant (never beside a shared expert)
_PAIR_RUNS = [(0, False, False), (DFFS, False, False), *((0, *variant) for variant in _VARIANT_RUNS)]
_EXPERT_RUNS = [(*case, 0, False, False) for case in _WIDTH_GRID if case not in _FEATURE_CASES] + [
    (*case, *run) for case, run in product(_FEATURE_CASES, _PAIR_RUNS)]


def _routed_instances(mode: str, gate_bits: int, up_bits: int, down_bits: int, group: int, dffs: int,
                      biases: bool = False, clamped: bool = False) -> tuple[Instance, Instance]:
    """Kernels A and B; B adds the residual stream in the shared-expert cases (both flags run on the CPU)."""
    variant = {**(_CLAMPED if clamped else {}), "EBIAS": biases}
    return (_instance(GATE_UP, **EXPERTS, DFFS=dffs, GS=group, GATE_BITS=gate_bits, UP_BITS=up_bits, **_format(mode),
                      W=5, **variant),
            _instance(DOWN, **EXPERTS, DFFS=dffs, GS=group, BITS=down_bits, RESID=dffs > 0, EBIAS=biases,
                      **_format(mode)))


def _run_instances():
    for run in _EXPERT_RUNS:
        yield from zip((GATE_UP, DOWN), _routed_instances(*run), strict=True)
    for n_exp, top_k, norm, shared, scoring in _ROUTER_RUN_CASES:
        yield ROUTER, _router_instance(n_exp, top_k, norm, shared, scoring)
    for router, norm, shared, mean in _GROUPED_RUN_CASES:
        yield ROUTER, _router_instance(*router[:2], norm, shared, SIGMOID_GROUPED, router[2:], mean is not None)
    for run in ROUTE_RUNS:
        yield from zip((ROUTER, GATE_UP, GATE_UP), _route_instances(*run), strict=True)
    for case in ROWS_CASES:
        yield ROWS, _rows_instance(case)
    for shape, (bias, write, qknorm, splits) in product(ATTENTION_SHAPES, ATTENTION_VARIANTS):
        for fold in (False, True) if splits > 1 else (False,):  # the kernel joining its partials itself (FOLD)
            yield ATTENTION, _attention_instance(shape, bias, write, qknorm=qknorm, splits=splits, fold=fold)
        if splits > 1:
            yield COMBINE, _combine_instance(shape, splits)
    for (shape, bias, qknorm, declared), splits in product(DECLARED_RUNS, (1, 3)):
        for fold in (False, True) if splits > 1 else (False,):
            yield ATTENTION, _attention_instance(shape, bias, splits == 3, qknorm=qknorm, splits=splits,
                                                 declared=declared, fold=fold)
        yield COMBINE, _combine_instance(shape, 3, gate=declared.gate)
    for (shape, bias, qknorm, declared), splits in product(GATED_RUNS, (1, 3)):
        for fold in (False, True) if splits > 1 else (False,):
            yield ATTENTION, _attention_instance(shape, bias, splits == 3, "bf16", qknorm, splits, declared, fold)
        yield COMBINE, _combine_instance(shape, 3, "bf16", gate=True)


def _metal_unit() -> str:
    """Shim, Metal prelude, one template per signature, an explicit instance per combination, launchers."""
    header = kernel_header("metal", (QUANT, SELECT, JOIN))
    instances = {(_metal_name(s, i), _args(i)): (s, i) for s, i in [
        *_compile_instances(FLAVORS, EXPERTS, DFFS, ROUTER_SHAPES, ATTENTION_SHAPES), *_run_instances()]}
    templates = {name: _metal_template(s, i) for (name, _), (s, i) in instances.items()}
    return "\n\n".join([
        f'#include "{KERNEL_DIR / "metal_cpu_shim.h"}"', header, *templates.values(),
        *(f"template decltype({name}<{args}>) {name}<{args}>;" for name, args in instances),
        *{_entry(s, i): _launcher(s, i) for s, i in _run_instances()}.values(),  # runs share some A instances
    ])


@pytest.fixture(scope="module")
def shim_library(tmp_path_factory) -> ctypes.CDLL:
    """The Metal sources built with g++ against the shim (fails the tests on any compile error)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    folder = tmp_path_factory.mktemp("shim")
    src, lib = folder / "fused_moe_metal_shim.cpp", folder / "libfusedmoe.so"
    src.write_text(_metal_unit())
    done = subprocess.run(["g++", "-std=c++20", "-O1", "-Wall", "-Werror", "-Wno-unused-variable",
                           "-Wno-unused-but-set-variable", "-fPIC", "-shared", "-pthread", str(src), "-o", str(lib)],
                          capture_output=True, text=True)
    assert done.returncode == 0, f"Metal source does not compile under the shim:\n{done.stderr[-6000:]}"
    return ctypes.CDLL(str(lib))


@pytest.mark.parametrize("stage", [ROUTER, ROWS, GATE_UP, DOWN, ATTENTION, COMBINE], ids=lambda s: s.name)
def test_each_backend_wraps_its_prelude_around_the_same_body(stage):
    """One body per kernel for both GPUs: what differs between Metal and CUDA is only the prelude before it."""
    body = compact((KERNEL_DIR / stage.body).read_text())
    metal_header, metal_source = kernel_source("metal", stage)
    cuda_header, cuda_source = kernel_source("cuda", stage)
    assert metal_source.endswith(body) and cuda_source.endswith(body)
    assert "thread_position_in_grid" in metal_source and "blockIdx" in cuda_source
    assert "simd_sum" in metal_header and "__shfl_xor_sync" in cuda_header


def test_a_backend_without_a_prelude_is_named():
    with pytest.raises(UnsupportedKernelConfig, match="no kernel prelude for backend 'rocm'"):
        kernel_source("rocm", GATE_UP)


def test_the_kernels_number_the_quantization_modes_as_the_wrappers_do():
    """The MODE a launch passes names the same format in the kernels' helpers."""
    common = (KERNEL_DIR / "moe_quant.inc").read_text()
    names = {"affine": "MB_AFFINE", "mxfp4": "MB_MXFP4", "nvfp4": "MB_NVFP4", "mxfp8": "MB_MXFP8"}
    assert set(KERNEL_MODES) == set(names) and set(MICROSCALED) == set(FP_MODES)
    for mode, name in names.items():
        assert f"#define {name} {KERNEL_MODES.index(mode)}\n" in common


def test_metal_source_compiles_for_every_supported_combination(shim_library):
    for stage, inst in _run_instances():
        assert hasattr(shim_library, _entry(stage, inst))


def _template_kind(value) -> str:
    return "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "typename"


def _quantized(rng: np.random.Generator, shape: tuple[int, ...], bits: int, group: int,
               dtype: mx.Dtype = mx.float32, mode: str = "affine") -> QuantizedParts:
    """Random weights [..., out, in] quantized in `mode` (affine scales and biases in `dtype`; the microscaled
    modes' scales uint8, no biases)."""
    w = mx.array(rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1]), dtype=dtype)
    if mode != "affine":
        return QuantizedParts(*mx.quantize(w, mode=mode), None, group, bits, mode)
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    return QuantizedParts(q, s, b, group, bits, "affine")


def _experts(
    rng: np.random.Generator, bits: tuple[int, int, int], group: int, dffs: int, dtype: mx.Dtype = mx.float32,
    mode: str = "affine", n_exp: int = E,
) -> tuple[QuantizedParts, QuantizedParts, QuantizedParts, SharedExpert | None]:
    """Routed gate, up, down [n_exp, out, in] at `bits` (gate, up, down) and, with `dffs`, a shared expert
    [dffs, DIN] / [DIN, dffs] stored as they are."""
    shapes = ((DFF, DIN), (DFF, DIN), (DIN, DFF))
    gate, up, down = (_quantized(rng, (n_exp, *shape), b, group, dtype, mode)
                      for shape, b in zip(shapes, bits, strict=True))
    shared = None
    if dffs:
        shapes = ((dffs, DIN), (dffs, DIN), (DIN, dffs))
        shared = SharedExpert(*(_quantized(rng, shape, b, group, dtype, mode) for shape, b in zip(shapes, bits,
                                                                                                 strict=True)),
                              mx.array([0.7], mx.float32))
    return gate, up, down, shared


@pytest.mark.parametrize("mode", ("affine", *MICROSCALED))
@pytest.mark.parametrize("dffs", (0, DFFS))
def test_emulated_signatures_match_what_the_wrappers_launch(monkeypatch, dffs, mode):
    """Template order, element types and `constant` inputs as the real launches would have MLX write them, and
    the launch geometry the shim emulates: threadgroups of 32-lane simdgroups, the rows asked for in each,
    and a grid that covers every output row with less than one threadgroup of padding."""
    launches = {}  # stage -> its launches

    def built(backend, stage):
        def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_):
            launches.setdefault(stage, []).append((inputs, template, output_dtypes, grid, threadgroup))
            return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes, strict=True)]
        return launch

    monkeypatch.setattr(moe, "built_kernel", built)
    monkeypatch.setattr(rows_module, "built_kernel", built)
    monkeypatch.setattr(attention, "built_kernel", built)
    rng = np.random.default_rng(dffs)
    bits, group = ((3, 5, 6), 64) if mode == "affine" else ((FP_MODES[mode][1],) * 3, FP_MODES[mode][0])
    gate, up, down, shared = _experts(rng, bits, group, dffs, mx.bfloat16, mode)
    x = mx.array(rng.standard_normal(DIN).astype(np.float32), dtype=mx.bfloat16)
    rows = 5  # a count that divides none of the row counts: the grid must round up
    # without a shared expert: every declared variant (expert biases, the clamp, top-k then softmax)
    variant = None if dffs else moe.ExpertVariant(tuple(mx.zeros((E, n), mx.bfloat16) for n in (DFF, DFF, DIN)),
                                                  CLAMP)
    moe.gpu_routed("metal", x, mx.array([2, 0, 3]), mx.array([0.5, 0.3, 0.2]), gate, up, down, shared,
                   x if dffs else None, rows=rows, variant=variant)
    logits = mx.zeros((1, 4 + bool(dffs)), mx.bfloat16)
    # kernel A selecting (the stacked gate row giving the shared gate with dffs; the grouped choice with a float32
    # selection bias without)
    grouped = None if dffs else moe.GroupedChoice(mx.zeros((4,), mx.float32), 2, 2, 2.5)
    moe.routed_by_router("metal", x, logits[0], 4, K, True, bool(dffs), SIGMOID_GROUPED if grouped else
                         SOFTMAX_THEN_TOPK, grouped, gate, up, down, shared and replace(shared, sigmoid_gate=None),
                         x if dffs else None, rows=rows, variant=variant)
    moe.gpu_select("metal", logits, 4, 2, True, bool(dffs), SOFTMAX_THEN_TOPK if dffs else TOPK_THEN_SOFTMAX)
    # the grouped router, with a float32 selection bias (without dffs) or none
    grouped = moe.GroupedChoice(None if dffs else mx.zeros((4,), mx.float32), 2, 1, 2.5)
    moe.gpu_select("metal", logits, 4, 2, True, bool(dffs), SIGMOID_GROUPED, grouped)
    # the rows kernel's norm and logits before the router kernel, with the router's bias without dffs; o_proj's rows
    # with the residual added (and its bias without dffs)
    router_rows = _quantized(rng, (4 + bool(dffs), DIN), bits[0], group, mx.bfloat16, mode)
    bias = None if dffs else mx.zeros((4,), mx.bfloat16)
    norm = Norm(x, 1e-6, mx.array([1e-6], mx.float32))
    logits = rows_module.linear("metal", x[None], Rows(router_rows, bias), norm)[1]
    moe.gpu_select("metal", logits, 4, 2, True, bool(dffs))
    o_rows = _quantized(rng, (DIN, 2 * DIN), bits[2], group, mx.bfloat16, mode)
    rows_module.linear("metal", mx.concatenate([x, x])[None], Rows(o_rows, None if dffs else x), residual=x[None])
    # with dffs every option and declared variant (a quarter of each head rotated, the output gate, a window wider
    # than the cache, sinks, the rotary factor)
    declared = Declared(rope_dims=16, factor=1.5, gate=True, window=600, sinks=True) if dffs else PLAIN
    heads = declared.heads((8, 2, 64))
    qkv = mx.array(rng.standard_normal((1, attention.projection_width(heads))).astype(np.float32), dtype=mx.bfloat16)
    capacity = SPLIT_POSITIONS + 1 if dffs else CAP  # with dffs: two threadgroups a key/value head, and the join
    cache = mx.zeros((1, 2, capacity, 64), mx.bfloat16)
    norm = mx.ones((64,), mx.bfloat16)
    attention.gpu_decode_attention("metal", qkv, qkv[0] if dffs else None,
                                   rope_frequencies(declared.rope_dims or 64, 1e6), mx.array([5, capacity], mx.int32),
                                   cache, cache, heads, write=bool(dffs),
                                   qk_norm=QKNorm(norm, norm, 1e-6) if dffs else None,
                                   sinks=mx.zeros((8,), mx.bfloat16) if dffs else None, rope_scale=declared.factor)
    if dffs:  # on CUDA with a counter the kernel joins the partials itself: no second launch
        attention.gpu_decode_attention("cuda", qkv, qkv[0], rope_frequencies(16, 1e6),
                                       mx.array([5, capacity], mx.int32), cache, cache, heads, write=True,
                                       qk_norm=QKNorm(norm, norm, 1e-6),
                                       sinks=mx.zeros((8,), mx.bfloat16), rope_scale=declared.factor,
                                       counter=attention.new_counter(2))
        assert [dict(run[1])["FOLD"] for run in launches[ATTENTION]] == [False, True] and len(launches[COMBINE]) == 1
    assert set(launches) == {ROUTER, ROWS, GATE_UP, DOWN, ATTENTION} | ({COMBINE} if dffs else set())
    gate_up, down_t = (dict(launches[stage][0][1]) for stage in (GATE_UP, DOWN))
    assert gate_up["MODE"] == down_t["MODE"] == KERNEL_MODES.index(mode)
    assert (gate_up["GATE_BITS"], gate_up["UP_BITS"], down_t["BITS"]) == bits
    expected = VARIANTS_OFF if dffs else {**VARIANTS_OFF, **_CLAMPED, "EBIAS": True, "SCORING": 1}
    for stage in (ROUTER, GATE_UP, DOWN):
        template = dict(launches[stage][0][1])
        want = {**expected, "SCORING": 0} if stage is GATE_UP else expected  # A reading ids: the router's off
        assert {n: template[n] for n in VARIANTS_OFF if n in template} == \
            {n: v for n, v in want.items() if n in template}, stage.name
    template = dict(launches[GATE_UP][1][1])
    assert (template["ROUTE"], template["W"], template["SHARED"], template["SCORING"], template["BIAS"]) == \
        (True, rows, bool(dffs), ROUTER_SCORINGS.index(SOFTMAX_THEN_TOPK if dffs else SIGMOID_GROUPED), not dffs)
    assert dict(launches[GATE_UP][0][1])["W"] == 1 and len(launches[GATE_UP]) == len(launches[DOWN]) == 2
    template = dict(launches[ROUTER][1][1])
    assert (template["SCORING"], template["GROUPS"], template["KEEP"], template["SCALE"], template["BIAS"]) == \
        (ROUTER_SCORINGS.index(SIGMOID_GROUPED), 2, 1, float_bits(2.5), not dffs)
    for stage, (inputs, template, output_dtypes, _, _) in ((s, run) for s, runs in launches.items() for run in runs):
        assert [(_template_kind(v), n) for n, v in template] == TEMPLATE_PARAMS[stage], stage.name
        inst = {n: MX_TYPES[v] if isinstance(v, mx.Dtype) else v for n, v in template}
        assert [MX_TYPES[a.dtype] for a in inputs] == [_param_type(stage, n, inst) for n in stage.inputs]
        assert [MX_TYPES[d] for d in output_dtypes] == [_param_type(stage, n, inst) for n in stage.outputs]
        small = tuple(n for n, a in zip(stage.inputs, inputs, strict=True) if a.size < 8)
        assert _constant_inputs(stage, inst) == small, stage.name
    template = dict(launches[ATTENTION][0][1])
    assert template["WRITE"] is bool(dffs) and template["QKNORM"] is bool(dffs) and template["S"] == 1 + bool(dffs)
    assert (template["ROPE_DIMS"], template["FACTOR"], template["GATE"], template["WINDOW"], template["SINKS"]) == (
        (16, float_bits(1.5), True, 600, True) if dffs else (64, 0, False, 0, False))
    if dffs:
        assert dict(launches[COMBINE][0][1])["GATE"] is True
    output_rows = {GATE_UP: K * DFF + dffs, DOWN: DIN, ROUTER: 1, ROWS: 4 + bool(dffs),
                   ATTENTION: heads.n_kv_heads * template["S"] * WARPS_PER_HEAD, COMBINE: heads.n_heads}
    group_rows = {GATE_UP: rows, DOWN: rows, ROUTER: 1, ROWS: ROWS_WARPS, ATTENTION: WARPS_PER_HEAD,
                  COMBINE: 1}
    assert [dict(run[1])["R"] for run in launches[ROWS]] == [output_rows[ROWS], DIN]  # the router's, o_proj's
    for stage, (_, template, _, grid, threadgroup) in ((s, run) for s, runs in launches.items() for run in runs):
        assert tuple(threadgroup) == (LANES, group_rows[stage], 1), stage.name
        assert grid[0] == LANES and grid[2] == 1 and grid[1] % threadgroup[1] == 0, stage.name
        out_rows = dict(template)["R"] if stage is ROWS else output_rows[stage]
        assert 0 <= grid[1] - out_rows < threadgroup[1], f"{stage.name}: grid {grid}"


_SENTINEL = 0xA5A5A5A5  # the bit pattern of every output element before the kernel runs (a bfloat16's: its half)
_BITS = {4: np.uint32, 2: np.uint16}  # an element's bits by its size


def _output(n: int, ctype: str = "float") -> np.ndarray:
    """An output buffer of n elements plus one guard element past the end, all set to the sentinel."""
    bits = _BITS[np.dtype(NP_TYPES[ctype]).itemsize]
    return np.full(n + 1, _SENTINEL & np.iinfo(bits).max, bits).view(NP_TYPES[ctype])


def _unwritten(buf: np.ndarray) -> np.ndarray:
    bits = _BITS[buf.itemsize]
    return buf.view(bits) == _SENTINEL & np.iinfo(bits).max


def _written(buf: np.ndarray, name: str) -> np.ndarray:
    """The n elements of an _output buffer, checked all written and the guard past the end untouched."""
    assert _unwritten(buf[-1:]).all(), f"{name}: a padding row wrote past the end"
    assert not _unwritten(buf[:-1]).any(), f"{name}: elements {np.flatnonzero(_unwritten(buf[:-1]))[:8]} not written"
    return buf[:-1]


def _launch(lib: ctypes.CDLL, stage: Stage, inst: Instance, rows: int, buffers: dict[str, np.ndarray]) -> None:
    """Run the shimmed instance over `rows` simdgroups with the named host buffers."""
    arrays = [buffers[n] for n in stage.inputs + stage.outputs]
    for name, a in zip(stage.inputs + stage.outputs, arrays, strict=True):
        assert a.flags.c_contiguous and a.dtype == NP_TYPES[_param_type(stage, name, inst)], name
    getattr(lib, _entry(stage, inst))((ctypes.c_void_p * len(arrays))(*(a.ctypes.data for a in arrays)),
                                      ctypes.c_uint(rows))


def _host(prefix: str, p: QuantizedParts) -> dict[str, np.ndarray]:
    """As gpu_routed passes them: without biases (the microscaled modes) the scales stand in for them."""
    biases = p.scales if p.biases is None else p.biases
    return {f"{prefix}_{k}": np.ascontiguousarray(np.array(a)) for k, a in (("w", p.weight), ("s", p.scales),
                                                                           ("b", biases))}


def _unread_choice(inst: Instance) -> dict[str, np.ndarray]:
    """Kernel A's router outputs without ROUTE, as gpu_routed passes them: (1,) placeholders."""
    return {n: _output(1, _param_type(GATE_UP, n, inst)) for n in ("probs", "inds", "scores", "sgate")}


def _padded(rows: int) -> int:
    return -(-rows // 5) * 5  # a threadgroup of 5 rows: the padding rows past the end must write nothing


@pytest.mark.parametrize("mode,gate_bits,up_bits,down_bits,group,dffs,biased,clamped", _EXPERT_RUNS)
def test_shimmed_expert_kernels_match_the_reference_on_cpu(shim_library, mode, gate_bits, up_bits, down_bits, group,
                                                           dffs, biased, clamped):
    """The Metal twins against the CPU reference within float32 rounding, and their unweighted outputs against the
    float64 truth within the bound the reference meets (moebench.inspect.truth)."""
    rng = np.random.default_rng(gate_bits * 1000 + up_bits * 100 + down_bits * 10 + group + dffs + 2 * biased + clamped)
    gate, up, down, shared = _experts(rng, (gate_bits, up_bits, down_bits), group, dffs, mode=mode)
    x = rng.standard_normal(DIN).astype(np.float32)
    idx = np.array([2, 0, 3], dtype=np.uint32)
    scores = np.array([0.5, 0.3, 0.2], dtype=np.float32)
    resid = rng.standard_normal(DIN).astype(np.float32) if dffs else None
    biases = tuple(rng.standard_normal((E, n)).astype(np.float32) for n in (DFF, DFF, DIN)) if biased else None
    variant = moe.ExpertVariant(biases and tuple(map(mx.array, biases)), CLAMP if clamped else None)
    ref_out, ref_y, ref_ys = routed("reference", mx.array(x), mx.array(idx), mx.array(scores), gate, up, down, shared,
                                    None if resid is None else mx.array(resid), variant=variant)
    # as gpu_routed passes them: without a shared expert the routed arrays stand in for its (unread) inputs,
    # without biases x (kernel A) and the residual or x (kernel B)
    s_gate, s_up, s_down = (shared.gate, shared.up, shared.down) if shared else (gate, up, down)
    sgate = np.array(shared.sigmoid_gate) if shared else scores
    resid_in = x if resid is None else resid
    gate_eb, up_eb, down_eb = biases if biases else (x, x, resid_in)
    a_inst, b_inst = _routed_instances(mode, gate_bits, up_bits, down_bits, group, dffs, biased, clamped)

    act = _output(K * DFF + dffs)
    _launch(shim_library, GATE_UP, a_inst, _padded(K * DFF + dffs), {
        "x": x, "indices": idx, **_host("gate", gate), **_host("up", up), **_host("sgate", s_gate),
        **_host("sup", s_up), "gate_eb": gate_eb, "up_eb": up_eb, "logits": x, "bias": x, "act": act,
        **_unread_choice(a_inst)})
    outputs = {"y": _output(K * DIN), "ys": _output(DIN), "out": _output(DIN)}
    _launch(shim_library, DOWN, b_inst, _padded(DIN), {
        "indices": idx, "scores": scores, **_host("down", down), "act": _written(act, "act"),
        **_host("sdown", s_down), "sgate": sgate, "resid": resid_in, "down_eb": down_eb, **outputs})

    y = _written(outputs["y"], "y").reshape(K, DIN)
    checks = {"y": (y, ref_y), "out": (_written(outputs["out"], "out"), ref_out)}
    truths = {"y": (y, expert_outputs([gate, up, down], x, idx, variant))}
    if dffs:
        checks["ys"] = _written(outputs["ys"], "ys"), ref_ys
        truths["ys"] = checks["ys"][0], expert_outputs([shared.gate, shared.up, shared.down], x)
    else:
        assert _unwritten(outputs["ys"]).all(), "ys must not be written without a shared expert"
    for name, (got, want) in checks.items():
        error = nrms(got, np.array(want))
        assert error < 1e-5, f"{name}: shimmed kernels vs reference nRMS {error:.2e}"
    for name, (got, want) in truths.items():
        error = nrms(got, want)
        assert error < 5e-4, f"{name}: shimmed kernels vs float64 truth nRMS {error:.2e}"


def _down_alone(lib: ctypes.CDLL, part: QuantizedParts, idx: np.ndarray, act: np.ndarray) -> np.ndarray:
    """Kernel B alone on down experts `part` for slots `idx` against activations `act` [K, DFF] (no shared expert,
    no residual, scores of 1): the unweighted outputs y [K, DIN]."""
    outputs = {"y": _output(K * DIN), "ys": _output(DIN), "out": _output(DIN)}
    scores = np.ones(K, np.float32)
    bits = (part.bits,) * 3
    _launch(lib, DOWN, _routed_instances(part.mode, *bits, part.group_size, 0)[1], _padded(DIN), {
        "indices": idx, "scores": scores, **_host("down", part), "act": act.reshape(-1), **_host("sdown", part),
        "sgate": scores, "resid": np.zeros(DIN, np.float32), "down_eb": np.zeros(DIN, np.float32), **outputs})
    return _written(outputs["y"], "y").reshape(K, DIN)


@pytest.mark.parametrize("mode", MICROSCALED)
def test_shimmed_kernels_decode_codes_and_scales_exactly_as_mlx(shim_library, mode):
    """Kernel B on rows holding three codes (zeros elsewhere) under scale code h in row h, every slot's
    activation one-hot at its own column: each y is one decoded weight, which must equal mx.dequantize's
    bit for bit, over every scale code and every value code (NaN codes, the 2^-127 and infinite scales
    included: their NaNs, from 0 * inf, land where MLX's do)."""
    group, bits = FP_MODES[mode]
    h, j = np.arange(DIN)[:, None], np.arange(K)
    codes = np.zeros((E, DIN, DFF), np.uint32)
    codes[:, :, :K] = (h * K + j) % 2**bits  # 768 (code, scale) pairs per expert: every code, every scale
    codes[1:, :, :K] = (codes[1:, :, :K] + np.arange(1, E)[:, None, None] * 85) % 2**bits
    per = 32 // bits
    words = (codes.reshape(E, DIN, -1, per) << (np.arange(per, dtype=np.uint32) * bits)).sum(-1, dtype=np.uint32)
    scales = np.repeat(np.arange(DIN, dtype=np.uint8)[:, None], DFF // group, axis=1)[None].repeat(E, 0)
    weights = np.array(mx.dequantize(mx.array(words), mx.array(scales), None, group_size=group, bits=bits,
                                     mode=mode, dtype=mx.float32)).astype(np.float64)
    idx = np.array([3, 0, 2], np.uint32)
    act = np.zeros((K, DFF), np.float32)
    act[j, j] = 1.0
    with np.errstate(invalid="ignore"):  # 0 * inf: NaN, as in the kernel
        want = np.einsum("khf,kf->kh", weights[idx], act.astype(np.float64))
    part = QuantizedParts(mx.array(words), mx.array(scales), None, group, bits, mode)
    got = _down_alone(shim_library, part, idx, act).astype(np.float64)
    assert np.isnan(want).any() and (want[np.isfinite(want)] != 0).sum() > K * DIN // 2  # the cases are live
    bad = ~((got == want) | (np.isnan(got) & np.isnan(want)))
    assert not bad.any(), f"{bad.sum()} weights decoded differently, e.g. {got[bad][:4]} vs {want[bad][:4]}"


def _run_router(lib: ctypes.CDLL, inst: Instance, logits: np.ndarray, bias: np.ndarray | None = None):
    """(probs, inds, scores, sgate) of the shimmed router instance on one token's float32 logits (and selection
    bias; without one the logits stand in for it, as gpu_select passes them)."""
    outputs = {"probs": _output(inst["E"]), "inds": _output(inst["K"], "uint32_t"), "scores": _output(inst["K"]),
               "sgate": _output(1)}
    _launch(lib, ROUTER, inst, 1, {"logits": logits, "bias": logits if bias is None else bias, **outputs})
    return tuple(_written(outputs[n], n) for n in ROUTER.outputs)


@pytest.mark.parametrize("n_exp,top_k,norm,shared,scoring", _ROUTER_RUN_CASES)
def test_shimmed_router_matches_the_reference_on_cpu(shim_library, n_exp, top_k, norm, shared, scoring):
    """Both softmax scorings: the top-k by probability (renormalised or not), or the top-k logits scored by the
    softmax over them (which the renormalised top-k probabilities equal); probs the softmax over all experts either
    way."""
    logits = 2 * np.random.default_rng(n_exp * 10 + top_k).standard_normal(n_exp + shared).astype(np.float32)
    probs, inds, scores, sgate = _run_router(shim_library, _router_instance(n_exp, top_k, norm, shared, scoring),
                                             logits)
    ref_probs, ref_inds, ref_scores, ref_sgate = (np.array(a) for a in reference_select(
        mx.array(logits), n_exp, top_k, norm, shared, scoring))
    assert np.abs(probs - ref_probs).max() < 1e-6
    assert set(inds.tolist()) == set(ref_inds.tolist())
    assert np.all(np.diff(scores) <= 0), f"scores not highest first: {scores}"
    assert np.abs(scores - ref_scores).max() < 1e-6
    picked = probs[inds] / (probs[inds].sum() if norm or scoring == TOPK_THEN_SOFTMAX else 1.0)
    assert np.abs(scores - picked).max() < 1e-6, "scores do not belong to their expert ids"
    assert abs(sgate[0] - ref_sgate[0]) < 1e-6


@pytest.mark.parametrize("router,norm,shared,mean", _GROUPED_RUN_CASES, ids=str)
def test_shimmed_grouped_router_matches_the_reference_on_cpu(shim_library, router, norm, shared, mean):
    """SIGMOID_GROUPED at Kimi-K2's, DeepSeek-V3's, GLM-4.5's and GLM-4.5-Air's shapes and more: probs the sigmoid
    scores; the experts in route's order (score + selection bias, highest first, within the best groups); scored by
    their unbiased scores (renormalised or not) times the scaling; the bias or the groups change the choice."""
    n_exp, top_k, n_group, keep, scale = router
    rng = np.random.default_rng(n_exp * 10 + top_k)
    logits = rng.standard_normal(n_exp + shared).astype(np.float32)
    bias = None if mean is None else (mean + 0.3 * rng.standard_normal(n_exp)).astype(np.float32)
    inst = _router_instance(n_exp, top_k, norm, shared, SIGMOID_GROUPED, router[2:], bias is not None)
    probs, inds, scores, sgate = _run_router(shim_library, inst, logits, bias)
    grouped = moe.GroupedChoice(None if bias is None else mx.array(bias), n_group, keep, scale)
    ref_probs, ref_inds, ref_scores, ref_sgate = (np.array(a) for a in reference_select(
        mx.array(logits), n_exp, top_k, norm, shared, SIGMOID_GROUPED, grouped))
    assert np.abs(probs - ref_probs).max() < 1e-6
    assert inds.tolist() == ref_inds.tolist(), f"{inds} vs the reference's {ref_inds}"
    assert np.abs(scores - ref_scores).max() < 1e-6 * scale
    picked = probs[inds] / (probs[inds].sum() if norm else 1.0) * scale
    assert np.abs(scores - picked).max() < 1e-6 * scale, "scores do not belong to their expert ids"
    assert abs(sgate[0] - ref_sgate[0]) < 1e-6
    plain = moe.GroupedChoice(None, 1, 1, scale)
    unbiased = np.array(reference_select(mx.array(logits), n_exp, top_k, norm, shared, SIGMOID_GROUPED, plain)[1])
    assert set(inds.tolist()) != set(unbiased.tolist()), "neither the bias nor the groups changed the choice"


@pytest.mark.parametrize("bits", AFFINE_BITS)
def test_shimmed_kernels_unpack_every_affine_width_as_mlx_packs_it(shim_library, bits):
    """Kernel B on rows of known codes (read with scale 1 and bias 0) against activations that weigh
    `per` consecutive values by powers of 2^bits, so each output spells those codes exactly: a unit at the row's
    start, the next (its codes straddling words or bytes at 3, 5 and 6 bits) and the row's last, which between them
    cover every position of a unit; the first window holds every code value at each of its positions."""
    per = 24 // bits  # codes an exact float32 sum spells
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2**bits, (E, DIN, DFF))
    codes[..., ::32] = 0  # every group of 32 (and so of 64) holds the lowest and the highest code: exact levels
    codes[..., 1::32] = 2**bits - 1
    codes[:, :2**bits, 2:2 + per] = np.arange(2**bits)[:, None]  # every code at every position of a window
    q, s, b = mx.quantize(mx.array(codes.astype(np.float32)), group_size=64, bits=bits)
    assert np.array_equal(np.array(mx.dequantize(q, s, b, group_size=64, bits=bits)), codes)
    s, b = mx.ones_like(s), mx.zeros_like(b)  # MLX stores the codes or their mirror 2^bits - 1 - code: its own unpack
    codes = np.array(mx.dequantize(q, s, b, group_size=64, bits=bits)).astype(np.int64)  # tells which
    starts = [2, 2 + per, DFF - per]
    act = np.zeros((K, DFF), np.float32)
    for k, start in enumerate(starts):
        act[k, start:start + per] = float(2**bits) ** np.arange(per)
    idx = np.array([3, 0, 2], np.uint32)
    got = _down_alone(shim_library, QuantizedParts(q, s, b, 64, bits, "affine"), idx, act).astype(np.int64)
    for k, start in enumerate(starts):
        spelled = (got[k][:, None] >> (bits * np.arange(per))) & (2**bits - 1)
        want = codes[idx[k], :, start:start + per]
        assert np.array_equal(spelled, want), f"slot {k}: values {start}..{start + per - 1} unpacked wrong"


@pytest.mark.parametrize("choice,gate_row,warps", ROUTE_RUNS, ids=str)
def test_shimmed_kernel_a_selecting_matches_the_router_kernel_then_kernel_a(shim_library, choice, gate_row, warps):
    """Kernel A with ROUTE gives bit for bit what the router kernel and then kernel A on its ids give (one selection
    code path): the ids, scores, probs and shared gate the router kernel writes, each written, and the same
    activation, over threadgroups whose last has padding warps or none. Without ROUTE it writes none of the
    router's outputs."""
    router_inst, plain, routing = _route_instances(choice, gate_row, warps)
    n_exp = ROUTE_EXPERTS["E"]
    rng = np.random.default_rng(ROUTE_RUNS.index((choice, gate_row, warps)))
    logits = 2 * rng.standard_normal(n_exp + gate_row).astype(np.float32)
    bias = (0.3 * rng.standard_normal(n_exp)).astype(np.float32) if choice[2] else None
    probs, inds, scores, sgate = _run_router(shim_library, router_inst, logits, bias)
    dffs = DFFS if gate_row else 0
    gate, up, _, shared = _experts(rng, (4, 4, 4), 64, dffs, n_exp=n_exp)
    s_gate, s_up = (shared.gate, shared.up) if shared else (gate, up)
    x = rng.standard_normal(DIN).astype(np.float32)
    common = {"x": x, **_host("gate", gate), **_host("up", up), **_host("sgate", s_gate), **_host("sup", s_up),
              "gate_eb": x, "up_eb": x}
    rows = -(-(K * DFF + dffs) // warps) * warps
    unread = _unread_choice(plain)
    act = _output(K * DFF + dffs)
    _launch(shim_library, GATE_UP, plain, rows, {**common, "indices": inds, "logits": x, "bias": x, "act": act,
                                                 **unread})
    assert all(_unwritten(buf).all() for buf in unread.values()), "kernel A wrote the router's outputs without ROUTE"
    outputs = {"act": _output(K * DFF + dffs), "probs": _output(n_exp), "inds": _output(K, "uint32_t"),
               "scores": _output(K), "sgate": _output(1)}
    _launch(shim_library, GATE_UP, routing, rows, {**common, "indices": common["gate_w"], "logits": logits,
                                                   "bias": logits if bias is None else bias, **outputs})
    want = {"act": _written(act, "act"), "probs": probs, "inds": inds, "scores": scores, "sgate": sgate}
    for name, expected in want.items():
        got = _written(outputs[name], name)
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), f"{name}: {got} vs {expected}"
    assert (sgate[0] != 0) == gate_row


def test_shimmed_router_breaks_ties_towards_the_lower_expert_id(shim_library):
    logits = np.random.default_rng(0).uniform(-1.0, 0.0, 61).astype(np.float32)
    logits[[3, 40]] = 3.0  # a tie across lanes (3 and 8)
    logits[[37, 5]] = 2.0  # a tie within lane 5
    _, inds, scores, _ = _run_router(shim_library, _router_instance(60, 4, True, True), logits)
    assert inds.tolist() == [3, 40, 5, 37]
    assert scores[0] == scores[1] and scores[2] == scores[3]


@pytest.mark.parametrize("case", ROWS_CASES, ids=str)
def test_shimmed_rows_kernel_matches_the_reference_on_cpu(shim_library, case):
    """Threadgroups of rows each read (and with the norm normalise) x and compute their rows. xn against
    reference_linear's (the unfused path's RMSNorm); y against the quantized matmul of the input the kernel read
    (its xn, or x) as it rounds on Metal and CUDA (MLX's GPU matvecs accumulate in float32; its CPU one in bfloat16
    accumulates in bfloat16, tens of units of the last place from both), with the bias and the residual added as
    the unfused ops add them: within float32 rounding, in bfloat16 a unit of the last place where the order of the
    float32 sums flips a rounding; the matmul against the float64 truth of the dequantized rows. The padding rows of
    the last threadgroup write nothing, and without the norm xn is not written."""
    dtype = mx.bfloat16 if case.flavor == "bf16" else mx.float32
    rng = np.random.default_rng(case.rows * 10 + case.bits)
    x = mx.array(3 * rng.standard_normal(DIN), dtype)
    weight = mx.array(rng.uniform(0.5, 1.5, DIN), dtype)
    parts = _quantized(rng, (case.rows, DIN), case.bits, case.group, dtype, case.mode)
    bias = mx.array(rng.standard_normal(case.rows), dtype) if case.bias else None
    resid = mx.array(4 * rng.standard_normal(case.rows), dtype) if case.resid else None
    norm = Norm(weight, 1e-6, mx.array([1e-6], mx.float32)) if case.norm else None
    want_xn = reference_linear(x, Rows(parts, bias), norm)[0]
    inst = _rows_instance(case)
    t = _param_type(ROWS, "xn", inst)
    outputs = {"xn": _output(DIN, t), "y": _output(case.rows, t)}
    eps = norm.eps_array if case.norm else mx.zeros((1,), mx.float32)
    inputs = {"x": x, "norm_w": weight if case.norm else x, "eps": eps, "w": parts.weight, "s": parts.scales,
              "b": parts.scales if parts.biases is None else parts.biases, "bias": x if bias is None else bias,
              "resid": x if resid is None else resid}
    _launch(shim_library, ROWS, inst, -(-case.rows // case.warps) * case.warps,
            {**{n: _kernel_side(a) for n, a in inputs.items()}, **outputs})
    got = {n: _written(outputs[n], n) for n in ROWS.outputs if n != "xn" or case.norm}
    if not case.norm:
        assert _unwritten(outputs["xn"]).all(), "xn written without the norm"
    read = mx.array(_float32(got["xn"])).astype(dtype) if case.norm else x
    gpu_y = moe.matmul_f32(parts, read.astype(mx.float32)).astype(dtype)
    gpu_y = gpu_y if bias is None else gpu_y + bias
    gpu_y = gpu_y if resid is None else resid + gpu_y
    for name, ref in (("xn", want_xn), ("y", gpu_y)):
        if name not in got:
            continue
        if dtype == mx.float32:
            error = nrms(got[name], np.array(ref))
            assert error < 1e-6, f"{name}: shimmed kernel vs reference nRMS {error:.2e}"
            continue
        ulps = np.abs(got[name].astype(np.int32) - _kernel_side(ref).astype(np.int32))
        assert ulps.max() <= 1 and np.count_nonzero(ulps) <= max(1, ulps.size // 10), \
            f"{name}: {np.count_nonzero(ulps)} of {ulps.size} values off the reference's (by up to {ulps.max()} ulps)"
    truth = dequantize_f64(parts) @ np.array(read.astype(mx.float32), np.float64)
    matmul = _float32(got["y"]).astype(np.float64)
    for a in (bias, resid):  # the adds, taken away in float64 (their roundings are checked above)
        matmul -= 0.0 if a is None else np.array(a.astype(mx.float32), np.float64)
    scale = 1.0 if resid is None else np.sqrt(np.mean(np.array(resid.astype(mx.float32), np.float64) ** 2))
    limit = (5e-3 if dtype == mx.bfloat16 else 1e-6) * max(1.0, scale / np.sqrt(np.mean(truth ** 2)))
    assert nrms(matmul, truth) < limit, "y vs the truth"


# around the 8-key block edges, the second round of the warps' blocks (warp 0 again at 64), the last slot; the
# q/k norm and split variants at the first position, the second split's first and the last slot
ATTENTION_RUNS = [(*variant, pos) for variant in ATTENTION_VARIANTS
                  for pos in ((0, 1, 7, 8, 9, 63, 64, 65, CAP - 1) if variant[2:] == (False, 1) else (0, 64, CAP - 1))]


@pytest.mark.parametrize("bias,write,qknorm,splits,pos", ATTENTION_RUNS)
@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_shimmed_attention_matches_the_reference_on_cpu(shim_library, shape, bias, write, qknorm, splits, pos):
    """The layer's cache is one block of three (as in a StaticCache); the other blocks and slots >= pos of its
    own hold NaN for the kernel: it must read only the pos earlier tokens of its block plus the new one.
    With `write` it stores the new key and value at slot pos of its block, and changes nothing else; with
    `qknorm` it normalises each head of q and k first; with `splits` threadgroups a head their partials are
    joined by the second launch, or by the kernel itself (FOLD), bit for bit the same."""
    _run_attention(shim_library, shape, bias, write, qknorm, splits, pos)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("pos", [0, 4, 5, 9, 63, 64, 69, 70, CAP - 1])
@pytest.mark.parametrize("shape,bias,qknorm,declared", DECLARED_RUNS, ids=lambda v: str(v))
def test_shimmed_attention_variants_match_the_reference_on_cpu(shim_library, shape, bias, qknorm, declared, splits,
                                                               pos):
    """Each declared variant against the reference, below and above the windows (5 and 70 positions), at the
    warps' block edges, across the splits' chunks (64 positions), with the in-place write when split: slots
    outside the window hold NaN too, so a kernel reading one fails."""
    _run_attention(shim_library, shape, bias, splits == 3, qknorm, splits, pos, declared)


def _kernel_side(a: mx.array) -> np.ndarray:
    """An array as the shimmed kernel reads it: row-contiguous, bfloat16 as its bits."""
    return np.ascontiguousarray(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a))


def _float32(buf: np.ndarray) -> np.ndarray:
    """A kernel's float32 or bfloat16 (its bits) values as float32."""
    return (buf.astype(np.uint32) << 16).view(np.float32) if buf.dtype == np.uint16 else buf


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("pos", [0, 9, 64, CAP - 1])
@pytest.mark.parametrize("shape,bias,qknorm,declared", GATED_RUNS, ids=lambda v: str(v))
def test_shimmed_gated_attention_in_bfloat16_rounds_as_on_the_gpus(shim_library, shape, bias, qknorm, declared,
                                                                   splits, pos):
    """The hybrids' gated attention in bfloat16 against the reference as it rounds on Metal and CUDA (the output
    gate's sigmoid in bfloat16 op by op): the kernel rounds where it does, so only the order of float32 sums is
    left. A kernel that rounded the sigmoid once had a fifth to a third of the outputs a unit or two of the last
    place from that reference here (nRMS 1.5e-3 to 4.4e-3), and was 1.95e-3 from the CPU reference on the H200
    (tests/gpu/test_cuda_kernel.py)."""
    _run_attention(shim_library, shape, bias, splits == 3, qknorm, splits, pos, declared, "bf16")


def _run_attention(lib: ctypes.CDLL, shape: tuple[int, int, int], bias: bool, write: bool, qknorm: bool, splits: int,
                   pos: int, declared: Declared = PLAIN, flavor: str = "f32") -> None:
    """The shimmed kernel (and, split, the joining launch; and the kernel joining them itself, _check_folded) at
    position `pos` against reference_decode_attention:
    float32 within float32 rounding; bfloat16 against it as it rounds on Metal and CUDA (gpu_rounded_attention),
    where only the order of float32 sums may flip a last bit, in a value in a hundred at most."""
    heads = declared.heads(shape)
    block = pos % 3
    dtype = mx.bfloat16 if flavor == "bf16" else mx.float32
    rng = np.random.default_rng(sum(shape) * 100 + pos * 2 + bias + 4 * qknorm + 8 * splits)
    width = attention.projection_width(heads)
    qkv, qkv_bias = (mx.array(rng.standard_normal(width), dtype) for _ in range(2))
    norms = [mx.array(rng.uniform(0.5, 1.5, heads.head_dim), dtype) for _ in range(2)]
    sinks = mx.array(rng.uniform(-1.0, 3.0, heads.n_heads), dtype)  # some above the scores, some below
    qk_norm = QKNorm(*norms, 1e-6) if qknorm else None
    inv_freq = rope_frequencies(declared.rope_dims or heads.head_dim, 10000.0)
    slots = np.array([pos, CAP], np.int32)
    cache = mx.array(rng.standard_normal((2, 3, heads.n_kv_heads, CAP, heads.head_dim)), dtype)
    reference = gpu_rounded_attention if dtype == mx.bfloat16 else reference_decode_attention
    truth = reference(qkv, qkv_bias if bias else None, inv_freq, mx.array(slots), *cache, heads, block, qk_norm,
                      sinks if declared.sinks else None, declared.factor)
    oldest = max(0, pos + 1 - declared.window) if declared.window else 0
    unread = _kernel_side(mx.full(cache.shape, mx.nan, dtype))
    unread[:, block, :, oldest:pos] = _kernel_side(cache)[:, block, :, oldest:pos]
    before = unread.copy()
    instance = _attention_instance(shape, bias, write, flavor, qknorm, splits, declared)
    outputs = {n: _output(size, _param_type(ATTENTION, n, instance))
               for n, size in _attention_sizes(heads, splits, False).items()}
    rows = (heads.n_kv_heads * splits + 1) * WARPS_PER_HEAD  # a padding threadgroup past the heads writes nothing
    host = {n: _kernel_side(a) for n, a in (("qkv", qkv), ("bias", qkv_bias if bias else qkv),
                                            ("q_norm", norms[0] if qknorm else qkv),
                                            ("k_norm", norms[1] if qknorm else qkv),
                                            ("sinks", sinks if declared.sinks else qkv))}
    inputs = {**host, "inv_freq": np.array(inv_freq), "pos": slots, "keys": unread[0], "values": unread[1],
              "block": np.array([block], np.int32),
              "eps": np.array([1e-6], np.float32) if qknorm else np.array(inv_freq), "counter": np.zeros(8, np.uint32)}
    _launch(lib, ATTENTION, instance, rows, {**inputs, **outputs})
    stand_in = "out" if splits > 1 else "parts"
    assert _unwritten(outputs[stand_in]).all(), f"{stand_in}: the stand-in output was written"
    if splits > 1:
        outputs["out"] = _output(heads.n_heads * heads.head_dim, FLAVORS[flavor]["T"])
        _launch(lib, COMBINE, _combine_instance(shape, splits, flavor, declared.gate), _padded(heads.n_heads),
                {"parts": _written(outputs["parts"], "parts"), "out": outputs["out"]})
        _check_folded(lib, heads, {**instance, "FOLD": True}, rows, inputs, outputs)
    for name, want in zip(("out", "k_new", "v_new"), truth, strict=True):
        got = _written(outputs[name], name)
        values = _float32(got)
        assert np.isfinite(values).all(), f"{name}: not finite (a cache slot outside the positions attended to read?)"
        error = nrms(values, np.array(want.astype(mx.float32)).reshape(-1))
        if dtype == mx.float32:
            assert error < 1e-5, f"{name}: shimmed kernel vs reference nRMS {error:.2e}"
            continue
        # units of the last place apart: bfloat16 bits count them (a sign apart counts far more)
        ulps = np.abs(got.astype(np.int32) - _kernel_side(want).reshape(-1).astype(np.int32))
        off = np.count_nonzero(ulps)
        assert ulps.max() <= 1 and off <= max(1, ulps.size // 100), \
            f"{name}: {off} of {ulps.size} values off the reference's (by up to {ulps.max()} ulps), nRMS {error:.2e}"
    if write:
        for part, name in enumerate(("k_new", "v_new")):
            before[part, block, :, pos] = _written(outputs[name], name).reshape(heads.n_kv_heads, heads.head_dim)
    assert np.array_equal(unread, before, equal_nan=True), "the cache changed where it should not"


def _attention_sizes(heads: AttentionSpec, splits: int, fold: bool) -> dict[str, int]:
    """Elements of the attention kernel's outputs: the output (a 1-element stand-in when a second launch joins the
    partials), the new key and value, the partials (with an output gate, each head's sigmoid(gate) after them; a
    stand-in with one threadgroup a head)."""
    final, kv = heads.n_heads * heads.head_dim, heads.n_kv_heads * heads.head_dim
    parts = heads.n_heads * splits * (heads.head_dim + 2) + final * heads.output_gate
    return {"out": final if splits == 1 or fold else 1, "k_new": kv, "v_new": kv, "parts": parts if splits > 1 else 1}


def _check_folded(lib: ctypes.CDLL, heads: AttentionSpec, instance: Instance, rows: int, inputs: dict[str, np.ndarray],
                  joined: dict[str, np.ndarray]) -> None:
    """The kernel joining its partials itself (FOLD: the last threadgroup of a key/value head to draw its ticket)
    writes every output as the kernel and the joining launch did (`joined`), bit for bit, and leaves its counter
    zeros, so a second launch does the same."""
    counter = np.zeros(heads.n_kv_heads, np.uint32)
    for launch in ("first", "second"):
        outputs = {n: _output(size, _param_type(ATTENTION, n, instance))
                   for n, size in _attention_sizes(heads, instance["S"], True).items()}
        _launch(lib, ATTENTION, instance, rows, {**inputs, "counter": counter, **outputs})
        for name, got in outputs.items():
            bits = _BITS[got.itemsize]
            assert np.array_equal(_written(got, name).view(bits), joined[name][:-1].view(bits)), \
                f"{name}: the folded kernel's {launch} launch differs from the kernel and the joining launch"
        assert not counter.any(), f"the counter after the {launch} launch: {counter}"


def _cuda_constant(kind: str, name: str, value) -> str:
    """One template argument as MLX's cuda_kernel sets it at the top of the kernel."""
    if kind == "typename":
        return f"  using {name} = {CUDA_TYPES[value]};\n"
    return f"  constexpr {kind} {name} = {_cpp(value)};\n"


def _cuda_unit() -> str:
    """The CUDA prelude and bodies wrapped the way MLX's cuda_kernel does (constexpr template constants)."""
    qwen = {"E": 60, "K": 4, "DIN": 2048, "DFF": 1408}
    # Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B, partner lane ^ 16, Qwen3-235B-A22B (4 keys a block)
    attention = ((16, 16, 128), (32, 4, 128), (12, 4, 96), (64, 4, 128))
    return _cuda_kernels(_compile_instances(("bf16",), qwen, 5632, ((60, 4),), attention))


def _cuda_kernels(instances) -> str:
    """(stage, instance) pairs as one CUDA unit, each a __global__ function named custom_kernel_<stage>_<n>."""
    header = kernel_header("cuda", (QUANT, SELECT, JOIN))
    parts = ["#include <cstdint>\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cooperative_groups.h>\n"
             "#include <cuda/std/limits>\n#define inf cuda::std::numeric_limits<float>::infinity()", header,
             "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;"]
    for n, (stage, inst) in enumerate(instances):
        _, source = kernel_source("cuda", stage)
        params = [f"const {CUDA_TYPES[_param_type(stage, i, inst)]}* {i}" for i in stage.inputs]
        params += [f"{CUDA_TYPES[_param_type(stage, o, inst)]}* {o}" for o in stage.outputs]
        consts = "".join(_cuda_constant(kind, name, inst[name]) for kind, name in TEMPLATE_PARAMS[stage])
        parts.append(f"__global__ void custom_kernel_{stage.name}_{n}({', '.join(params)}) {{\n{consts}\n{source}\n}}")
    parts.append("}  // namespace mlx::core::cu")
    return "\n\n".join(parts)


def test_cuda_source_compiles_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    src = tmp_path / "fused_moe.cu"
    src.write_text(_cuda_unit())
    done = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-c", str(src), "-o", str(tmp_path / "fused_moe.o"),
                           "-Werror", "all-warnings"], capture_output=True, text=True)
    assert done.returncode == 0, f"CUDA source does not compile:\n{done.stderr[-6000:]}"


def test_kernel_a_has_every_steps_loads_in_flight_before_its_lane_sums(tmp_path):
    """A lane's steps along the row are unrolled with no branch between them, so the loads of all of them issue
    before the first lane sum (a loop of steps waited a memory round trip each: 8 at Qwen3-30B-A3B's shape)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    experts = {"E": 128, "K": 8, "DIN": 2048, "DFF": 768}  # Qwen3-30B-A3B: 256 words a row, 8 a lane
    src = tmp_path / "gate_up.cu"
    src.write_text(_cuda_kernels([(GATE_UP, _instance(GATE_UP, "bf16", **experts, DFFS=0, GS=64, GATE_BITS=4,
                                                      UP_BITS=4, MODE=0))]))
    done = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-ptx", str(src), "-o", str(tmp_path / "gate_up.ptx")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp_path / "gate_up.ptx").read_text().splitlines()
    first_sum = next(i for i, line in enumerate(lines) if "shfl.sync" in line)
    words = [line for line in lines[:first_sum] if "ld.global.u32" in line or "ld.global.nc.u32" in line]
    assert len(words) >= 2 * 8, f"{len(words)} packed words loaded before the first lane sum, not gate's and up's 8"
