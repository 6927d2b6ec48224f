"""The fused single-token decode-MoE arithmetic: router top-k, routed experts and the shared expert.

Backends: 'reference' (MLX ops on any device, the test oracle), 'metal' and 'cuda' (JIT kernels
built from one shared kernel body per stage in kernels/, behind a thin per-backend prelude). All
share one arithmetic: dequantize in float32 with float32 scales and biases, accumulate in float32,
SwiGLU in float32, float32 unweighted outputs per routed expert y [K, D] and of the shared expert
ys [D]; the combine sum_k score_k * y_k + sigmoid_gate * ys runs in float32 and casts once to the
activation dtype.

The GPU path of one MoE layer is three launches: the router kernel (softmax, top-k and the shared
expert's sigmoid gate from one row of logits), kernel A (gate and up of every routed slot and of the
shared expert in one pass over x, SwiGLU) writing act [K * Dff + Dffs] in float32, and kernel B
(down of every slot and of the shared expert, and the combine) writing y, ys and the output.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import mlx.core as mx

from ..checkpoint.quant import QuantizedParts
from ..errors import ConfigError, UnsupportedKernelConfig

KERNEL_DIR = Path(str(resources.files("moebench") / "kernel_sources"))  # the top-level kernels/, in the wheel too
ENV_ROWS = "MOEBENCH_FUSED_MOE_ROWS"
DEFAULT_ROWS = 8
MAX_ROWS = 32
LANES = 32
GPU_BACKENDS = ("metal", "cuda")
# Per backend: the header part of the prelude (helpers) and the source part (thread indices).
PRELUDES = {"metal": ("metal_header.h", "metal_indices.inc"), "cuda": ("cuda_header.cuh", "cuda_indices.inc")}


@dataclass(frozen=True)
class Stage:
    """One of the two kernels: its body file and its parameter names (MLX writes the signature)."""

    name: str
    body: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


ROUTER = Stage("moebench_moe_router", "moe_router.body", ("logits",), ("probs", "inds", "scores", "sgate"))
GATE_UP = Stage("moebench_moe_gate_up", "moe_gate_up.body",
                ("x", "indices", "gate_w", "gate_s", "gate_b", "up_w", "up_s", "up_b",
                 "sgate_w", "sgate_s", "sgate_b", "sup_w", "sup_s", "sup_b"), ("act",))
DOWN = Stage("moebench_moe_down", "moe_down.body",
             ("indices", "scores", "down_w", "down_s", "down_b", "act", "sdown_w", "sdown_s", "sdown_b", "sgate",
              "resid"), ("y", "ys", "out"))
STAGES = (ROUTER, GATE_UP, DOWN)
COMMON = "moe_common.inc"  # helpers every body uses, after the backend's header part


def kernel_source(backend: str, stage: Stage) -> tuple[str, str]:
    """(header, source) for `stage` on `backend`: the backend's prelude around the shared body."""
    if backend not in PRELUDES:
        raise UnsupportedKernelConfig(f"no kernel prelude for backend {backend!r} (have {sorted(PRELUDES)})")
    header_file, indices_file = PRELUDES[backend]
    header = (KERNEL_DIR / header_file).read_text() + (KERNEL_DIR / COMMON).read_text()
    source = (KERNEL_DIR / indices_file).read_text() + (KERNEL_DIR / stage.body).read_text()
    return header, source


_kernels: dict[tuple[str, str], object] = {}


def built_kernel(backend: str, stage: Stage):
    """The MLX kernel object of `stage` on `backend`, built once; MLX compiles once per template."""
    key = (backend, stage.name)
    if key not in _kernels:
        header, source = kernel_source(backend, stage)
        if backend == "metal" and mx.metal.is_available():
            factory = mx.fast.metal_kernel
        elif backend == "cuda" and mx.cuda.is_available():
            factory = mx.fast.cuda_kernel
        else:
            raise UnsupportedKernelConfig(f"the {backend} back-end is not available in this MLX build")
        _kernels[key] = factory(name=stage.name, input_names=list(stage.inputs), output_names=list(stage.outputs),
                                source=source, header=header)
    return _kernels[key]


def rows_per_threadgroup() -> int:
    """Simdgroups (output rows) per threadgroup from MOEBENCH_FUSED_MOE_ROWS (default 8, 1..32)."""
    raw = os.environ.get(ENV_ROWS, "").strip()
    if not raw:
        return DEFAULT_ROWS
    try:
        rows = int(raw)
    except ValueError:
        raise ConfigError(f"{ENV_ROWS}={raw!r}: expected an integer from 1 to {MAX_ROWS}") from None
    if not 1 <= rows <= MAX_ROWS:
        raise ConfigError(f"{ENV_ROWS}={rows}: expected an integer from 1 to {MAX_ROWS}")
    return rows


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class SharedExpert:
    """The shared expert as the kernel pair takes it: quantized gate/up [Dffs, D] and down [D, Dffs], and its
    sigmoid gate for this token as float32 [1] (or [1, 1] with a [1, D] token)."""

    gate: QuantizedParts
    up: QuantizedParts
    down: QuantizedParts
    sigmoid_gate: mx.array


def check_inputs(x: mx.array, indices: mx.array, scores: mx.array, gate: QuantizedParts, up: QuantizedParts,
                 down: QuantizedParts, shared: SharedExpert | None = None, residual: mx.array | None = None) -> None:
    """Shapes and dtypes the kernels assume, checked in Python: a bad launch would abort the process."""
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
    if shared is None:
        return
    dffs = shared.gate.out_features
    for name, p, routed_p, shape in (("gate", shared.gate, gate, (dffs, d)), ("up", shared.up, up, (dffs, d)),
                                     ("down", shared.down, down, (d, dffs))):
        if p.weight.ndim != 2 or (p.out_features, p.in_features) != shape:
            raise UnsupportedKernelConfig(f"shared expert {name} is {tuple(p.weight.shape)} packed, expected {shape}")
        if (p.bits, p.group_size, p.mode) != (routed_p.bits, routed_p.group_size, routed_p.mode):
            raise UnsupportedKernelConfig(
                f"shared expert {name} is {p.bits}-bit g{p.group_size} {p.mode}, the routed experts' "
                f"{routed_p.bits}-bit g{routed_p.group_size} {routed_p.mode}")
    if shared.sigmoid_gate.shape != (*x.shape[:-1], 1):
        raise UnsupportedKernelConfig(f"shared expert gate has shape {tuple(shared.sigmoid_gate.shape)}, "
                                      f"expected {(*x.shape[:-1], 1)}")


@dataclass(frozen=True)
class LaunchPlan:
    """Everything about one layer's kernel pair that depends only on shapes, dtypes and geometry."""

    gate_up_template: list
    gate_up_grid: tuple[int, int, int]
    down_template: list
    down_grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    act_shape: list
    down_shapes: list
    down_dtypes: list
    parts: tuple  # weak references to the QuantizedParts it was planned for (the key holds their ids)


_plans: dict[tuple, LaunchPlan] = {}


def _plan(x, indices, scores, gate, up, down, shared: SharedExpert | None, residual: mx.array | None,
          rows: int) -> LaunchPlan:
    """The launch plan, validated once per layer and distinct shape/dtype/geometry (decode repeats one key).

    The weights enter the key by identity (a layer's parts are built once and reused at every step), so
    a hit costs a few comparisons; the plan keeps weak references to them, so a reused id cannot match
    parts that are gone, and a plan never keeps a model's weights alive."""
    parts = (gate, up, down) + ((shared.gate, shared.up, shared.down) if shared is not None else ())
    key = (x.shape, x.dtype, indices.shape, indices.dtype, scores.shape, scores.dtype, rows, *map(id, parts),
           shared is not None and shared.sigmoid_gate.shape, residual is not None and (residual.shape, residual.dtype))
    plan = _plans.get(key)
    if plan is None or not all(ref() is p for ref, p in zip(plan.parts, parts, strict=True)):
        if any(p.biases is None for p in parts):
            raise UnsupportedKernelConfig("the fused kernels need affine quantization with biases")
        check_inputs(x, indices, scores, gate, up, down, shared, residual)
        if not 1 <= rows <= MAX_ROWS:
            raise ConfigError(f"rows per threadgroup {rows}: expected 1 to {MAX_ROWS}")
        k, d, dff, n_exp = indices.shape[-1], gate.in_features, gate.out_features, gate.weight.shape[0]
        dffs = shared.gate.out_features if shared is not None else 0
        lead = tuple(x.shape[:-1])  # (), (1,), (1, 1), ...: outputs keep the caller's layout, no reshapes
        shape = [("E", n_exp), ("K", k), ("DIN", d), ("DFF", dff), ("DFFS", dffs), ("GS", gate.group_size)]
        plan = LaunchPlan(
            gate_up_template=[("T", x.dtype), ("ST", gate.scales.dtype), *shape, ("BITS", gate.bits)],
            gate_up_grid=(LANES, _round_up(k * dff + dffs, rows), 1),
            down_template=[("T", x.dtype), ("ST", gate.scales.dtype), ("S", scores.dtype), *shape,
                           ("BITS", down.bits), ("RESID", residual is not None)],
            down_grid=(LANES, _round_up(d, rows), 1),
            threadgroup=(LANES, rows, 1),
            act_shape=[(k * dff + dffs,)],
            down_shapes=[(*lead, k, d), (*lead, d) if dffs else (1,), x.shape],
            down_dtypes=[mx.float32, mx.float32, x.dtype],
            parts=tuple(map(weakref.ref, parts)),
        )
        _plans[key] = plan
    return plan


def gpu_routed(
    backend: str, x: mx.array, indices: mx.array, scores: mx.array, gate: QuantizedParts, up: QuantizedParts,
    down: QuantizedParts, shared: SharedExpert | None = None, residual: mx.array | None = None,
    rows: int | None = None,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """The kernel pair on `backend`: (output [D] in x.dtype, unweighted y [K, D] f32, shared ys [D] f32 or None).

    `rows` simdgroups per threadgroup (default MOEBENCH_FUSED_MOE_ROWS). Kept lean: at decode the
    Python cost of building a layer's graph is of the same order as the GPU work. A kernel's inputs
    are fixed, so without a shared expert the routed arrays stand in for its (unread) inputs, and
    without a residual x does.
    """
    plan = _plan(x, indices, scores, gate, up, down, shared, residual,
                 rows_per_threadgroup() if rows is None else rows)
    indices = indices.astype(mx.uint32)
    st = gate.scales.dtype  # scales and biases of every projection in one dtype (a no-op cast in practice)
    s_gate, s_up, s_down = (shared.gate, shared.up, shared.down) if shared is not None else (gate, up, down)
    act = built_kernel(backend, GATE_UP)(
        inputs=[x, indices, gate.weight, gate.scales, gate.biases.astype(st), up.weight,
                up.scales.astype(st), up.biases.astype(st), s_gate.weight, s_gate.scales.astype(st),
                s_gate.biases.astype(st), s_up.weight, s_up.scales.astype(st), s_up.biases.astype(st)],
        template=plan.gate_up_template, grid=plan.gate_up_grid, threadgroup=plan.threadgroup,
        output_shapes=plan.act_shape, output_dtypes=[mx.float32],
    )[0]
    y, ys, out = built_kernel(backend, DOWN)(
        inputs=[indices, scores, down.weight, down.scales.astype(st), down.biases.astype(st), act, s_down.weight,
                s_down.scales.astype(st), s_down.biases.astype(st),
                shared.sigmoid_gate if shared is not None else scores, residual if residual is not None else x],
        template=plan.down_template, grid=plan.down_grid, threadgroup=plan.threadgroup,
        output_shapes=plan.down_shapes, output_dtypes=plan.down_dtypes,
    )
    return out, y, ys if shared is not None else None


def gpu_select(backend: str, logits: mx.array, num_experts: int, top_k: int, norm_topk_prob: bool,
               gate_row: bool) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The router kernel on `backend`: one token's logits [..., E (+1)] -> (probs [..., E] f32, ids [..., K]
    uint32, scores [..., K] f32, shared sigmoid gate [..., 1] f32, 0 without `gate_row`), the leading axes
    all 1 and kept. `gate_row`: the last logit is the shared expert gate's."""
    lead = tuple(logits.shape[:-1])
    if logits.shape[-1:] != (num_experts + gate_row,) or any(n != 1 for n in lead) or not 1 <= top_k <= num_experts:
        raise UnsupportedKernelConfig(f"router logits {tuple(logits.shape)} with top-{top_k}: expected one token's "
                                      f"{num_experts + gate_row} logits and 1 <= top_k <= {num_experts}")
    return tuple(built_kernel(backend, ROUTER)(
        inputs=[logits],
        template=[("LT", logits.dtype), ("E", num_experts), ("K", top_k), ("NORM", norm_topk_prob),
                  ("SHARED", gate_row)],
        grid=(LANES, 1, 1), threadgroup=(LANES, 1, 1),
        output_shapes=[(*lead, num_experts), (*lead, top_k), (*lead, top_k), (*lead, 1)],
        output_dtypes=[mx.float32, mx.uint32, mx.float32, mx.float32],
    ))


def reference_select(logits: mx.array, num_experts: int, top_k: int, norm_topk_prob: bool,
                     gate_row: bool) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The router kernel's arithmetic with MLX ops (highest probability first)."""
    lf = logits.astype(mx.float32)
    probs = mx.softmax(lf[..., :num_experts], axis=-1, precise=True)
    inds = mx.argsort(-probs, axis=-1)[..., :top_k].astype(mx.uint32)
    scores = mx.take_along_axis(probs, inds, axis=-1)
    if norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    sgate = mx.sigmoid(lf[..., num_experts:]) if gate_row else mx.zeros((*lf.shape[:-1], 1), mx.float32)
    return probs, inds, scores, sgate


def select(backend: str, logits: mx.array, num_experts: int, top_k: int, norm_topk_prob: bool,
           gate_row: bool) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """One token's router selection on `backend` (see gpu_select)."""
    if backend in GPU_BACKENDS:
        return gpu_select(backend, logits, num_experts, top_k, norm_topk_prob, gate_row)
    return reference_select(logits, num_experts, top_k, norm_topk_prob, gate_row)


def matmul_f32(p: QuantizedParts, v: mx.array, indices: mx.array | None = None) -> mx.array:
    """v @ W^T in float32 with W dequantized in float32 (scales and biases upcast first): v [D] -> [out],
    or with `indices` [K] and v [D] or [K, 1, in] -> [K, 1, out] (the selected experts' matrices)."""
    scales, biases = p.scales.astype(mx.float32), p.biases.astype(mx.float32)
    if indices is None:
        return mx.quantized_matmul(v[None], p.weight, scales, biases, transpose=True, group_size=p.group_size,
                                   bits=p.bits)[0]
    return mx.gather_qmm(v.reshape(-1, 1, v.shape[-1]), p.weight, scales, biases, rhs_indices=indices,
                         transpose=True, group_size=p.group_size, bits=p.bits)


def _swiglu_f32(g: mx.array, u: mx.array) -> mx.array:
    return g / (1.0 + mx.exp(-g)) * u


def reference_expert_outputs(
    x: mx.array, indices: mx.array, gate: QuantizedParts, up: QuantizedParts, down: QuantizedParts
) -> mx.array:
    """x [D], indices [K] -> unweighted expert outputs [K, D] in float32, with MLX ops."""
    xf = x.astype(mx.float32)
    act = _swiglu_f32(matmul_f32(gate, xf, indices), matmul_f32(up, xf, indices))
    return matmul_f32(down, act, indices)[:, 0]


def reference_shared_output(x: mx.array, shared: SharedExpert) -> mx.array:
    """x [D] -> the shared expert's unweighted output [D] in float32, with MLX ops."""
    xf = x.astype(mx.float32)
    return matmul_f32(shared.down, _swiglu_f32(matmul_f32(shared.gate, xf), matmul_f32(shared.up, xf)))


def combine(expert_out: mx.array, scores: mx.array) -> mx.array:
    """Weighted sum over K of float32 expert outputs [K, D] with scores [K], in float32."""
    return (expert_out * scores.astype(mx.float32)[:, None]).sum(axis=0)


def routed(
    backend: str, x: mx.array, indices: mx.array, scores: mx.array, gate: QuantizedParts, up: QuantizedParts,
    down: QuantizedParts, shared: SharedExpert | None = None, residual: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """One token's expert output on `backend`: ((residual +) sum_k score_k y_k (+ gate * ys) [D] in x.dtype,
    unweighted routed outputs y [K, D] f32, unweighted shared output ys [D] f32 or None without a shared
    expert).

    x [D] with indices and scores [K], or with leading axes of 1 (x [1, 1, D] with [1, 1, K], as a decode
    step holds it): the outputs keep them, without reshape ops on the GPU path.
    """
    if backend in GPU_BACKENDS:
        return gpu_routed(backend, x, indices, scores, gate, up, down, shared, residual)
    if backend != "reference":
        raise UnsupportedKernelConfig(f"unknown fused backend {backend!r} (metal, cuda or reference)")
    check_inputs(x, indices, scores, gate, up, down, shared, residual)
    lead = tuple(x.shape[:-1])
    flat_x = x.reshape(-1)
    y = reference_expert_outputs(flat_x, indices.reshape(-1), gate, up, down)
    out = combine(y, scores.reshape(-1))
    ys = None
    if shared is not None:
        ys = reference_shared_output(flat_x, shared)
        out = out + shared.sigmoid_gate.reshape(-1).astype(mx.float32) * ys
        ys = ys.reshape(x.shape)
    if residual is not None:
        out = residual.reshape(-1).astype(mx.float32) + out
    return out.astype(x.dtype).reshape(x.shape), y.reshape(*lead, *y.shape), ys
