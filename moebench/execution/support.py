"""What each fused kernel supports, stated once: every rule returns the reason it declines, or None.

The plan (moebench.execution.executor) asks these before choosing a kernel and records the reason when it
declines; the kernels' own input checks (moebench.execution.moe, .attention) ask the same rules again
before a launch, so a direct call with inputs the plan would have declined is refused with the same words.
A block is judged by its declaration (moebench.models.declare) and its stored weights, never by its family.

What runs now: the kernel pair reads affine experts with biases at 2, 3, 4, 5, 6 and 8 bits (gate, up and down
each at its own width) at one group size of 32, 64 or 128, and mxfp4, nvfp4 and mxfp8 experts; the router kernel
computes each scoring a block declares (softmax then top-k, top-k then softmax, and the sigmoid scores chosen
with a selection bias among up to MAX_GROUPS groups, scaled); expert biases and the clamped SwiGLU are pair
variants. What still declines, and why, is in the rules below.
"""

from __future__ import annotations

import mlx.core as mx

from ..models.args import FP_MODES, QuantizedParts
from ..models.declare import (
    CLAMPED_SWIGLU,
    GATED_DELTA,
    PER_HEAD,
    SHARED_JOINS,
    SIGMOID_GROUPED,
    SOFTMAX_THEN_TOPK,
    SWIGLU,
    TOPK_THEN_SOFTMAX,
    AttentionSpec,
    LinearAttentionSpec,
    MoeSpec,
)
from ..models.layers import ColumnShard, Linear, RMSNorm
from .kernel import LANES

# The scorings the router kernel computes (its SCORING template constant numbers them in this order).
ROUTER_SCORINGS = (SOFTMAX_THEN_TOPK, TOPK_THEN_SOFTMAX, SIGMOID_GROUPED)
MAX_GROUPS = 32  # expert groups the router kernel ranks (its kept groups are the bits of one word)
# The experts' activations kernel A computes (its ACT template constant numbers them in this order).
ACTIVATIONS = (SWIGLU, CLAMPED_SWIGLU)
AFFINE_BITS = (2, 3, 4, 5, 6, 8)  # every affine width MLX writes but 1; gate, up and down each at its own
GROUP_SIZES = (32, 64, 128)
# The microscaled modes the pair reads: MLX's fixed (group size, bits) each, no biases, uint8 scales.
MICROSCALED = tuple(sorted(FP_MODES))
DEFAULT_MAX_DFF = {"metal": 4096, "cuda": 8192}  # expert width above which the GPU kernel lost to gather_qmm


def router_reason(spec: MoeSpec) -> str | None:
    """Why the router kernel cannot route a block declaring `spec`, or None. Every scoring is a router-kernel
    variant; SIGMOID_GROUPED's selection bias, groups and scaling are its inputs and template constants."""
    if spec.scoring not in ROUTER_SCORINGS:
        return f"routing by {spec.scoring} (the router kernel takes {' or '.join(ROUTER_SCORINGS)})"
    if spec.scoring == SIGMOID_GROUPED and spec.n_group > MAX_GROUPS:
        return f"{spec.n_group} expert groups (the router kernel ranks up to {MAX_GROUPS})"
    if spec.scoring != SIGMOID_GROUPED and spec.routed_scaling != 1.0:
        return f"scores scaled by {spec.routed_scaling:g} after {spec.scoring} (the router kernel scales only " \
               f"{SIGMOID_GROUPED})"
    return None


# Threadgroup memory the rows kernel may hold (Metal's limit per threadgroup; CUDA's static one is larger): its input
# in float32, and a float a warp.
NORM_MEMORY = 32768


def norm_memory_reason(d: int, warps: int) -> str | None:
    """Why a threadgroup of `warps` cannot hold an input of `d` values, or None."""
    if (d + warps) * 4 > NORM_MEMORY:
        return f"{d} inputs take {(d + warps) * 4} bytes of threadgroup memory (a threadgroup holds {NORM_MEMORY})"
    return None


def rows_reason(what: str, linear, dtype: mx.Dtype, warps: int, norm=None) -> str | None:
    """Why the rows kernel (moebench.execution.rows) cannot compute the Linear `linear` (named `what`) for
    activations in `dtype` in threadgroups of `warps`, with `norm` (a module, or None) normalising its input, or
    None. The norm, the matmul and what follows it then run as their own launches."""
    if norm is not None and type(norm) is not RMSNorm:
        return f"the norm before {what} is a {type(norm).__name__}, not an RMSNorm"
    if norm is not None and norm["weight"].dtype != dtype:
        return f"the norm before {what} has a {norm['weight'].dtype} weight, the activations are {dtype}"
    if isinstance(linear, ColumnShard):
        return f"{what} sharded over ranks (its partial sums joined by all_sum)"
    if not isinstance(linear, Linear):
        return f"{what} is a {type(linear).__name__}, not a Linear"
    parts = linear.quantized_parts()
    if parts is None:
        return f"{what} is float (the kernel reads quantized rows)"
    if (reason := matrix_reason(what, parts)) is not None:
        return reason
    if "bias" in linear and linear["bias"].dtype != dtype:
        return f"{what}'s bias is {linear['bias'].dtype}, the activations {dtype}"
    if parts.in_features % 4:
        return f"{what} takes {parts.in_features} inputs (the kernel reads them four at a time)"
    return norm_memory_reason(parts.in_features, warps)


def moe_declaration_reason(spec: MoeSpec) -> str | None:
    """Why the router kernel and the kernel pair cannot compute what this block declares, or None. The scorings
    are router-kernel variants (router_reason); a router bias is inside the logits the router kernel reads; expert
    biases and the clamped SwiGLU are kernel-pair variants (a shared expert with biases runs beside the pair:
    shared_fold_reason)."""
    if (reason := router_reason(spec)) is not None:
        return reason
    if spec.activation not in ACTIVATIONS:
        return f"expert activation {spec.activation} (the kernels compute {' or '.join(ACTIVATIONS)})"
    if spec.shared not in (None, *SHARED_JOINS):  # a gate of 1 joins an ADDED shared expert
        return f"a shared expert joined as {spec.shared} (the kernels take a {' or '.join(SHARED_JOINS)})"
    if spec.shared is not None and spec.activation != SWIGLU:
        return f"a shared expert beside {spec.activation} experts (kernel A would apply it to the shared expert)"
    return None


def parts_reason(gate: QuantizedParts | None, up: QuantizedParts | None, down: QuantizedParts | None) -> str | None:
    """Why the kernel pair cannot read experts stored as these gate/up/down parts (None: float), or None."""
    parts = (gate, up, down)
    if any(p is None for p in parts):
        return "float experts (the kernel needs quantized weights)"
    modes = {p.mode for p in parts}
    if len(modes) != 1:
        return f"quantization modes differ {sorted(modes)}"
    for name, p in zip(("gate", "up", "down"), parts, strict=True):
        if (reason := matrix_reason(name, p)) is not None:
            return reason
    sizes = {p.group_size for p in parts}
    if len(sizes) != 1:
        return f"group sizes differ {sorted(sizes)}"
    return None


def matrix_reason(name: str, p: QuantizedParts) -> str | None:
    """Why the kernels cannot read the quantized matrix `name` stored as `p`, or None: affine with biases at
    AFFINE_BITS and GROUP_SIZES, or a microscaled mode at MLX's fixed bits and group size (no biases, uint8
    scales)."""
    if p.mode in MICROSCALED:
        group_size, bits = FP_MODES[p.mode]
        if (p.bits, p.group_size) != (bits, group_size):
            return (f"{name} is {p.mode} at {p.bits} bits, group {p.group_size} ({p.mode} is {bits} bits, "
                    f"group {group_size})")
        if p.biases is not None:
            return f"{name} is {p.mode} with biases ({p.mode} has none)"
        if p.scales.dtype != mx.uint8:
            return (f"{name} is {p.mode} with {str(p.scales.dtype).removeprefix('mlx.core.')} scales ({p.mode} "
                    f"stores uint8)")
        return None
    if p.mode != "affine":
        return f"{name} in quantization mode {p.mode} (the kernels read affine, {', '.join(MICROSCALED)})"
    if p.biases is None:
        return f"{name} is affine without biases"
    if p.bits not in AFFINE_BITS:
        return f"{name} bits {p.bits} not in {AFFINE_BITS}"
    if p.group_size not in GROUP_SIZES:
        return f"{name} group size {p.group_size} not in {GROUP_SIZES}"
    return None


def width_reason(dff: int, backend: str, max_dff: int | None = None) -> str | None:
    """Why experts of width `dff` do not pay on `backend` (`max_dff`: the cap, None for the backend's default;
    the CPU reference has none), or None."""
    if backend not in DEFAULT_MAX_DFF:
        return None
    cap = max_dff if max_dff is not None else DEFAULT_MAX_DFF[backend]
    return f"Dff {dff} above the {backend} cap {cap} (MOEBENCH_FUSED_MOE_MAX_DFF)" if dff > cap else None


def experts_reason(parts: list[QuantizedParts | None], backend: str, max_dff: int | None = None) -> str | None:
    """Why the kernel pair cannot run experts stored as `parts` (gate, up, down; SwitchGLU.quantized_parts) on
    `backend`, or None when it can."""
    return parts_reason(*parts) or width_reason(parts[0].out_features, backend, max_dff)


def moe_reason(spec: MoeSpec, parts: list[QuantizedParts | None], backend: str,
               max_dff: int | None = None) -> str | None:
    """Why the fused MoE kernels cannot run a block declaring `spec` whose experts are stored as `parts`
    on `backend`, or None when they can."""
    return moe_declaration_reason(spec) or experts_reason(parts, backend, max_dff)


def storage(p: QuantizedParts) -> str:
    return f"{p.bits}-bit g{p.group_size} {p.mode} ({str(p.scales.dtype).removeprefix('mlx.core.')} scales)"


def shared_fold_reason(routed: tuple[QuantizedParts, ...], shared: dict[str, QuantizedParts | None],
                       biased: bool = False) -> str | None:
    """Why a shared expert with these projections (name -> parts, None when float) cannot run inside the kernel
    pair beside routed experts stored as `routed` (gate, up, down), or None. It then runs as its own MLP."""
    if biased:
        return "it has biases"
    for r, (name, p) in zip(routed, shared.items(), strict=True):
        if p is None:
            return f"its {name} is float (the kernels need quantized weights)"
        if storage(p) != storage(r):
            return f"its {name} is {storage(p)}, the routed experts' {storage(r)}"
    return None


def rotary_dims(spec: AttentionSpec) -> int:
    """The dims of each head an attention declaring `spec` rotates (transformers' int(head_dim * fraction))."""
    return int(spec.head_dim * spec.rope_fraction)


# Rotated dims the kernel pairs within a lane or with lane ^ 16 (a multiple of 32), or within lanes < 32 by
# lane ^ (dims / 2) (a power of two up to 16).
_ROPE_IN_ONE_LANE = (2, 4, 8, 16)


def attention_reason(spec: AttentionSpec) -> str | None:
    """Why the decode-attention kernel cannot run an attention layer declaring `spec`, or None when it can. Partial
    rotary, an output gate, a sliding window, sinks and scaled rotary are kernel variants; q, k and v clamped
    are clamped by the step before the kernel, unless the kernel normalises them first."""
    if spec.head_dim % LANES:
        return f"head_dim {spec.head_dim} (the kernel needs a multiple of {LANES})"
    if spec.n_heads % spec.n_kv_heads:
        return f"{spec.n_heads} query heads do not divide into {spec.n_kv_heads} key/value heads"
    dims = rotary_dims(spec)
    if dims != spec.head_dim and (dims < 2 or dims % LANES and dims not in _ROPE_IN_ONE_LANE):
        return (f"rotary on {dims} of {spec.head_dim} dims of each head (the kernel rotates a multiple of {LANES} "
                f"dims, or {', '.join(map(str, _ROPE_IN_ONE_LANE))})")
    if spec.window is not None and spec.window < 1:
        return f"a sliding window of {spec.window} positions (a window holds at least the token itself)"
    if spec.clip_qkv is not None and spec.qk_norm == PER_HEAD:
        return f"q, k and v clamped at {spec.clip_qkv:g} after the per-head norm (the kernel does not clamp)"
    return None


MAX_KEY_HEAD_DIM = 256  # the gated delta kernel holds a state row's key_head_dim / 32 values a lane in registers


def linear_attention_reason(spec: LinearAttentionSpec) -> str | None:
    """Why the gated delta decode kernel cannot run a linear-attention layer declaring `spec`, or None when it can."""
    if spec.kind != GATED_DELTA:
        return f"{spec.kind} (the linear-attention kernel computes {GATED_DELTA})"
    if spec.key_head_dim % LANES or spec.key_head_dim > MAX_KEY_HEAD_DIM:
        return (f"key_head_dim {spec.key_head_dim} (the kernel needs a multiple of {LANES} up to "
                f"{MAX_KEY_HEAD_DIM})")
    if spec.num_value_heads % spec.num_key_heads:
        return f"{spec.num_value_heads} value heads do not divide into {spec.num_key_heads} key heads"
    if spec.conv_kernel < 2:
        return f"a convolution of {spec.conv_kernel} tap (the kernel carries a conv state of kernel - 1 positions)"
    return None
