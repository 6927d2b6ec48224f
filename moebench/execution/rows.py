"""A quantized Linear on one decode token in one launch, with the launch before or after it folded in.

The unfused path spends a launch on a norm before a Linear and another on the residual add after one. The rows
kernel (kernels/rows.body) computes y = Linear(x) a warp per row and, where the caller hands them, normalises x by
an RMSNorm in its prologue (every threadgroup normalises x itself, so no launch waits for another) and adds the
residual stream in its epilogue. The MoE block's norm before its router (moebench.execution.steps.MoeKernel) and
o_proj with the residual add after it (moebench.execution.steps.AttentionKernel) run through it; a layer's input
norm and its q/k/v rows do not (every threadgroup of those many rows normalising the input lost to MLX's two
launches: docs/benchmarks). Each step rounds where the unfused ops round (the norm's
two products, the matmul's output, the bias add, the residual add), so only the order of the float32 sums differs.
The reference backend runs those unfused ops (one compiled graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..errors import UnsupportedKernelConfig
from ..models.args import QuantizedParts
from .kernel import (
    GPU_BACKENDS,
    KERNEL_MODES,
    LANES,
    QUANT,
    CheckedOnce,
    Stage,
    built_kernel,
    check_backend,
    parts_signature,
    round_up,
    run_compiled,
    signature,
)
from .support import matrix_reason, norm_memory_reason

ROWS = Stage("moebench_rows", "rows.body", ("x", "norm_w", "eps", "w", "s", "b", "bias", "resid"), ("xn", "y"),
             (QUANT,))
ROWS_WARPS = 8  # rows (simdgroups) a threadgroup; each threadgroup reads (and normalises) x itself
_NO_EPS = mx.zeros((1,), mx.float32)  # eps's stand-in without a norm (unread; the kernel's eps is float32),
mx.eval(_NO_EPS)  # evaluated once here, not a node in every decode step's graph


@dataclass(frozen=True)
class Norm:
    """An RMSNorm as the rows kernel takes it: its weight [D], and eps as a float and as float32 [1] (the kernel's
    input, made once by the caller: an array a step costs host time at decode)."""

    weight: mx.array
    eps: float
    eps_array: mx.array

    @classmethod
    def of(cls, norm, eps_array: mx.array) -> Norm:
        """From an RMSNorm module (support.rows_reason accepted it)."""
        return cls(norm["weight"], norm.eps, eps_array)


@dataclass(frozen=True)
class Rows:
    """A quantized Linear's rows [R, D] and its bias [R] (None: none)."""

    parts: QuantizedParts
    bias: mx.array | None

    @classmethod
    def of(cls, linear) -> Rows:
        """From a quantized Linear module (support.rows_reason accepted it)."""
        return cls(linear.quantized_parts(), linear.get("bias"))


def _check(x: mx.array, rows: Rows, norm: Norm | None, residual: mx.array | None) -> None:
    """Shapes and dtypes the rows kernel assumes (a bad launch would abort the process)."""
    d, p = x.shape[-1], rows.parts
    if any(n != 1 for n in x.shape[:-1]) or not mx.issubdtype(x.dtype, mx.floating):
        raise UnsupportedKernelConfig(f"x {tuple(x.shape)} {x.dtype}: expected one token's floating point [D]")
    if (reason := matrix_reason("the Linear", p)) is not None:
        raise UnsupportedKernelConfig(f"the rows kernel cannot read the Linear's rows: {reason}")
    r = p.weight.shape[0] if p.weight.ndim == 2 else -1
    if p.weight.ndim != 2 or p.in_features != d or d % p.group_size or d % 4 or p.weight.shape[-1] * 32 != d * p.bits \
            or p.scales.shape != (r, d // p.group_size) or (p.biases is not None and p.biases.shape != p.scales.shape):
        raise UnsupportedKernelConfig(f"rows {tuple(p.weight.shape)} packed with scales {tuple(p.scales.shape)} at "
                                      f"{p.bits} bits, group {p.group_size}: expected rows of {d} values")
    arrays = (("bias", rows.bias, (r,)), ("norm weight", norm and norm.weight, (d,)),
              ("residual", residual, (*x.shape[:-1], r)))
    for name, a, shape in arrays:
        if a is not None and (tuple(a.shape) != shape or a.dtype != x.dtype):
            raise UnsupportedKernelConfig(f"{name} {tuple(a.shape)} {a.dtype}: expected {shape} {x.dtype}")
    if norm is not None and (norm.eps_array.shape != (1,) or norm.eps_array.dtype != mx.float32):
        raise UnsupportedKernelConfig(f"norm eps {tuple(norm.eps_array.shape)} {norm.eps_array.dtype}: expected "
                                      "float32 [1]")
    if (reason := norm_memory_reason(d, ROWS_WARPS)) is not None:
        raise UnsupportedKernelConfig(f"the rows kernel: {reason}")


_checked = CheckedOnce(_check)


def gpu_linear(backend: str, x: mx.array, rows: Rows, norm: Norm | None = None,
               residual: mx.array | None = None) -> tuple[mx.array | None, mx.array]:
    """The rows kernel on `backend` (see linear). x stands in for the inputs a call does not read (_NO_EPS for eps)."""
    p, r = rows.parts, rows.parts.weight.shape[0]
    xn, y = built_kernel(backend, ROWS)(
        inputs=[x, x if norm is None else norm.weight, _NO_EPS if norm is None else norm.eps_array, p.weight, p.scales,
                p.scales if p.biases is None else p.biases, x if rows.bias is None else rows.bias,
                x if residual is None else residual],
        template=[("T", x.dtype), ("ST", p.scales.dtype), ("D", x.shape[-1]), ("R", r), ("BITS", p.bits),
                  ("GS", p.group_size), ("MODE", KERNEL_MODES.index(p.mode)), ("NORM", norm is not None),
                  ("BIAS", rows.bias is not None), ("RESID", residual is not None), ("W", ROWS_WARPS)],
        grid=(LANES, round_up(r, ROWS_WARPS), 1), threadgroup=(LANES, ROWS_WARPS, 1),
        output_shapes=[x.shape if norm is not None else (1,), (*x.shape[:-1], r)], output_dtypes=[x.dtype, x.dtype],
    )
    return (xn if norm is not None else None), y


def reference_linear(x: mx.array, rows: Rows, norm: Norm | None = None,
                     residual: mx.array | None = None) -> tuple[mx.array | None, mx.array]:
    """linear's arithmetic by the ops the unfused path runs: the RMSNorm, the quantized matmul, the bias add, the
    residual add."""
    p = rows.parts
    xn = mx.fast.rms_norm(x, norm.weight, norm.eps) if norm is not None else None
    y = mx.quantized_matmul(x if xn is None else xn, p.weight, p.scales, p.biases, transpose=True,
                            group_size=p.group_size, bits=p.bits, mode=p.mode)
    if rows.bias is not None:
        y = y + rows.bias
    return xn, (y if residual is None else residual + y)


def _traced_linear(x: mx.array, arrays: tuple, bias: mx.array | None, norm_weight: mx.array | None,
                   residual: mx.array | None, fmt: tuple, eps: float | None) -> tuple[mx.array | None, mx.array]:
    """reference_linear with Rows and Norm given as arrays and constants (run_compiled takes arrays; the reference
    reads eps as the float, so the weight stands in for its array)."""
    norm = None if norm_weight is None else Norm(norm_weight, eps, norm_weight)
    return reference_linear(x, Rows(QuantizedParts(*arrays, *fmt), bias), norm, residual)


def linear(backend: str, x: mx.array, rows: Rows, norm: Norm | None = None,
           residual: mx.array | None = None) -> tuple[mx.array | None, mx.array]:
    """One token's x [..., D] (leading axes all 1, kept) -> (xn = norm(x) [..., D], or None without `norm`;
    y = xn (or x) @ W^T + bias (+ residual) [..., R]), both in x's dtype, in one launch on a GPU."""
    check_backend(backend)
    key = (signature(x), parts_signature(rows.parts), signature(rows.bias), norm is not None and
           (signature(norm.weight), signature(norm.eps_array)), signature(residual))
    _checked(key, x, rows, norm, residual)
    if backend in GPU_BACKENDS:
        return gpu_linear(backend, x, rows, norm, residual)
    p = rows.parts
    return run_compiled(_traced_linear, ((p.group_size, p.bits, p.mode), None if norm is None else norm.eps), x,
                        (p.weight, p.scales, p.biases), rows.bias, None if norm is None else norm.weight, residual)
