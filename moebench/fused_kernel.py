"""The fused single-token decode-MoE arithmetic: per-expert SwiGLU outputs for the top-k experts.

Backends: 'reference' (MLX ops on any device, the test oracle), 'metal' and 'cuda' (JIT kernels
built from one shared kernel body per stage in kernels/, behind a thin per-backend prelude). All
share one arithmetic: dequantize in float32 with float32 scales and biases, accumulate in float32,
SwiGLU in float32, float32 unweighted per-expert outputs y [K, D]; the combine weights them by the
router scores and sums over K in float32, then casts once to the activation dtype.

The GPU pair: kernel A (gate and up in one pass over x, SwiGLU) writes act [K, Dff] in float32;
kernel B (down) writes y [K, D] in float32 and, folded (the default), also does the combine in the
same launch, so one MoE layer costs two launches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .errors import ConfigError, UnsupportedKernelConfig
from .quant import QuantizedParts

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
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


GATE_UP = Stage("moebench_moe_gate_up", "moe_gate_up.body",
                ("x", "indices", "gate_w", "gate_s", "gate_b", "up_w", "up_s", "up_b"), ("act",))
DOWN = Stage("moebench_moe_down", "moe_down.body",
             ("indices", "scores", "down_w", "down_s", "down_b", "act"), ("y", "out"))
STAGES = (GATE_UP, DOWN)


def kernel_source(backend: str, stage: Stage) -> tuple[str, str]:
    """(header, source) for `stage` on `backend`: the backend's prelude around the shared body."""
    if backend not in PRELUDES:
        raise UnsupportedKernelConfig(f"no kernel prelude for backend {backend!r} (have {sorted(PRELUDES)})")
    header_file, indices_file = PRELUDES[backend]
    header = (KERNEL_DIR / header_file).read_text()
    source = (KERNEL_DIR / indices_file).read_text() + (KERNEL_DIR / stage.body).read_text()
    return header, source


_kernels: dict[tuple[str, str], object] = {}


def _built(backend: str, stage: Stage):
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


def check_inputs(x: mx.array, indices: mx.array, scores: mx.array, gate: QuantizedParts, up: QuantizedParts,
                 down: QuantizedParts) -> None:
    """Shapes and dtypes the kernels assume, checked in Python: a bad launch would abort the process."""
    d, dff, n_exp = gate.in_features, gate.out_features, gate.weight.shape[0]
    if x.shape not in ((d,), (1, d)):
        raise UnsupportedKernelConfig(f"x has shape {tuple(x.shape)}, the experts expect ({d},) (one token)")
    if indices.ndim != x.ndim or indices.shape[:-1] != x.shape[:-1] or scores.shape != indices.shape:
        raise UnsupportedKernelConfig(
            f"indices {tuple(indices.shape)} and scores {tuple(scores.shape)} must both be [K] for x [D] "
            f"or [1, K] for x [1, D]; x is {tuple(x.shape)}")
    if not mx.issubdtype(indices.dtype, mx.integer):
        raise UnsupportedKernelConfig(f"indices must be integers, got {indices.dtype}")
    for name, p, shape in (("gate", gate, (n_exp, dff, d)), ("up", up, (n_exp, dff, d)),
                           ("down", down, (n_exp, d, dff))):
        found = (p.weight.shape[0], p.out_features, p.in_features)
        if p.weight.ndim != 3 or found != shape:
            raise UnsupportedKernelConfig(f"{name} experts are {found} [E, out, in], expected {shape}")
        if p.weight.size >= 2**31:
            raise UnsupportedKernelConfig(f"{name} experts hold {p.weight.size} packed words (32-bit offsets)")


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


_plans: dict[tuple, LaunchPlan] = {}


def _plan(x, indices, scores, gate, up, down, rows: int, fold: bool) -> LaunchPlan:
    """The launch plan, validated once per distinct shape/dtype/geometry key (decode repeats one key)."""
    if gate.biases is None or up.biases is None or down.biases is None:
        raise UnsupportedKernelConfig("the fused kernels need affine quantization with biases")
    key = (x.shape, x.dtype, indices.shape, indices.dtype, scores.shape, scores.dtype, rows, fold,
           *((p.weight.shape, p.scales.shape, p.scales.dtype, p.biases.dtype, p.bits, p.group_size)
             for p in (gate, up, down)))
    plan = _plans.get(key)
    if plan is None:
        check_inputs(x, indices, scores, gate, up, down)
        if not 1 <= rows <= MAX_ROWS:
            raise ConfigError(f"rows per threadgroup {rows}: expected 1 to {MAX_ROWS}")
        k, d, dff, n_exp = indices.shape[-1], gate.in_features, gate.out_features, gate.weight.shape[0]
        lead = tuple(x.shape[:-1])  # () or (1,): outputs keep the caller's layout, no reshapes
        shape = [("E", n_exp), ("K", k), ("DIN", d), ("DFF", dff), ("GS", gate.group_size)]
        plan = LaunchPlan(
            gate_up_template=[("ST", gate.scales.dtype), *shape, ("BITS", gate.bits)],
            gate_up_grid=(LANES, _round_up(dff, rows), k),
            down_template=[("T", x.dtype), ("ST", gate.scales.dtype), ("S", scores.dtype), *shape,
                           ("BITS", down.bits), ("FOLD", fold)],
            down_grid=(LANES, _round_up(d, rows), 1 if fold else k),
            threadgroup=(LANES, rows, 1),
            act_shape=[(k, dff)], down_shapes=[(*lead, k, d), x.shape], down_dtypes=[mx.float32, x.dtype],
        )
        _plans[key] = plan
    return plan


def gpu_routed(
    backend: str, x: mx.array, indices: mx.array, scores: mx.array, gate: QuantizedParts, up: QuantizedParts,
    down: QuantizedParts, rows: int | None = None, fold: bool = True,
) -> tuple[mx.array, mx.array]:
    """The kernel pair on `backend`: (combined output [D] in x.dtype, unweighted y [K, D] float32).

    `rows` simdgroups per threadgroup (default MOEBENCH_FUSED_MOE_ROWS); `fold` does the combine in
    kernel B (two launches per layer), otherwise with MLX ops after it. Kept lean: at decode the
    Python cost of building a layer's graph is of the same order as the GPU work.
    """
    plan = _plan(x, indices, scores, gate, up, down, rows_per_threadgroup() if rows is None else rows, fold)
    indices = indices.astype(mx.uint32)
    st = gate.scales.dtype  # scales and biases of every projection in one dtype (a no-op cast in practice)
    act = _built(backend, GATE_UP)(
        inputs=[x.astype(mx.float32), indices, gate.weight, gate.scales, gate.biases.astype(st), up.weight,
                up.scales.astype(st), up.biases.astype(st)],
        template=plan.gate_up_template, grid=plan.gate_up_grid, threadgroup=plan.threadgroup,
        output_shapes=plan.act_shape, output_dtypes=[mx.float32],
    )[0]
    y, out = _built(backend, DOWN)(
        inputs=[indices, scores, down.weight, down.scales.astype(st), down.biases.astype(st), act],
        template=plan.down_template, grid=plan.down_grid, threadgroup=plan.threadgroup,
        output_shapes=plan.down_shapes, output_dtypes=plan.down_dtypes,
    )
    if not fold:
        out = combine(y.reshape(-1, y.shape[-1]), scores.reshape(-1)).astype(x.dtype).reshape(x.shape)
    return out, y


def _dequantized_rows(p: QuantizedParts, indices: mx.array) -> mx.array:
    """The selected experts' matrices [K, out, in] in float32 (scales and biases upcast first)."""
    return mx.dequantize(
        p.weight[indices], p.scales[indices].astype(mx.float32), p.biases[indices].astype(mx.float32),
        group_size=p.group_size, bits=p.bits,
    ).astype(mx.float32)


def reference_expert_outputs(
    x: mx.array, indices: mx.array, gate: QuantizedParts, up: QuantizedParts, down: QuantizedParts
) -> mx.array:
    """x [D], indices [K] -> unweighted expert outputs [K, D] in float32, with MLX ops."""
    xf = x.astype(mx.float32)
    g = _dequantized_rows(gate, indices) @ xf
    u = _dequantized_rows(up, indices) @ xf
    act = g / (1.0 + mx.exp(-g)) * u
    return (_dequantized_rows(down, indices) @ act[..., None]).squeeze(-1)


def combine(expert_out: mx.array, scores: mx.array) -> mx.array:
    """Weighted sum over K of float32 expert outputs [K, D] with scores [K], in float32."""
    return (expert_out * scores.astype(mx.float32)[:, None]).sum(axis=0)


def routed(
    backend: str, x: mx.array, indices: mx.array, scores: mx.array, gate: QuantizedParts, up: QuantizedParts,
    down: QuantizedParts,
) -> tuple[mx.array, mx.array]:
    """One token's routed-expert output on `backend`: (weighted sum [D] in x.dtype, unweighted y [K, D] f32).

    x [D] with indices and scores [K], or x [1, D] with [1, K] (a decode step as the MoE block holds
    it): the outputs follow, [1, D] and [1, K, D], without reshape ops on the GPU path.
    """
    if backend in GPU_BACKENDS:
        return gpu_routed(backend, x, indices, scores, gate, up, down)
    if backend != "reference":
        raise UnsupportedKernelConfig(f"unknown fused backend {backend!r} (metal, cuda or reference)")
    check_inputs(x, indices, scores, gate, up, down)
    lead = tuple(x.shape[:-1])
    y = reference_expert_outputs(x.reshape(-1), indices.reshape(-1), gate, up, down)
    out = combine(y, scores.reshape(-1)).astype(x.dtype)
    return out.reshape(x.shape), y.reshape(*lead, *y.shape)
