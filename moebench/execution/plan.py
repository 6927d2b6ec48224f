"""How one forward call runs, layer by layer: a fused kernel or the model's own modules, and why.

A Plan is decided once per model, settings and shape class (decode or prefill, which cache, where
interventions are set) by moebench.execution.executor,
and rebuilt when any of them changes. For each layer it holds the Decision for its attention and for
its MoE block (a backend, or 'fallback' with the reason; what runs beside the kernels in `note`) and
the step that carries it out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from ..models import hooks
from ..models.hooks import Record
from .settings import ENV_SWITCH


@dataclass(frozen=True)
class Decision:
    """Which path one MoE block or attention layer takes: backend 'metal' / 'cuda' / 'reference', or
    'fallback' and why; `note`: what a fused path runs beside the kernels, and why, and on a sharded model
    (either path) which experts, or which attention heads, this rank holds."""

    path: str
    reason: str | None = None
    note: str | None = None

    @property
    def fused(self) -> bool:
        return self.path != "fallback"


SWITCHED_OFF = Decision("fallback", f"switched off ({ENV_SWITCH} / set_fused_moe)")


def tokens_decision(n: int) -> Decision:
    return Decision("fallback", f"{n} tokens (the kernel runs single-token decode)")


@dataclass(frozen=True)
class Shape:
    """The shape class a plan serves: tokens in the call (1: a decode step), and whether the cache is a compiled
    step's static one (the kernels may write it in place)."""

    tokens: int
    static: bool


# step(normed input, cache) -> attention output; step(normed input, residual, record) -> residual + block
AttentionStep = Callable[[mx.array, object], mx.array]
MoeStep = Callable[[mx.array, mx.array, Record | None], mx.array]


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer: its decisions, and the kernel steps that carry out the fused ones (None: the model's
    own module runs)."""

    attention: Decision
    moe: Decision | None  # None: a dense MLP layer
    attention_step: AttentionStep | None = None
    moe_step: MoeStep | None = None

    def run(self, layer, x: mx.array, cache, record: Record | None) -> mx.array:
        """The layer on x: h = x + attn(norm(x)); out = h + mlp(norm(h)), each part by its step or module."""
        if self.attention_step is None and self.moe_step is None:
            out = layer(x, cache, record)
        else:
            attend = self.attention_step or layer.self_attn
            h = x + attend(layer.input_layernorm(x), cache)
            xn = layer.post_attention_layernorm(h)
            inner = hooks.scope(record, hooks.MOE)
            out = self.moe_step(xn, h, inner) if self.moe_step is not None else h + layer.mlp(xn, inner)
            if record is not None:
                hooks.record_residuals(record, x, h, out)
        if record is not None:
            record(hooks.ATTN_PATH, self.attention)
            if self.moe is not None:
                record.scope(hooks.MOE)(hooks.PATH, self.moe)
        return out


@dataclass(frozen=True, eq=False)  # one object per key: hashed and compared by identity, cheaply
class Plan:
    key: tuple
    layers: tuple[LayerPlan, ...]


@dataclass
class Counts:
    """Calls of one MoE block or attention layer by path: fused runs per backend, fallbacks by reason, and
    the runs' notes."""

    fused: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)

    @property
    def fallback(self) -> int:
        return sum(self.reasons.values())

    def add(self, decision: Decision, n: int = 1) -> None:
        if decision.fused:
            self.fused[decision.path] += n
        else:
            self.reasons[decision.reason] += n
        if decision.note:
            self.notes[decision.note] += n

    def as_dict(self) -> dict:
        return {"fused": dict(self.fused), "fallback": self.fallback, "reasons": dict(self.reasons),
                "notes": dict(self.notes)}
