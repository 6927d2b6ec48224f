"""Routing statistics over a recorded prompt or decode (a Trace from moebench.inspect.record), computed
with moebench.inspect.stats (entropies in bits).

    load(trace)          expert load per layer: counts and fractions of top-k selections
    summary(trace)       per layer: mean router entropy, load entropy, load coefficient of variation
    coactivation(trace, layer)   how often two experts are selected for the same token [E, E]
    usage_divergence(a, b)       per layer, Jensen-Shannon divergence between two traces' expert usage
    expert_logit_lens(model, trace)  each expert's output through the final norm and unembedding

`phase` selects 'prefill', 'decode' or (None) every record. Records whose top-k changed under an
intervention count with their own k.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pandas as pd

from ..errors import MoebenchError
from . import stats
from .record import LayerRecord, Trace

PHASES = (None, "prefill", "decode")


def _records(trace: Trace, phase: str | None) -> dict[int, list[LayerRecord]]:
    if phase not in PHASES:
        raise MoebenchError(f"phase must be one of {PHASES}, got {phase!r}")
    by_layer: dict[int, list[LayerRecord]] = {}
    for s in trace.steps:
        if phase is None or s.phase == phase:
            for layer, r in s.layers.items():
                by_layer.setdefault(layer, []).append(r)
    if not by_layer:
        raise MoebenchError("the trace holds no recorded layers for this phase: decode with record=True")
    return by_layer


def _num_experts(records: list[LayerRecord]) -> int:
    return len(records[0].router_probs)


def _counts(recs: list[LayerRecord]) -> np.ndarray:
    return stats.expert_counts(np.concatenate([r.topk_ids for r in recs]), _num_experts(recs))


def load(trace: Trace, phase: str | None = None) -> pd.DataFrame:
    """Long format (layer, expert, count, fraction): fraction of all top-k selections in that layer."""
    rows = []
    for layer, recs in sorted(_records(trace, phase).items()):
        counts = _counts(recs)
        rows += [{"layer": layer, "expert": e, "count": int(c), "fraction": c / counts.sum()}
                 for e, c in enumerate(counts)]
    return pd.DataFrame(rows, columns=["layer", "expert", "count", "fraction"])


def summary(trace: Trace, phase: str | None = None) -> pd.DataFrame:
    """Per layer: tokens, mean router entropy (bits, over all experts), entropy of the load
    distribution, its maximum log2(E), and the load's coefficient of variation."""
    rows = []
    for layer, recs in sorted(_records(trace, phase).items()):
        counts = _counts(recs)
        rows.append({
            "layer": layer, "tokens": len(recs),
            "router_entropy": stats.router_entropy(np.stack([r.router_probs for r in recs])),
            "load_entropy": stats.entropy(counts), "max_entropy": float(np.log2(len(counts))),
            "load_cv": stats.load_cv(counts),
        })
    return pd.DataFrame(rows)


def coactivation(trace: Trace, layer: int, phase: str | None = None) -> np.ndarray:
    """[E, E] counts of tokens whose top-k held both experts; the diagonal is each expert's load."""
    recs = _records(trace, phase).get(layer)
    if recs is None:
        raise MoebenchError(f"layer {layer} was not recorded")
    by_k: dict[int, list[np.ndarray]] = {}  # an intervention may change k mid-decode
    for r in recs:
        by_k.setdefault(len(r.topk_ids), []).append(r.topk_ids)
    return sum(stats.coactivation(np.stack(ids), _num_experts(recs)) for ids in by_k.values())


def usage_divergence(a: Trace, b: Trace, phase: str | None = None) -> pd.DataFrame:
    """Per layer recorded in both traces: Jensen-Shannon divergence (bits, 0..1) of their expert loads."""
    recs_a, recs_b = _records(a, phase), _records(b, phase)
    rows = [{"layer": layer, "js_divergence": stats.js_divergence(_counts(recs_a[layer]), _counts(recs_b[layer]))}
            for layer in sorted(set(recs_a) & set(recs_b))]
    return pd.DataFrame(rows, columns=["layer", "js_divergence"])


def expert_logit_lens(model, trace: Trace, tokenizer=None, top: int = 5, phase: str | None = None,
                      chunk: int = 256) -> pd.DataFrame:
    """Each expert's mean unweighted output (over the tokens that selected it) through the model's
    final norm and unembedding: long format (layer, expert, selections, rank, token_id, text, logit)."""
    if not 1 <= top <= model.args.vocab_size:
        raise MoebenchError(f"top must be between 1 and the vocabulary size {model.args.vocab_size}, got {top}")
    keys, vectors = [], []
    for layer, recs in sorted(_records(trace, phase).items()):
        sums: dict[int, list[np.ndarray]] = {}
        for r in recs:
            for e, out in zip(r.topk_ids, r.expert_out, strict=True):
                sums.setdefault(int(e), []).append(out)
        for e, outs in sorted(sums.items()):
            keys.append((layer, e, len(outs)))
            vectors.append(np.mean(outs, axis=0))
    rows = []
    dtype = model.dtype
    for start in range(0, len(vectors), chunk):
        h = mx.array(np.stack(vectors[start : start + chunk])).astype(dtype)
        logits = model.unembed(model.model.norm(h)).astype(mx.float32)
        ids = mx.argpartition(-logits, kth=top - 1, axis=-1)[:, :top]
        values = np.array(mx.take_along_axis(logits, ids, axis=-1))
        ids = np.array(ids)
        for j, (layer, e, n) in enumerate(keys[start : start + chunk]):
            for rank, o in enumerate(np.argsort(-values[j], kind="stable")):
                t = int(ids[j, o])
                rows.append({"layer": layer, "expert": e, "selections": n, "rank": rank, "token_id": t,
                             "text": tokenizer.decode([t]) if tokenizer is not None else None,
                             "logit": float(values[j, o])})
    return pd.DataFrame(rows, columns=["layer", "expert", "selections", "rank", "token_id", "text", "logit"])
