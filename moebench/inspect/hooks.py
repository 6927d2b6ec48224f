"""The named vocabulary of recorded internals (like TransformerLens hook names). Stable: notebooks,
widgets and exported files key on these strings.

    layers.{l}.resid_pre         residual stream entering layer l           [L, D]
    layers.{l}.resid_mid         after attention (entering the MoE block)   [L, D]
    layers.{l}.resid_post        leaving layer l                            [L, D]
    layers.{l}.moe.router_logits router logits over all experts             [L, E]
    layers.{l}.moe.router_probs  softmax of the logits, float32             [L, E]
    layers.{l}.moe.topk_ids      selected expert ids (router order)         [L, K]
    layers.{l}.moe.topk_scores   their weights in the routed sum            [L, K]
    layers.{l}.moe.expert_out    each selected expert's output, unweighted  [L, K, D]
    layers.{l}.moe.routed_out    weighted sum of the expert outputs         [L, D]
    layers.{l}.moe.shared_out    shared expert output, ungated              [L, D]
    layers.{l}.moe.shared_gate   sigmoid gate of the shared expert          [L, 1]
    layers.{l}.moe.block_out     routed_out + shared_gate * shared_out      [L, D]
    layers.{l}.moe.path          which path ran (kernels.Decision)
    layers.{l}.attn_path         which path the layer's attention ran: the decode-attention kernel or
                                 MLX ops, and why (kernels.Decision; recorded with a KV cache)

The model hands these to `model.recorder(name, value)` while it builds the graph (L = tokens in
the call; resid_* keep the batch axis, [1, L, D]). moebench.inspect.record.LayerRecord carries one token's
values under the same names, with topk_ids, topk_scores and expert_out reordered by score.
"""

from __future__ import annotations

from collections.abc import Callable

RESID_PRE, RESID_MID, RESID_POST = "resid_pre", "resid_mid", "resid_post"
ROUTER_LOGITS, ROUTER_PROBS = "router_logits", "router_probs"
TOPK_IDS, TOPK_SCORES = "topk_ids", "topk_scores"
EXPERT_OUT, ROUTED_OUT = "expert_out", "routed_out"
SHARED_OUT, SHARED_GATE = "shared_out", "shared_gate"
BLOCK_OUT, PATH = "block_out", "path"
ATTN_PATH = "attn_path"

MOE_HOOKS = (ROUTER_LOGITS, ROUTER_PROBS, TOPK_IDS, TOPK_SCORES, EXPERT_OUT, ROUTED_OUT, SHARED_OUT,
             SHARED_GATE, BLOCK_OUT, PATH)
RESID_HOOKS = (RESID_PRE, RESID_MID, RESID_POST)


def moe_name(layer: int) -> Callable[[str], str]:
    return lambda hook: f"layers.{layer}.moe.{hook}"


def resid_name(layer: int, hook: str) -> str:
    return f"layers.{layer}.{hook}"


def parse(name: str) -> tuple[int, str]:
    """'layers.3.moe.topk_ids' -> (3, 'topk_ids')."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit():
        raise KeyError(f"not a moebench hook name: {name!r}")
    return int(parts[1]), parts[-1]
