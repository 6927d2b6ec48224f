"""Kernels that fold an RMSNorm into what follows it, for one decode token.

At decode every graph node costs host time (MLX encodes and launches each one), and each decoder
layer has two RMSNorms whose outputs only one launch reads:
- the entry kernel of the fused MoE block (kernels/moe_norm_router.body) does what an unfused step
  spends four nodes on between attention and kernel A: the attention residual add, the
  post-attention RMSNorm, the matmul of the router's rows (the routed experts' and the shared expert
  gate's, stacked) and the router kernel. It hands back h = x + attn (the residual stream kernel B
  adds to), the normed token kernel A reads, the router logits in float32 (recorded while recording)
  and the router kernel's selection (moebench.execution.moe.select);
- the input-norm projection (kernels/norm_matvec.body) does the input RMSNorm and the stacked q/k/v
  projection that the decode-attention kernel reads, two nodes in one.

Both are opt-in (MOEBENCH_NORM_KERNELS=1, read when a decode step runs or is traced): on the H200
(docs/benchmarks/h200.md, steps 6 to 8) the compiled decode step's GPU time is as large as its host
time, and the two kernels cost more GPU time than the MLX operations they replace (one threadgroup
for the whole router; a q/k/v projection one warp a row against MLX's tuned quantized matvec), so
the step ran slower with them (204 against 266 tok/s, interleaved). They stay for a host-bound step
(the eager loop, or a back-end whose launches cost more), where fewer nodes is the win.

Backends as in moebench.execution.moe: 'metal' and 'cuda' run the kernels, 'reference' the same
arithmetic with MLX ops (any device, the test oracle).
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from ..checkpoint.quant import QuantizedParts
from ..errors import UnsupportedKernelConfig
from .moe import GPU_BACKENDS, LANES, Stage, built_kernel, matmul_f32, reference_select

ENV_SWITCH = "MOEBENCH_NORM_KERNELS"
NORM_ROUTER = Stage("moebench_moe_norm_router", "moe_norm_router.body",
                    ("resid", "attn", "norm_w", "eps", "rw", "rs", "rb"),
                    ("h", "xn", "xf", "logits", "probs", "inds", "scores", "sgate"))
NORM_MATVEC = Stage("moebench_norm_matvec", "norm_matvec.body", ("x", "norm_w", "eps", "w", "s", "b"), ("y",))
SIMDGROUPS = 16  # of the entry kernel's one threadgroup: the router's rows spread over them (61 at A2.7B: 4 each)
ROUTER_BITS = (4, 6, 8)
PROJECTION_BITS = (4, 8)
ROWS_PER_THREADGROUP = 8  # of the input-norm projection, one row a simdgroup

# (h, xn, logits, probs, ids, scores, shared sigmoid gate)
Entry = tuple[mx.array, mx.array, mx.array, mx.array, mx.array, mx.array, mx.array]


def enabled() -> bool:
    """Whether fused decode steps run these kernels (MOEBENCH_NORM_KERNELS=1; off by default, see above)."""
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true", "on", "yes")


def rows_reason(what: str, rows: QuantizedParts | None, bits: tuple[int, ...], has_bias: bool, norm_dtype: mx.Dtype,
                dtype: mx.Dtype) -> str | None:
    """Why a norm-folding kernel cannot read `what` (its rows: None when float), or None."""
    if rows is None:
        return f"{what} is float (the kernel reads quantized rows)"
    if rows.mode != "affine" or rows.biases is None:
        return f"{what} is {rows.mode} without biases (the kernel reads affine rows with biases)"
    if rows.bits not in bits:
        return f"{what} is {rows.bits}-bit (the kernel reads {bits})"
    if rows.in_features % LANES:
        return f"hidden size {rows.in_features} (the kernel needs a multiple of {LANES})"
    if has_bias:
        return f"{what} has a bias"
    if norm_dtype != dtype:
        return f"the norm's weight is {norm_dtype}, the activations {dtype}"
    return None


def support_reason(router: QuantizedParts | None, has_bias: bool, norm_dtype: mx.Dtype, dtype: mx.Dtype
                   ) -> str | None:
    """Why the entry kernel cannot run a block whose router rows are `router` (None: float), or None."""
    return rows_reason("the router", router, ROUTER_BITS, has_bias, norm_dtype, dtype)


def projection_reason(rows: QuantizedParts | None, norm_dtype: mx.Dtype, dtype: mx.Dtype) -> str | None:
    """Why the input-norm projection cannot run these stacked rows (None: float), or None. A bias stays
    outside (the decode-attention kernel adds it)."""
    return rows_reason("the q/k/v projection", rows, PROJECTION_BITS, False, norm_dtype, dtype)


@functools.lru_cache(maxsize=8)
def eps_array(eps: float) -> mx.array:
    """float32 [1] holding the norm's epsilon: the kernel takes it as an input (templates take no floats)."""
    a = mx.array([eps], mx.float32)
    mx.eval(a)
    return a


_checked: set[tuple] = set()


def check_inputs(resid: mx.array, attn: mx.array, norm_w: mx.array, router: QuantizedParts, num_experts: int,
                 top_k: int, gate_row: bool) -> None:
    """Shapes and dtypes the kernel assumes, checked in Python (a bad launch would abort the process); a
    combination seen before is not checked again (decode repeats one)."""
    key = (resid.shape, resid.dtype, attn.shape, attn.dtype, norm_w.shape, norm_w.dtype, router.weight.shape,
           router.scales.shape, router.scales.dtype, router.bits, router.group_size, num_experts, top_k, gate_row)
    if key in _checked:
        return
    reason = support_reason(router, False, norm_w.dtype, resid.dtype)
    if reason:
        raise UnsupportedKernelConfig(reason)
    d = router.in_features
    if resid.shape[-1:] != (d,) or any(n != 1 for n in resid.shape[:-1]):
        raise UnsupportedKernelConfig(f"residual {tuple(resid.shape)}: expected one token's ({d},)")
    if attn.shape != resid.shape or attn.dtype != resid.dtype:
        raise UnsupportedKernelConfig(f"attention output {tuple(attn.shape)} {attn.dtype} must match the residual "
                                      f"{tuple(resid.shape)} {resid.dtype}")
    if norm_w.shape != (d,):
        raise UnsupportedKernelConfig(f"norm weight {tuple(norm_w.shape)}: expected ({d},)")
    rows = num_experts + gate_row
    if router.weight.ndim != 2 or router.out_features != rows:
        raise UnsupportedKernelConfig(f"router rows {tuple(router.weight.shape)} packed: expected {rows} rows "
                                      f"({num_experts} experts{' and the shared gate' if gate_row else ''})")
    if router.biases.dtype != router.scales.dtype:
        raise UnsupportedKernelConfig(f"router scales {router.scales.dtype} and biases {router.biases.dtype} differ")
    if not 1 <= top_k <= num_experts:
        raise UnsupportedKernelConfig(f"top-{top_k} of {num_experts} experts")
    _checked.add(key)


def gpu_norm_router(backend: str, resid: mx.array, attn: mx.array, norm_w: mx.array, eps: float,
                    router: QuantizedParts, num_experts: int, top_k: int, norm_topk_prob: bool, gate_row: bool
                    ) -> Entry:
    """The kernel on `backend` (see norm_router)."""
    check_inputs(resid, attn, norm_w, router, num_experts, top_k, gate_row)
    d, lead = router.in_features, tuple(resid.shape[:-1])
    h, xn, _, logits, probs, inds, scores, sgate = built_kernel(backend, NORM_ROUTER)(
        inputs=[resid, attn, norm_w, eps_array(eps), router.weight, router.scales, router.biases],
        template=[("T", resid.dtype), ("ST", router.scales.dtype), ("D", d), ("E", num_experts), ("K", top_k),
                  ("NORM", norm_topk_prob), ("SHARED", gate_row), ("BITS", router.bits),
                  ("GS", router.group_size), ("W", SIMDGROUPS)],
        grid=(LANES, SIMDGROUPS, 1), threadgroup=(LANES, SIMDGROUPS, 1),
        output_shapes=[resid.shape, resid.shape, (d,), (*lead, num_experts + gate_row), (*lead, num_experts),
                       (*lead, top_k), (*lead, top_k), (*lead, 1)],
        output_dtypes=[resid.dtype, resid.dtype, mx.float32, mx.float32, mx.float32, mx.uint32, mx.float32,
                       mx.float32],
    )
    return h, xn, logits, probs, inds, scores, sgate


def reference_norm_router(resid: mx.array, attn: mx.array, norm_w: mx.array, eps: float, router: QuantizedParts,
                          num_experts: int, top_k: int, norm_topk_prob: bool, gate_row: bool) -> Entry:
    """The kernel's arithmetic with MLX ops."""
    h = resid + attn
    xn = _normed(h, norm_w, eps)
    logits = matmul_f32(router, xn.reshape(-1).astype(mx.float32)).reshape(*resid.shape[:-1], -1)
    return (h, xn, logits, *reference_select(logits, num_experts, top_k, norm_topk_prob, gate_row))


def norm_router(backend: str, resid: mx.array, attn: mx.array, norm_w: mx.array, eps: float, router: QuantizedParts,
                num_experts: int, top_k: int, norm_topk_prob: bool, gate_row: bool) -> Entry:
    """One token's entry into the fused MoE block on `backend`: (h = resid + attn in resid's dtype, xn =
    RMSNorm(h) * norm_w, router logits [..., E (+1)] f32, then as fused_kernel.select: probs [..., E], ids
    [..., K] uint32, scores [..., K], the shared sigmoid gate [..., 1] (0 without `gate_row`)).

    resid and attn [D] or with leading axes of 1 (kept); `router`: the E routed experts' rows, then the
    shared expert gate's row when `gate_row`."""
    if backend in GPU_BACKENDS:
        return gpu_norm_router(backend, resid, attn, norm_w, eps, router, num_experts, top_k, norm_topk_prob,
                               gate_row)
    if backend != "reference":
        raise UnsupportedKernelConfig(f"unknown fused backend {backend!r} (metal, cuda or reference)")
    check_inputs(resid, attn, norm_w, router, num_experts, top_k, gate_row)
    return reference_norm_router(resid, attn, norm_w, eps, router, num_experts, top_k, norm_topk_prob, gate_row)


def _normed(x: mx.array, norm_w: mx.array, eps: float) -> mx.array:
    """RMSNorm(x) * norm_w as both kernels compute it: in float32, the normalised value rounded to x's dtype,
    then its product with the weight rounded again (where mx.fast.rms_norm rounds)."""
    xf = x.astype(mx.float32)
    inv = mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (norm_w.astype(mx.float32) * (xf * inv).astype(x.dtype).astype(mx.float32)).astype(x.dtype)


_checked_projections: set[tuple] = set()


def check_projection(x: mx.array, norm_w: mx.array, rows: QuantizedParts) -> None:
    """Shapes and dtypes the input-norm projection assumes, checked in Python once per combination."""
    key = (x.shape, x.dtype, norm_w.shape, norm_w.dtype, rows.weight.shape, rows.scales.shape, rows.scales.dtype,
           rows.bits, rows.group_size)
    if key in _checked_projections:
        return
    reason = projection_reason(rows, norm_w.dtype, x.dtype)
    if reason:
        raise UnsupportedKernelConfig(reason)
    d = rows.in_features
    if x.shape[-1:] != (d,) or any(n != 1 for n in x.shape[:-1]):
        raise UnsupportedKernelConfig(f"x {tuple(x.shape)}: expected one token's ({d},)")
    if norm_w.shape != (d,):
        raise UnsupportedKernelConfig(f"norm weight {tuple(norm_w.shape)}: expected ({d},)")
    if rows.weight.ndim != 2 or rows.biases.dtype != rows.scales.dtype:
        raise UnsupportedKernelConfig(f"rows {tuple(rows.weight.shape)} packed with {rows.scales.dtype} scales and "
                                      f"{rows.biases.dtype} biases: expected [R, D * bits / 32], one dtype")
    if rows.weight.size >= 2**31:
        raise UnsupportedKernelConfig(f"rows hold {rows.weight.size} packed words (32-bit offsets)")
    _checked_projections.add(key)


def norm_matvec(backend: str, x: mx.array, norm_w: mx.array, eps: float, rows: QuantizedParts) -> mx.array:
    """One token's W . (RMSNorm(x) * norm_w) on `backend`: x [D] or with leading axes of 1 (kept) -> [..., R]
    in x's dtype; the normed token is rounded to x's dtype first, as a separate RMSNorm rounds it."""
    if backend not in (*GPU_BACKENDS, "reference"):
        raise UnsupportedKernelConfig(f"unknown fused backend {backend!r} (metal, cuda or reference)")
    check_projection(x, norm_w, rows)
    r = rows.out_features
    if backend == "reference":
        xn = _normed(x.reshape(-1), norm_w, eps).astype(mx.float32)
        return matmul_f32(rows, xn).astype(x.dtype).reshape(*x.shape[:-1], r)
    return built_kernel(backend, NORM_MATVEC)(
        inputs=[x, norm_w, eps_array(eps), rows.weight, rows.scales, rows.biases],
        template=[("T", x.dtype), ("ST", rows.scales.dtype), ("D", rows.in_features), ("R", r), ("BITS", rows.bits),
                  ("GS", rows.group_size)],
        grid=(LANES, -(-r // ROWS_PER_THREADGROUP) * ROWS_PER_THREADGROUP, 1),
        threadgroup=(LANES, ROWS_PER_THREADGROUP, 1),
        output_shapes=[(*x.shape[:-1], r)], output_dtypes=[x.dtype],
    )[0]
