"""The entry kernel of the fused decode-MoE block: residual add, post-attention RMSNorm and router in one launch.

Between attention and kernel A an unfused decode step spends four graph nodes on one token: the
attention residual add, the post-attention RMSNorm, the matmul of the router's rows (the routed
experts' and the shared expert gate's, stacked) and the router kernel. At decode every node costs
host time (MLX encodes and launches each one), so one threadgroup does all four
(kernels/moe_norm_router.body): it hands back h = x + attn (the residual stream kernel B adds to),
the normed token kernel A reads, the router logits in float32 (recorded while recording) and the
router kernel's selection (moebench.fused_kernel.select).

Backends as in moebench.fused_kernel: 'metal' and 'cuda' run the kernel, 'reference' the same
arithmetic with MLX ops (any device, the test oracle).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from .errors import UnsupportedKernelConfig
from .fused_kernel import GPU_BACKENDS, LANES, Stage, built_kernel, matmul_f32, reference_select
from .quant import QuantizedParts

NORM_ROUTER = Stage("moebench_moe_norm_router", "moe_norm_router.body",
                    ("resid", "attn", "norm_w", "eps", "rw", "rs", "rb"),
                    ("h", "xn", "xf", "logits", "probs", "inds", "scores", "sgate"))
SIMDGROUPS = 16  # of the one threadgroup: the router's rows spread over them (61 rows at A2.7B: 4 each)
ROUTER_BITS = (4, 6, 8)

# (h, xn, logits, probs, ids, scores, shared sigmoid gate)
Entry = tuple[mx.array, mx.array, mx.array, mx.array, mx.array, mx.array, mx.array]


def support_reason(router: QuantizedParts | None, has_bias: bool, norm_dtype: mx.Dtype, dtype: mx.Dtype
                   ) -> str | None:
    """Why the entry kernel cannot run a block whose router rows are `router` (None: float), or None."""
    if router is None:
        return "the router's rows are float (the kernel reads quantized rows)"
    if router.mode != "affine" or router.biases is None:
        return f"the router's rows are {router.mode} without biases (the kernel reads affine rows with biases)"
    if router.bits not in ROUTER_BITS:
        return f"the router's rows are {router.bits}-bit (the kernel reads {ROUTER_BITS})"
    if router.in_features % LANES:
        return f"hidden size {router.in_features} (the kernel needs a multiple of {LANES})"
    if has_bias:
        return "the router has a bias"
    if norm_dtype != dtype:
        return f"the post-attention norm's weight is {norm_dtype}, the activations {dtype}"
    return None


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
    hf = h.astype(mx.float32)
    inv = mx.rsqrt(mx.mean(hf * hf, axis=-1, keepdims=True) + eps)
    xn = (norm_w.astype(mx.float32) * (hf * inv)).astype(h.dtype)
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
