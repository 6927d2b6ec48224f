"""What a block declares it computes: the vocabulary the execution layer decides from, and the parts it reads.

A family's MoE block and attention each carry a `spec` built from these words; the execution layer
(moebench.execution.support) reads the spec, never the family, to decide whether a fused kernel can run
the block and why not. A new family that computes something new adds a word here (and, if a kernel
learns it, a rule in moebench.execution.support). What a fused step reads of a block (its projections,
norms, rotary, sinks, router, experts, shared expert) the block hands over as one typed value, its `parts()`
(AttentionParts, MoeParts), and a MoE block's behaviour the step needs is the MoeBlock protocol: the
execution layer never reaches into a family's modules by attribute name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

# How router logits become the routed experts' scores.
SOFTMAX_THEN_TOPK = "softmax over all experts, then top-k"
TOPK_THEN_SOFTMAX = "top-k logits, then softmax over those k"
# GLM-4.x MoE and DeepSeek-V3: each expert's score is sigmoid(logit); the experts are chosen by score + a learned
# selection bias (only among the best `topk_group` of `n_group` groups, a group ranked by its two best biased
# scores) and weighted by their unbiased scores.
SIGMOID_GROUPED = "sigmoid scores, top-k of score + selection bias within the best groups"
SCORINGS = (SOFTMAX_THEN_TOPK, TOPK_THEN_SOFTMAX, SIGMOID_GROUPED)

# How a shared expert joins the routed sum.
SIGMOID_GATED = "sigmoid-gated shared expert"
ADDED = "shared expert added as it is"
SHARED_JOINS = (SIGMOID_GATED, ADDED)

# The experts' activation.
SWIGLU = "swiglu"
CLAMPED_SWIGLU = "clamped swiglu: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)"

# Where attention normalises q and k before rotary (RMSNorm).
PER_HEAD = "per head"
WHOLE_PROJECTION = "over the whole projection"
QK_NORMS = (None, PER_HEAD, WHOLE_PROJECTION)


@dataclass(frozen=True)
class MoeSpec:
    """One sparse MoE block: `num_experts` routed experts of which `top_k` run per token, scored by `scoring`
    (renormalised to sum to one when `renormalize`, then times `routed_scaling`), the router with or without a
    bias, an optional shared expert joined as `shared`, and the experts' activation and whether they carry biases.
    With SIGMOID_GROUPED: a learned `selection_bias` that chooses the experts but does not weigh them, and the
    experts in `n_group` equal groups of which the best `topk_group` are chosen from."""

    num_experts: int
    top_k: int
    scoring: str = SOFTMAX_THEN_TOPK
    renormalize: bool = False
    router_bias: bool = False
    shared: str | None = None
    activation: str = SWIGLU
    expert_bias: bool = False
    selection_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"MoeSpec.scoring {self.scoring!r} is not one of {SCORINGS}")
        if self.shared not in (None, *SHARED_JOINS):
            raise ValueError(f"MoeSpec.shared {self.shared!r} is not None or one of {SHARED_JOINS}")
        if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"MoeSpec: {self.num_experts} experts in {self.n_group} groups, the best "
                             f"{self.topk_group} kept: the groups must divide the experts and keep at least one")
        if self.n_group > 1 and self.scoring != SIGMOID_GROUPED:
            raise ValueError(f"MoeSpec: expert groups are chosen only with {SIGMOID_GROUPED!r} scoring")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError(f"MoeSpec: a group is ranked by its two best experts, {self.n_group} groups of "
                             f"{self.num_experts} experts leave one a group")
        if self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            raise ValueError(f"MoeSpec: the best {self.topk_group} groups hold fewer experts than top-{self.top_k}")


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer: query heads, key/value heads and their width; q/k/v biases; where q and k are
    normalised (None, PER_HEAD, WHOLE_PROJECTION); the fraction of each head that is rotated; a sliding window
    (None: every position); learned per-head sinks; q, k and v clamped to [-clip_qkv, clip_qkv] (None: not); an
    output gate (q_proj twice as wide: per head its queries, then a gate; the output times sigmoid(gate) before
    o_proj); rotary scaled beyond plain RoPE at rope_theta (`scaled_rope`: YaRN's blended frequencies and
    attention factor)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    qk_norm: str | None = None
    rope_fraction: float = 1.0
    window: int | None = None
    sinks: bool = False
    clip_qkv: float | None = None
    output_gate: bool = False
    scaled_rope: bool = False

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"AttentionSpec.qk_norm {self.qk_norm!r} is not one of {QK_NORMS}")

    @property
    def width(self) -> int:
        """Width of the stacked q/k/v projection: (H + 2 KV) * head_dim."""
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim


# A token mixing with a recurrent state in place of keys and values.
GATED_DELTA = "Gated DeltaNet linear attention"


@dataclass(frozen=True)
class LinearAttentionSpec:
    """One linear-attention layer (`kind`, e.g. GATED_DELTA): its key and value heads and their widths, and the
    causal convolution's taps. Its cache is a recurrent state (moebench.decode.state), not keys and values."""

    kind: str
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int


@dataclass(frozen=True)
class LatentAttentionSpec:
    """Multi-head latent attention (DeepSeek-V3, Kimi-K2): q through a low-rank `q_lora_rank` projection (None: a
    full q_proj), keys and values from a compressed latent of `kv_lora_rank` plus one rotary key of
    `qk_rope_head_dim` shared by every head; each head's query and key are `qk_nope_head_dim` unrotated dims and
    the rotary ones, its value `v_head_dim`. The cache holds the latent and the rotary key."""

    n_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class AttentionParts:
    """The modules and values a fused attention step reads: the q/k/v and output projections, the q/k norms where
    the layer declares them, its rotary (plain at `rope_theta`, or a declared scaled rotary's own
    `scaled_frequencies` [rotary dims / 2] and the `rope_factor` multiplying q and k) and its sinks (the heads this
    process holds), where declared."""

    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    rope_theta: float
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    scaled_frequencies: mx.array | None = None
    rope_factor: float = 1.0
    sinks: mx.array | None = None


@dataclass(frozen=True)
class MoeParts:
    """The modules a fused MoE step reads: the router (logits [.., E], its bias included), the routed experts (a
    SwitchGLU or this process's share of one), a SIGMOID_GROUPED router's selection bias [E], and the shared
    expert (gate_proj, up_proj, down_proj) with, when SIGMOID_GATED, its gate's Linear [1, D]."""

    router: nn.Module
    experts: nn.Module
    selection_bias: mx.array | None = None
    shared: nn.Module | None = None
    shared_gate: nn.Module | None = None


@dataclass(frozen=True)
class LinearAttentionParts:
    """What a fused linear-attention step reads: the layer's in-projections (a call x -> qkv, z, b, a), its
    out-projection, the convolution's weight [C, KC, 1] (MLX's layout), A_log [Hv] (float32), dt_bias [Hv] and the
    gated norm's weight [Dv] and eps."""

    project: Callable[[mx.array], tuple[mx.array, mx.array, mx.array, mx.array]]
    out_proj: nn.Module
    conv: mx.array
    a_log: mx.array
    dt_bias: mx.array
    norm: mx.array
    eps: float


class MoeBlock(Protocol):
    """What the execution layer asks of a MoE block beyond its parts: its declaration, the intervention set on it
    (whether the shared expert takes part follows from both: moebench.models.routing.shared_takes_part) and by what
    factor the shared expert joins the routed sum."""

    spec: MoeSpec
    intervention: object

    def parts(self) -> MoeParts: ...

    def shared_scale(self, x: mx.array) -> mx.array:
        """[.., 1]: sigmoid(x W_sg) for a SIGMOID_GATED shared expert, 1 for an ADDED one, times an intervention's
        shared_gate_scale."""
