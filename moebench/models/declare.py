"""What a block declares it computes: the vocabulary the execution layer decides from.

A family's MoE block and attention each carry a `spec` built from these words; the execution layer
(moebench.execution.support) reads the spec, never the family, to decide whether a fused kernel can run
the block and why not. A new family that computes something new adds a word here (and, if a kernel
learns it, a rule in moebench.execution.support).
"""

from __future__ import annotations

from dataclasses import dataclass

# How router logits become the routed experts' scores.
SOFTMAX_THEN_TOPK = "softmax over all experts, then top-k"
TOPK_THEN_SOFTMAX = "top-k logits, then softmax over those k"
SCORINGS = (SOFTMAX_THEN_TOPK, TOPK_THEN_SOFTMAX)

# How a shared expert joins the routed sum.
SIGMOID_GATED = "sigmoid-gated shared expert"

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
    (renormalised to sum to one when `renormalize`), the router with or without a bias, an optional shared
    expert joined as `shared`, and the experts' activation and whether they carry biases."""

    num_experts: int
    top_k: int
    scoring: str = SOFTMAX_THEN_TOPK
    renormalize: bool = False
    router_bias: bool = False
    shared: str | None = None
    activation: str = SWIGLU
    expert_bias: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"MoeSpec.scoring {self.scoring!r} is not one of {SCORINGS}")


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
