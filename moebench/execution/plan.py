"""How one forward call runs, layer by layer: a fused kernel or the model's own modules, and why.

A Plan is decided once per model, settings and shape class (decode or prefill, which cache, where
interventions are set) by moebench.execution.executor,
and rebuilt when any of them changes. For each layer it holds the Decision for its attention and for
its MoE block (a backend, or 'fallback' with the reason; what runs beside the kernels in `note`), the
step that carries it out, and the graph nodes the layer builds for one decode token on the GPU path
(Launches): at decode each node costs host time, so launches a layer are the currency of decode speed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from ..models import hooks
from ..models.hooks import Record
from ..models.run import MODULES
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


@dataclass(frozen=True)
class Launches:
    """The graph nodes a decoder layer (or one of its parts) builds for one decode token on the GPU path, in order,
    each named '<what> (<op>)': a kernel launch, an mx.fast op (one node on a GPU) or another MLX primitive (a
    quantized matmul, an add, a cache write, a cast), each a node the host builds and the device runs. `names`
    None: not declared, and `reason` says why (a part that runs as MLX ops whose nodes the execution layer does not
    build itself: a fallback, a dense MLP, a family's own projections), rather than a guessed number."""

    names: tuple[str, ...] | None
    reason: str | None = None

    @property
    def count(self) -> int | None:
        return None if self.names is None else len(self.names)

    def __add__(self, other: Launches) -> Launches:
        """Both parts' launches in order; not declared when either is (with every reason)."""
        if self.names is not None and other.names is not None:
            return Launches(self.names + other.names)
        return Launches(None, "; ".join(r for r in (self.reason, other.reason) if r))

    def as_dict(self) -> dict:
        return {"count": self.count, "names": None if self.names is None else list(self.names),
                "reason": self.reason}


# step(norm, residual, cache, record) -> residual + attention(norm(residual));
# step(norm, residual, record) -> residual + block(norm(residual))
AttentionStep = Callable[[object, mx.array, object, Record | None], mx.array]
MoeStep = Callable[[object, mx.array, Record | None], mx.array]


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer: its decisions, the kernel steps that carry out the fused ones (None: the model's own
    module runs) and what the layer launches for one decode token on the GPU path. The model's forward asks it to
    run each part (moebench.models.run.LayerRun)."""

    attention: Decision
    moe: Decision | None  # None: a dense MLP layer
    launches: Launches
    attention_step: AttentionStep | None = None
    moe_step: MoeStep | None = None

    def attend(self, attn, norm, residual: mx.array, cache, record: Record | None = None) -> mx.array:
        if self.attention_step is not None:
            return self.attention_step(norm, residual, cache, record)
        return MODULES.attend(attn, norm, residual, cache, record)

    def feed_forward(self, mlp, norm, residual: mx.array, record: Record | None) -> mx.array:
        if self.moe_step is not None:
            return self.moe_step(norm, residual, record)
        return MODULES.feed_forward(mlp, norm, residual, record)

    def record(self, record: Record) -> None:
        """Hand a layer's record the decisions it ran under."""
        record(hooks.ATTN_PATH, self.attention)
        if self.moe is not None:
            record.scope(hooks.MOE)(hooks.PATH, self.moe)


@dataclass(frozen=True, eq=False)  # one object per key: hashed and compared by identity, cheaply
class Plan:
    key: tuple
    layers: tuple[LayerPlan, ...]
    shape: Shape

    def launches(self) -> dict:
        """Each layer's launches for one decode token on the GPU path (Launches.as_dict), their mean a layer (None
        unless every layer's are declared) and, for the layers whose are not, how many by reason."""
        counts = [lp.launches.count for lp in self.layers]
        declared = bool(counts) and None not in counts
        return {"per_layer": sum(counts) / len(counts) if declared else None,
                "not_declared": dict(Counter(lp.launches.reason for lp in self.layers if lp.launches.names is None)),
                "layers": {i: lp.launches.as_dict() for i, lp in enumerate(self.layers)}}


def launches_line(report: dict) -> str:
    """Plan.launches' report (or its summary, without 'layers') in one line: the mean a layer and the layers not
    declared, by reason."""
    mean = "not declared" if report["per_layer"] is None else f"{report['per_layer']:g}"
    return f"launches/layer (plan, GPU path) {mean}" + "".join(
        f"; {n} layers not declared: {reason}" for reason, n in report["not_declared"].items())


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
