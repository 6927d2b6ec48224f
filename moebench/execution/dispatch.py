"""The one place that decides fused or fallback for a MoE layer (and for the decode-attention kernel), and
always says why.

The switch: environment variable MOEBENCH_FUSED_MOE (default on; 0/false/off/no turn it off),
`set_fused_moe()` and the `fused_moe()` context manager, read at every forward call so a widget
can flip it between tokens; it covers every fused decode kernel (MoE block and attention). Each MoE
block and each attention layer owns a DispatchCounter of fused runs, fallbacks and decline reasons.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx

from ..checkpoint.quant import QuantizedParts
from ..models.layers import Derived, Linear
from ..models.switch import PROJECTIONS, SwitchGLU, SwitchLinear, weighted_sum
from . import moe as fused_kernel

ENV_SWITCH = "MOEBENCH_FUSED_MOE"
ENV_MAX_DFF = "MOEBENCH_FUSED_MOE_MAX_DFF"
DEFAULT_MAX_DFF = {"metal": 4096, "cuda": 8192}
GATE_UP_BITS = (4, 8)
DOWN_BITS = (4, 6, 8)
GROUP_SIZES = (32, 64, 128)
OFF_WORDS = ("0", "false", "off", "no")


def _env_switch() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in OFF_WORDS


_enabled = _env_switch()


def fused_moe_enabled() -> bool:
    return _enabled


def set_fused_moe(enabled: bool) -> None:
    """Turn the fused decode-MoE path on or off for every model, from the next forward call on."""
    global _enabled
    _enabled = bool(enabled)


@contextmanager
def fused_moe(enabled: bool) -> Iterator[None]:
    """Run a block of code with the fused path switched on or off, then restore the previous state."""
    before = fused_moe_enabled()
    set_fused_moe(enabled)
    try:
        yield
    finally:
        set_fused_moe(before)


def available_backend() -> str:
    """'metal' or 'cuda' when the default device is a GPU with that back-end, else 'reference' (CPU)."""
    if mx.default_device() == mx.gpu:
        if mx.metal.is_available():
            return "metal"
        if mx.cuda.is_available():
            return "cuda"
    return "reference"


def max_dff(backend: str) -> int | None:
    """Expert width above which the GPU kernel loses to gather_qmm; the reference has no cap."""
    if backend not in DEFAULT_MAX_DFF:
        return None
    raw = os.environ.get(ENV_MAX_DFF, "")
    try:
        value = int(raw)
    except ValueError:
        value = 0
    return value if value > 0 else DEFAULT_MAX_DFF[backend]


def support_reason(experts: SwitchGLU, backend: str) -> str | None:
    """Why the fused kernel cannot run these experts on `backend`, or None when it can."""
    parts = experts.quantized_parts()
    if any(p is None for p in parts):
        return "float experts (the kernel needs quantized weights)"
    gate, up, down = parts
    modes = {p.mode for p in parts}
    if modes != {"affine"}:
        return f"quantization mode {sorted(modes)} (the kernel needs affine)"
    if any(p.biases is None for p in parts):
        return "affine without biases"
    if gate.bits != up.bits:
        return f"gate bits {gate.bits} != up bits {up.bits}"
    if gate.bits not in GATE_UP_BITS:
        return f"gate/up bits {gate.bits} not in {GATE_UP_BITS}"
    if down.bits not in DOWN_BITS:
        return f"down bits {down.bits} not in {DOWN_BITS}"
    sizes = {p.group_size for p in parts}
    if len(sizes) != 1:
        return f"group sizes differ {sorted(sizes)}"
    if gate.group_size not in GROUP_SIZES:
        return f"group size {gate.group_size} not in {GROUP_SIZES}"
    dff = gate.out_features
    if down.bits == 6 and dff % 16:
        return f"6-bit down needs Dff % 16 == 0 (Dff {dff})"
    cap = max_dff(backend)
    if cap is not None and dff > cap:
        return f"Dff {dff} above the {backend} cap {cap} ({ENV_MAX_DFF})"
    return None


class RowsSupport:
    """Why a norm-folding kernel cannot read one layer's rows, or None; asked at every decode step, so it is
    computed again only when the rows object (rebuilt when weights change) or the dtypes change."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._reason: str | None = None

    def reason(self, rows: object, dtypes: tuple, compute: Callable[[], str | None]) -> str | None:
        if self._key is None or self._key[0] is not rows or self._key[1] != dtypes:
            self._key, self._reason = (rows, dtypes), compute()
        return self._reason


@dataclass(frozen=True)
class Decision:
    """Which path one MoE or attention call took: backend 'metal' / 'cuda' / 'reference', or 'fallback' and why; `note`:
    what a fused call ran beside the kernels, and why (recorded steps carry it)."""

    path: str
    reason: str | None = None
    note: str | None = None

    @property
    def fused(self) -> bool:
        return self.path != "fallback"


SWITCHED_OFF = Decision("fallback", f"switched off ({ENV_SWITCH} / set_fused_moe)")


def _storage(p: QuantizedParts) -> str:
    return f"{p.bits}-bit g{p.group_size} {p.mode} ({str(p.scales.dtype).removeprefix('mlx.core.')} scales)"


def shared_fold_reason(routed: list[QuantizedParts], shared: tuple[Linear, Linear, Linear]) -> str | None:
    """Why the shared expert cannot run inside the kernel pair (it then runs as its own MLP), or None."""
    for name, r, m in zip(PROJECTIONS, routed, shared, strict=True):
        p = m.quantized_parts()
        if p is None:
            return f"its {name} is float (the kernels need quantized weights)"
        if _storage(p) != _storage(r):
            return f"its {name} is {_storage(p)}, the routed experts' {_storage(r)}"
        if "bias" in m:
            return f"its {name} has a bias"
    return None


@dataclass(frozen=True)
class FusedWeights:
    """The arrays the kernels of one MoE block read: the routed experts' gate/up/down parts, and the shared
    expert's when they can run inside the kernel pair (else None, with `shared_note` saying why; None when
    the family has no shared expert)."""

    experts: tuple[QuantizedParts, QuantizedParts, QuantizedParts]
    shared: tuple[QuantizedParts, QuantizedParts, QuantizedParts] | None = None
    shared_note: str | None = None

    @classmethod
    def build(cls, gate: SwitchLinear, up: SwitchLinear, down: SwitchLinear, *shared: Linear) -> FusedWeights:
        """From the routed experts' projections and, when the family has one, the shared expert's."""
        shared = shared or None
        parts = [p.quantized_parts() for p in (gate, up, down)]
        if any(p is None for p in parts):  # declined by support_reason before the kernels are ever asked for
            return cls(tuple(parts))
        note = shared_fold_reason(parts, shared) if shared is not None else None
        folded = tuple(m.quantized_parts() for m in shared) if shared is not None and note is None else None
        return cls(tuple(parts), folded, note)


@dataclass
class DispatchCounter:
    """Fused runs, fallbacks and decline reasons of one MoE layer."""

    fused: Counter = field(default_factory=Counter)
    fallback: int = 0
    reasons: Counter = field(default_factory=Counter)
    last: Decision | None = None
    beside_note: str | None = None  # what of the layer runs beside its kernels that could run in one, and why
    _support: dict = field(default_factory=dict, repr=False)
    _weights: Derived = field(default_factory=lambda: Derived(FusedWeights.build), repr=False)

    def decide(self, experts: SwitchGLU, n_tokens: int) -> Decision:
        """A MoE block's path for a call over n_tokens (support_reason says what the kernels cannot run)."""
        return self.decide_for(n_tokens, lambda backend: support_reason(experts, backend))

    def decide_for(self, n_tokens: int, support: Callable[[str], str | None], call_reason: str | None = None
                   ) -> Decision:
        """The path of one call, counted: fused on the available backend, unless it has more than one token,
        the switch is off, this call has a reason of its own (`call_reason`), or `support(backend)` (asked
        once per backend) gives one."""
        if n_tokens != 1:
            decision = Decision("fallback", f"{n_tokens} tokens (the kernel runs single-token decode)")
        elif not fused_moe_enabled():
            decision = SWITCHED_OFF
        elif call_reason:
            decision = Decision("fallback", call_reason)
        else:
            backend = available_backend()
            if backend not in self._support:
                self._support[backend] = support(backend)
            reason = self._support[backend]
            decision = Decision("fallback", reason) if reason else Decision(backend)
        self.count(decision)
        return decision

    def count(self, decision: Decision) -> None:
        """Add one call that took `decision` (a compiled decode step replays its traced decisions here)."""
        self.last = decision
        if decision.fused:
            self.fused[decision.path] += 1
        else:
            self.fallback += 1
            self.reasons[decision.reason] += 1

    def uncount(self, decision: Decision) -> None:
        """Take one counted call back out (a speculative step that is dropped)."""
        tally, key = (self.fused, decision.path) if decision.fused else (self.reasons, decision.reason)
        tally[key] -= 1
        if not tally[key]:
            del tally[key]
        if not decision.fused:
            self.fallback -= 1

    def quantized_parts(self, experts: SwitchGLU) -> tuple[QuantizedParts, QuantizedParts, QuantizedParts]:
        """gate/up/down parts of the routed experts (see fused_weights)."""
        return self.fused_weights(experts).experts

    def fused_weights(self, experts: SwitchGLU, shared: tuple[Linear, Linear, Linear] | None = None) -> FusedWeights:
        """What the kernels read, rebuilt only when a weight, scale or bias array was replaced (it is asked
        for at every decode step of every layer, where rebuilding costs more than a launch)."""
        return self._weights.get(experts.gate_proj, experts.up_proj, experts.down_proj, *(shared or ()))

    @property
    def notes(self) -> list[str]:
        """What the fused path of this layer runs beside the kernels, and why (known once it has run)."""
        weights = self._weights.value
        note = weights.shared_note if weights is not None else None
        notes = [f"shared expert beside the kernels: {note}"] if note else []
        if self.beside_note:
            notes.append(self.beside_note)
        return notes

    def reset(self) -> None:
        self.fused.clear()
        self.fallback = 0
        self.reasons.clear()

    def as_dict(self) -> dict:
        return {"fused": dict(self.fused), "fallback": self.fallback, "reasons": dict(self.reasons),
                "notes": self.notes}


def routed_experts(
    experts: SwitchGLU, x: mx.array, indices: mx.array, scores: mx.array, counter: DispatchCounter
) -> tuple[mx.array, mx.array, Decision]:
    """The routed part of a MoE block: (weighted sum [N, D], per-expert outputs [N, K, D], decision).

    Fused: per-expert outputs in float32, weighted and summed over K in float32, one final cast.
    Fallback: SwitchGLU (gather_qmm) in the activation dtype and the weighted sum in that dtype.
    """
    decision = counter.decide(experts, x.shape[0])
    if decision.fused:
        out, y, _ = fused_kernel.routed(decision.path, x, indices, scores, *counter.quantized_parts(experts))
        return out, y, decision
    y = experts(x, indices)
    return weighted_sum(y, scores), y, decision
