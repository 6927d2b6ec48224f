"""Router top-k selection, shared by every MoE family, and the per-layer interventions it honours.

The router's probabilities are the softmax over all experts in float32 (or, for the sigmoid-scored
families, each expert's sigmoid, the experts chosen by score plus a selection bias within the best groups);
the top-k come back unordered (argpartition, as mlx-lm does) and are renormalised only when the family asks
for it. Interventions change the selection
for the rest of a decode and are cleared by setting the block's intervention back to None.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from numbers import Integral, Real

import mlx.core as mx

from ..errors import MoebenchError
from .declare import SIGMOID_GROUPED, TOPK_THEN_SOFTMAX, MoeSpec


class InterventionError(MoebenchError, ValueError):
    """An intervention that cannot apply to the layer it was set on (bad expert id, top_k, ...)."""


@dataclass(frozen=True)
class Intervention:
    """What to change in one MoE layer. The default instance changes nothing.

    force_experts: use exactly these expert ids (scores = their router probabilities, renormalised
        when the family renormalises).
    ablate: experts that may not be selected. With `renormalize_ablation`, the softmax is taken over
        the remaining experts only (and the recorded router_probs are those renormalised ones);
        without it, the kept experts keep their original probabilities.
    top_k: select this many experts instead of the config's num_experts_per_tok.
    shared_expert: False switches the shared expert off.
    shared_gate_scale: multiplies the shared expert's sigmoid gate.
    """

    force_experts: tuple[int, ...] | None = None
    ablate: tuple[int, ...] = ()
    renormalize_ablation: bool = False
    top_k: int | None = None
    shared_expert: bool = True
    shared_gate_scale: float = 1.0

    def __post_init__(self) -> None:
        """Types checked when made (a layer's expert count is checked when set on it: validate). Expert ids are
        stored as a tuple of ints (lists and numpy integers accepted), so interventions compare and hash by value."""
        if self.force_experts is not None:
            object.__setattr__(self, "force_experts", _expert_ids("force_experts", self.force_experts))
        object.__setattr__(self, "ablate", _expert_ids("ablate", self.ablate))
        for name in ("renormalize_ablation", "shared_expert"):
            if not isinstance(getattr(self, name), bool):
                raise InterventionError(f"Intervention.{name} must be True or False, got {getattr(self, name)!r}")
        if self.top_k is not None:
            if isinstance(self.top_k, bool) or not isinstance(self.top_k, Integral):
                raise InterventionError(f"Intervention.top_k must be an integer or None, got {self.top_k!r}")
            object.__setattr__(self, "top_k", int(self.top_k))
        scale = self.shared_gate_scale
        if isinstance(scale, bool) or not isinstance(scale, Real) or not math.isfinite(scale):
            raise InterventionError(f"Intervention.shared_gate_scale must be a finite number, got {scale!r}")
        object.__setattr__(self, "shared_gate_scale", float(scale))

    def validate(self, num_experts: int, top_k: int) -> None:
        """Raise InterventionError when this intervention cannot apply to a layer of `num_experts` that selects
        `top_k` (the intervention's own top_k, when set, replaces it)."""
        ids = list(self.force_experts or ()) + list(self.ablate)
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_experts]
        if bad:
            raise InterventionError(f"intervention names expert {bad[0]!r}, valid ids are 0..{num_experts - 1}")
        if self.force_experts is not None:
            if not self.force_experts:
                raise InterventionError("force_experts must name at least one expert")
            if len(set(self.force_experts)) != len(self.force_experts):
                raise InterventionError(f"force_experts {self.force_experts} names an expert twice")
            if set(self.force_experts) & set(self.ablate):
                raise InterventionError(f"force_experts {self.force_experts} includes ablated {self.ablate}")
            if self.top_k is not None:
                raise InterventionError("set force_experts or top_k, not both (forcing fixes the count)")
        selectable = num_experts - len(set(self.ablate))
        if not selectable:
            raise InterventionError(f"ablate names every one of the {num_experts} experts: none is left to select")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= selectable):
            raise InterventionError(f"top_k {k!r} must be between 1 and the {selectable} selectable experts")
        if self.force_experts is None and k is None and top_k > selectable:
            raise InterventionError(f"ablating {len(set(self.ablate))} of {num_experts} experts leaves {selectable}, "
                                    f"fewer than the layer's top-{top_k}")


def shared_takes_part(spec: MoeSpec, intervention: Intervention | None) -> bool:
    """Whether a block declaring `spec` adds its shared expert under `intervention`: it has one, and no intervention
    switched it off."""
    return spec.shared is not None and (intervention is None or intervention.shared_expert)


def _expert_ids(name: str, value: object) -> tuple[int, ...]:
    """Expert ids as a tuple of ints: a list, tuple or array of integers (one id alone is not a list)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InterventionError(f"Intervention.{name} must list expert ids, got {value!r}")
    ids = tuple(value)
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, Integral)]
    if bad:
        raise InterventionError(f"Intervention.{name}: expert id {bad[0]!r} is not an integer")
    return tuple(int(i) for i in ids)


def route(
    router_logits: mx.array, spec: MoeSpec, intervention: Intervention | None = None, ordered: bool = False,
    selection_bias: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """router logits [..., E] -> (probabilities [..., E] f32, expert ids [..., K] uint32, scores [..., K] f32) for
    a block declaring `spec`; the ids in no particular order (argpartition, as mlx-lm), or highest first when
    `ordered`. The probabilities are the softmax over all experts, or with SIGMOID_GROUPED each expert's sigmoid
    (`selection_bias` [E] added only to choose). The scores are the chosen probabilities, renormalised when the
    block renormalises, times its routed_scaling. An ablated expert is never chosen (with SIGMOID_GROUPED the
    groups are ranked before the ablation); force_experts chooses, the scores are computed as for a choice."""
    logits = router_logits.astype(mx.float32)
    sigmoid = spec.scoring == SIGMOID_GROUPED
    probs = mx.sigmoid(logits) if sigmoid else mx.softmax(logits, axis=-1, precise=True)
    select_from = choice_scores(probs, spec, selection_bias) if sigmoid else probs
    if intervention is not None and intervention.ablate:
        mask = mx.zeros((probs.shape[-1],), dtype=mx.bool_)
        mask[list(intervention.ablate)] = True
        if intervention.renormalize_ablation and not sigmoid:  # a sigmoid score does not depend on the others
            probs = select_from = mx.softmax(mx.where(mask, -mx.inf, logits), axis=-1, precise=True)
        select_from = mx.where(mask, -mx.inf, select_from)
    if intervention is not None and intervention.force_experts is not None:
        ids = mx.array(intervention.force_experts, dtype=mx.uint32)
        inds = mx.broadcast_to(ids, (*probs.shape[:-1], ids.size))
    else:
        k = intervention.top_k if intervention is not None and intervention.top_k else spec.top_k
        # Selection is discrete: stop_gradient so autodiff (training) flows through the scores only.
        order = mx.argsort(-select_from, axis=-1) if ordered else mx.argpartition(-select_from, kth=k - 1, axis=-1)
        inds = mx.stop_gradient(order[..., :k].astype(mx.uint32))
    scores = mx.take_along_axis(probs, inds, axis=-1)
    if spec.renormalize or spec.scoring == TOPK_THEN_SOFTMAX:  # the softmax over the k: the k renormalised
        scores = scores / scores.sum(axis=-1, keepdims=True)
    if spec.routed_scaling != 1.0:
        scores = scores * spec.routed_scaling
    return probs, inds, scores


def choice_scores(probs: mx.array, spec: MoeSpec, selection_bias: mx.array | None) -> mx.array:
    """What SIGMOID_GROUPED chooses the top-k of: each expert's score plus its selection bias, and, with groups,
    -inf for every expert outside the best `topk_group` groups (a group ranked by the sum of its two best biased
    scores), as transformers and DeepSeek's own code compute it (mlx-lm writes 0 there: the same choice while the
    kept groups' biased scores are positive)."""
    chosen = probs if selection_bias is None else probs + selection_bias.astype(mx.float32)
    dropped = spec.n_group - spec.topk_group
    if not dropped:
        return chosen
    groups = chosen.reshape(*chosen.shape[:-1], spec.n_group, -1)
    ranks = mx.topk(groups, 2, axis=-1).sum(axis=-1, keepdims=True)  # [..., n_group, 1]
    worst = mx.argpartition(ranks, kth=dropped - 1, axis=-2)[..., :dropped, :]
    groups = mx.put_along_axis(groups, mx.stop_gradient(worst), mx.array(-mx.inf), axis=-2)
    return groups.reshape(chosen.shape)


def recorded_choice(probs: mx.array, spec: MoeSpec, selection_bias: mx.array | None) -> mx.array | None:
    """What a recorded step keeps of a SIGMOID_GROUPED router's choice (hooks' choice_scores); None otherwise."""
    return choice_scores(probs, spec, selection_bias) if spec.scoring == SIGMOID_GROUPED else None
