"""The named hook points of the models (like TransformerLens hook names): what is recorded where.

A name is the path of the place it sits, `layers.{l}` for decoder layer l and `layers.{l}.moe` for its
MoE block, then the value's own name. Stable: notebooks, widgets and exported files key on them.

    layers.{l}.resid_pre         residual stream entering layer l           [1, L, D]
    layers.{l}.resid_mid         after attention (entering the MoE block)   [1, L, D]
    layers.{l}.resid_post        leaving layer l                            [1, L, D]
    layers.{l}.moe.router_logits router logits over all experts             [L, E]
    layers.{l}.moe.router_probs  softmax of the logits, float32             [L, E]
    layers.{l}.moe.topk_ids      selected expert ids (router order)         [L, K]
    layers.{l}.moe.topk_scores   their weights in the routed sum            [L, K]
    layers.{l}.moe.expert_out    each selected expert's output, unweighted  [L, K, D]
    layers.{l}.moe.routed_out    weighted sum of the expert outputs         [L, D]
    layers.{l}.moe.shared_out    shared expert output, ungated              [L, D]
    layers.{l}.moe.shared_gate   sigmoid gate of the shared expert          [L, 1]
    layers.{l}.moe.block_out     routed_out + shared_gate * shared_out      [L, D]
    layers.{l}.moe.choice_scores what a selection-biased router chose by:     [L, E]
                                 router_probs + the selection bias, -inf outside the groups kept (before any
                                 intervention; SIGMOID_GROUPED routers only, None elsewhere)
    layers.{l}.moe.path          which path the block ran (moebench.execution.plan.Decision)
    layers.{l}.attn_path         which path the layer's attention ran (Decision; decode steps only)
    layers.{l}.mixer_kind        the layer's token mixing, 'linear_attention' or 'full_attention' (hybrids only:
                                 other families' layers all attend, and record no kind)
    layers.{l}.mixer.decay       Gated DeltaNet's decay g of the state, float32     [L, Hv]
    layers.{l}.mixer.beta        its write strength beta = sigmoid(b), float32      [L, Hv]
    layers.{l}.mixer.state_norm  Frobenius norm of each value head's delta state   [Hv]
                                 after the call's last position (one per call, not per position: the
                                 states in between are never kept)
    layers.{l}.mixer.output_gate the output gate as it multiplies each head's       [L, H, Dh]
                                 output: silu(z) in the linear layers' gated norm (H value heads of Dv),
                                 sigmoid(gate) in the full-attention layers (H query heads of head_dim); a
                                 token's is the size of a residual vector, so it is kept whole

`mixer` is the layer's token-mixing module (the model's `layer.mixer`); its values are recorded where the module
computes them, or by the fused kernel step running the layer in its place (the same values, from the kernel's
inputs and outputs). Split by heads
over processes (moebench.models.sharding's experts+tensor mode), a process records the heads it holds.

A forward pass hands them to a Record while it builds the graph (L = tokens in the call); with none
(the default) it records nothing and does no extra work. moebench.inspect.record.LayerRecord carries
one token's values under the same names, with topk_ids, topk_scores and expert_out reordered by score.
"""

from __future__ import annotations

from typing import Protocol

RESID_PRE, RESID_MID, RESID_POST = "resid_pre", "resid_mid", "resid_post"
ROUTER_LOGITS, ROUTER_PROBS = "router_logits", "router_probs"
TOPK_IDS, TOPK_SCORES = "topk_ids", "topk_scores"
EXPERT_OUT, ROUTED_OUT = "expert_out", "routed_out"
SHARED_OUT, SHARED_GATE = "shared_out", "shared_gate"
BLOCK_OUT, PATH = "block_out", "path"
CHOICE_SCORES = "choice_scores"
ATTN_PATH = "attn_path"
MOE = "moe"  # the MoE block's place inside its layer
MIXER_KIND = "mixer_kind"
MIXER = "mixer"  # the token mixing's place inside its layer
DECAY, BETA, STATE_NORM, OUTPUT_GATE = "decay", "beta", "state_norm", "output_gate"
MIXER_HOOKS = (DECAY, BETA, STATE_NORM, OUTPUT_GATE)

# What a MoE block records, in this order (record_moe's arguments).
MOE_PARTS = (ROUTER_LOGITS, ROUTER_PROBS, TOPK_IDS, TOPK_SCORES, EXPERT_OUT, ROUTED_OUT, SHARED_OUT, SHARED_GATE,
             BLOCK_OUT, CHOICE_SCORES)
MOE_HOOKS = (*MOE_PARTS, PATH)
RESID_HOOKS = (RESID_PRE, RESID_MID, RESID_POST)


class Record(Protocol):
    """Where a forward pass hands its internals: `record(name, value)` at this place, `scope(child)` for a
    place inside it (moebench.inspect.record.Recorder is one)."""

    def __call__(self, name: str, value: object) -> None: ...

    def scope(self, child: str) -> Record: ...


def layer_scope(layer: int) -> str:
    return f"layers.{layer}"


def scope(record: Record | None, child: str) -> Record | None:
    """The record of a place inside `record`'s, or None when nothing is recorded."""
    return None if record is None else record.scope(child)


def record_moe(record: Record, *parts: object) -> None:
    """A MoE block's MOE_PARTS, in that order (None where the block has no such value)."""
    for name, value in zip(MOE_PARTS, parts, strict=True):
        record(name, value)


def record_residuals(record: Record, pre: object, mid: object, post: object) -> None:
    """The residual stream entering a layer, after its attention, and leaving it."""
    record(RESID_PRE, pre)
    record(RESID_MID, mid)
    record(RESID_POST, post)


def parse(name: str) -> tuple[int, str]:
    """'layers.3.moe.topk_ids' -> (3, 'topk_ids')."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit():
        raise KeyError(f"not a moebench hook name: {name!r}")
    return int(parts[1]), parts[-1]
