"""Set, read and clear per-layer interventions (routing.Intervention) on a model's MoE blocks.

An intervention stays on its block for every following forward call (the rest of a decode, the
next tokens of a Stepper) until cleared; clearing sets the block back to exactly the baseline code
path, so outputs return to the baseline bitwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from numbers import Integral

from ..models.routing import Intervention, InterventionError

Interventions = Mapping[int, Intervention] | Intervention


def _layer(blocks: Mapping[int, object], layer: object) -> int:
    """`layer` as the index of one of `blocks` (a model's MoE layers): an integer, not a bool (True == 1), that
    names a MoE layer; anything else is an InterventionError naming it."""
    if isinstance(layer, bool) or not isinstance(layer, Integral) or int(layer) not in blocks:
        raise InterventionError(f"layer {layer!r} is not a MoE layer (MoE layers: {sorted(blocks)})")
    return int(layer)


def _per_layer(model, interventions: Interventions) -> dict[int, Intervention]:
    """A single Intervention means every MoE layer; a mapping names layers. Validated before any is set."""
    blocks = model.moe_blocks()
    if isinstance(interventions, Intervention):
        chosen = {i: interventions for i in blocks}
    elif isinstance(interventions, Mapping):
        chosen = {_layer(blocks, layer): intervention for layer, intervention in interventions.items()}
    else:
        raise InterventionError(f"interventions must be a moebench.Intervention (every MoE layer) or a mapping "
                                f"{{layer: Intervention}}, got {type(interventions).__name__}")
    for layer, intervention in chosen.items():
        if not isinstance(intervention, Intervention):
            kind = type(intervention).__name__
            raise InterventionError(f"layer {layer}: expected a moebench.Intervention, got {kind}")
        intervention.validate(blocks[layer].num_experts, blocks[layer].top_k)
    return chosen


def set_interventions(model, interventions: Interventions) -> None:
    """Put interventions on layers (others keep theirs); all are checked first, so a bad one sets none."""
    for layer, intervention in _per_layer(model, interventions).items():
        model.moe_blocks()[layer].intervention = intervention


def clear_interventions(model, layers: Iterable[int] | None = None) -> None:
    """Remove the interventions of `layers` (a list of MoE layer indices; default: every MoE layer). All are
    checked before any is cleared."""
    blocks = model.moe_blocks()
    if layers is not None and (isinstance(layers, (str, bytes, Mapping)) or not isinstance(layers, Iterable)):
        raise InterventionError(f"layers must be a list of MoE layer indices (or None: every one), got {layers!r}")
    for layer in [_layer(blocks, layer) for layer in (blocks if layers is None else layers)]:
        blocks[layer].intervention = None


def active_interventions(model) -> dict[int, Intervention]:
    """{layer: intervention} for every MoE layer that has one."""
    return {i: b.intervention for i, b in model.moe_blocks().items() if b.intervention is not None}


@contextmanager
def intervene(model, interventions: Interventions) -> Iterator[None]:
    """Apply interventions inside a `with` block, then restore exactly the ones there were before."""
    before = {i: b.intervention for i, b in model.moe_blocks().items()}
    set_interventions(model, interventions)
    try:
        yield
    finally:
        for i, b in model.moe_blocks().items():
            b.intervention = before[i]
