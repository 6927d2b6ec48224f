"""The fused decode step of a Gated DeltaNet layer (moebench.models.gated_delta): for one token, everything between
the in-projections and the out-projection in one launch: the causal convolution over [conv state | new q/k/v] and
SiLU, q/k L2-normalised, the decay and beta gates, the gated delta update of the float32 state, the output S q and
the gated RMSNorm with z. The unfused path builds some 25 graph nodes for it a layer a token, and at decode every
node costs host time while the GPU waits.

Backends: 'metal' and 'cuda' (kernels/gated_delta.body behind the per-backend prelude) and 'reference': the
model's own functions in MLX ops (mx.conv1d, nn.silu, normalize_qk, gates, delta_step, the gated norm's
arithmetic), one compiled graph - the CPU path and the test oracle, equal to the unfused layer's decode step.

Rounding, every backend: where the unfused path rounds to the activation dtype T on Metal and CUDA the kernel
rounds too (the convolution's output; SiLU's sigmoid op by op - exp(|x|), 1 + it, the quotient, 1 - it - and its
product; the normalised q and k and their scaling, a + dt_bias, the output before the norm, the norm's normalised
value and its product with the weight, the result); the gates, the state, S k, S q and silu(z) times the norm stay
float32. MLX's CPU rounds its sigmoid otherwise (only the exp and the result), so in bfloat16 the reference backend
on the CPU parts from the kernel by a unit of the last place in some SiLU outputs; where q . k nearly cancels those
carry into the output many times over. Where the kernel and the reference on its own GPU may differ: the order of
the float32 sums (the convolution's taps, S k and S q across lanes, the squares of the norms) and exp and log by an
ulp - in float32 a few ulps of the result; in bfloat16 such an ulp can flip the last bit of a rounded value.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedKernelConfig
from ..models.declare import LinearAttentionParts, LinearAttentionSpec
from ..models.gated_delta import L2_EPS, delta_step, gates, normalize_qk, per_value_head
from .kernel import GPU_BACKENDS, LANES, CheckedOnce, Stage, built_kernel, check_backend, run_compiled
from .support import linear_attention_reason

GATED_DELTA = Stage("moebench_gated_delta", "gated_delta.body",
                    ("qkv", "z", "b", "a", "conv_state", "conv_w", "a_log", "dt_bias", "norm_w", "consts", "state"),
                    ("out", "conv_new", "state_new"))
WARPS = 8  # simdgroups/warps a value head's threadgroup splits the state's rows over
FLOATS = (mx.float32, mx.float16, mx.bfloat16)


@dataclass(frozen=True)
class GatedDeltaWeights:
    """The layer's arrays the step reads beside its projections: the convolution's weight [C, KC, 1] (MLX's
    layout), A_log [Hv] float32, dt_bias [Hv], the gated norm's weight [Dv] and its eps."""

    conv: mx.array
    a_log: mx.array
    dt_bias: mx.array
    norm: mx.array
    eps: float

    @classmethod
    def of(cls, parts: LinearAttentionParts) -> GatedDeltaWeights:
        """The arrays a layer's parts hold now (a replaced weight is read at the next step)."""
        return cls(parts.conv, parts.a_log, parts.dt_bias, parts.norm, parts.eps)


def _expect(name: str, a: mx.array, shape: tuple[int, ...], dtype: mx.Dtype) -> None:
    if tuple(a.shape) != shape or a.dtype != dtype:
        raise UnsupportedKernelConfig(f"gated delta step: {name} {tuple(a.shape)} {a.dtype}, expected {shape} {dtype}")


def _check_inputs(qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv_state: mx.array, state: mx.array,
                  weights: GatedDeltaWeights, spec: LinearAttentionSpec) -> None:
    """Shapes and dtypes the kernel assumes, for one token of one sequence (a bad launch would abort the process)."""
    reason = linear_attention_reason(spec)
    if reason:
        raise UnsupportedKernelConfig(reason)
    hv, dv, dk, taps = spec.num_value_heads, spec.value_head_dim, spec.key_head_dim, spec.conv_kernel
    channels = 2 * spec.num_key_heads * dk + hv * dv
    dtype = qkv.dtype
    if dtype not in FLOATS:
        raise UnsupportedKernelConfig(f"gated delta step: activations in {dtype} (the kernel takes {FLOATS})")
    _expect("qkv", qkv, (1, 1, channels), dtype)
    _expect("z", z, (1, 1, hv, dv), dtype)
    _expect("b", b, (1, 1, hv), dtype)
    _expect("a", a, (1, 1, hv), dtype)
    _expect("conv state", conv_state, (1, taps - 1, channels), dtype)
    _expect("delta state", state, (1, hv, dv, dk), mx.float32)
    _expect("conv1d weight", weights.conv, (channels, taps, 1), dtype)
    _expect("A_log", weights.a_log, (hv,), mx.float32)
    _expect("dt_bias", weights.dt_bias, (hv,), dtype)
    _expect("norm weight", weights.norm, (dv,), dtype)
    if not math.isfinite(weights.eps) or weights.eps < 0:
        raise UnsupportedKernelConfig(f"gated delta step: norm eps {weights.eps}, expected a finite number >= 0")


_check = CheckedOnce(_check_inputs)


def _signature(*arrays: mx.array) -> tuple:
    return tuple((tuple(a.shape), a.dtype) for a in arrays)


def check_inputs(qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv_state: mx.array, state: mx.array,
                 weights: GatedDeltaWeights, spec: LinearAttentionSpec) -> None:
    """_check_inputs, once per combination of shapes and dtypes (decode repeats one)."""
    w = weights
    key = (_signature(qkv, z, b, a, conv_state, state, w.conv, w.a_log, w.dt_bias, w.norm), w.eps, spec)
    _check(key, qkv, z, b, a, conv_state, state, weights, spec)


@functools.lru_cache(maxsize=8)
def constants(key_dim: int, eps: float) -> mx.array:
    """float32 [3]: the q/k norm's eps (L2_EPS / key_dim, as normalize_qk passes it), key_dim^-1/2 and the gated
    norm's eps (the kernel takes floats as an input: templates take none)."""
    a = mx.array([L2_EPS / key_dim, key_dim**-0.5, eps], mx.float32)
    mx.eval(a)
    return a


def gpu_gated_delta(backend: str, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv_state: mx.array,
                    state: mx.array, weights: GatedDeltaWeights,
                    spec: LinearAttentionSpec) -> tuple[mx.array, mx.array, mx.array]:
    """The kernel on `backend`: one threadgroup of WARPS warps per value head."""
    hv, dv = spec.num_value_heads, spec.value_head_dim
    return tuple(built_kernel(backend, GATED_DELTA)(
        inputs=[qkv, z, b, a, conv_state, weights.conv, weights.a_log, weights.dt_bias, weights.norm,
                constants(spec.key_head_dim, weights.eps), state],
        template=[("T", qkv.dtype), ("HK", spec.num_key_heads), ("HV", hv), ("DK", spec.key_head_dim), ("DV", dv),
                  ("KC", spec.conv_kernel), ("W", WARPS)],
        grid=(LANES, hv * WARPS, 1), threadgroup=(LANES, WARPS, 1),
        output_shapes=[(1, 1, hv * dv), tuple(conv_state.shape), tuple(state.shape)],
        output_dtypes=[qkv.dtype, qkv.dtype, mx.float32],
    ))


def reference_gated_delta(qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv_state: mx.array,
                          state: mx.array, weights: GatedDeltaWeights,
                          spec: LinearAttentionSpec) -> tuple[mx.array, mx.array, mx.array]:
    """The step with the model's own functions in MLX ops (the arguments as gated_delta_step's)."""
    hk, hv, dk, dv = spec.num_key_heads, spec.num_value_heads, spec.key_head_dim, spec.value_head_dim
    window = mx.concatenate([conv_state, qkv], axis=1)
    mixed = nn.silu(mx.conv1d(window, weights.conv, groups=window.shape[-1]))
    q, k, v = mx.split(mixed, [hk * dk, 2 * hk * dk], axis=-1)
    q, k = normalize_qk(q.reshape(1, 1, hk, dk), k.reshape(1, 1, hk, dk))
    q, k, v = per_value_head(q, k, v.reshape(1, 1, hv, dv))
    g, beta = gates(a, b, weights.a_log, weights.dt_bias)
    o, state = delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    normed = mx.fast.rms_norm(o.astype(qkv.dtype), weights.norm, weights.eps).astype(mx.float32)
    out = (nn.silu(z[:, 0].astype(mx.float32)) * normed).astype(qkv.dtype)
    return out.reshape(1, 1, hv * dv), window[:, 1:], state


def gated_delta_step(backend: str, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv_state: mx.array,
                     state: mx.array, weights: GatedDeltaWeights,
                     spec: LinearAttentionSpec) -> tuple[mx.array, mx.array, mx.array]:
    """One token of one sequence through a Gated DeltaNet layer declaring `spec`, on `backend`: (the output before
    out_proj [1, 1, Hv * Dv] in the activation dtype, the new conv state, the new delta state).

    qkv [1, 1, C] (C = 2 Hk Dk + Hv Dv: q | k | v before the convolution), z [1, 1, Hv, Dv], b and a [1, 1, Hv]:
    the in-projections' outputs (GatedDeltaNet.project); conv_state [1, conv_kernel - 1, C] in their dtype and
    state [1, Hv, Dv, Dk] float32: the layer's states before the token (zeros before the first); `weights` the
    layer's other arrays. Inputs the kernel cannot take are an UnsupportedKernelConfig before MLX sees them."""
    check_backend(backend)
    check_inputs(qkv, z, b, a, conv_state, state, weights, spec)
    if backend in GPU_BACKENDS:
        return gpu_gated_delta(backend, qkv, z, b, a, conv_state, state, weights, spec)
    w = weights
    return run_compiled(_traced_reference, (spec, w.eps), qkv, z, b, a, conv_state, state, w.conv, w.a_log,
                        w.dt_bias, w.norm)


def _traced_reference(qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv_state: mx.array, state: mx.array,
                      conv: mx.array, a_log: mx.array, dt_bias: mx.array, norm: mx.array, spec: LinearAttentionSpec,
                      eps: float) -> tuple[mx.array, mx.array, mx.array]:
    """reference_gated_delta with the weights given as arrays (run_compiled takes arrays and constants)."""
    return reference_gated_delta(qkv, z, b, a, conv_state, state, GatedDeltaWeights(conv, a_log, dt_bias, norm, eps),
                                 spec)
