"""Routing statistics over recorded router outputs (numpy or MLX arrays in, numpy / floats out).

Inputs are what the model records (moebench.models.hooks): top-k expert ids [..., K] and router
probabilities [..., E]. Leading axes (batch, position) are flattened, so a [B, L, K] array and its
[B*L, K] reshape give the same answer. Entropies are in bits unless `base` says otherwise.
"""

from __future__ import annotations

import numpy as np

_EPS = 1e-12


def _ids(topk_ids, num_experts: int) -> np.ndarray:
    """Top-k ids as an int64 [tokens, K] array, checked against the expert count."""
    ids = np.asarray(topk_ids)
    if ids.ndim == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"top-k ids must be an integer array [..., K], got dtype {ids.dtype} shape {ids.shape}")
    ids = ids.astype(np.int64).reshape(-1, ids.shape[-1] if ids.ndim > 1 else 1)
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(f"top-k ids span {ids.min()}..{ids.max()}, outside 0..{num_experts - 1}")
    return ids


def _distribution(p, name: str) -> np.ndarray:
    p = np.asarray(p, dtype=np.float64)
    if p.ndim != 1 or p.size == 0 or (p < 0).any() or not p.sum() > 0:
        raise ValueError(f"{name} must be a non-empty 1-D array of non-negative weights with a positive sum")
    return p / p.sum()


def expert_counts(topk_ids, num_experts: int) -> np.ndarray:
    """How many (token, slot) selections each expert received: int64 [E]."""
    return np.bincount(_ids(topk_ids, num_experts).ravel(), minlength=num_experts)


def expert_fractions(topk_ids, num_experts: int) -> np.ndarray:
    """Each expert's share of all top-k selections (sums to 1): float64 [E]."""
    counts = expert_counts(topk_ids, num_experts)
    if counts.sum() == 0:
        raise ValueError("no top-k selections to take fractions of")
    return counts / counts.sum()


def entropy(p, base: float = 2.0) -> float:
    """Shannon entropy of a distribution (weights are normalised first); log2(E) for uniform load."""
    q = _distribution(p, "distribution")
    nz = q[q > 0]
    return float(-(nz * np.log(nz)).sum() / np.log(base))


def normalized_entropy(p) -> float:
    """Entropy over its maximum log(E): 1 for perfectly even load, 0 when one expert takes everything."""
    q = _distribution(p, "distribution")
    return entropy(q) / np.log2(q.size) if q.size > 1 else 1.0


def router_entropy(router_probs, base: float = 2.0) -> float:
    """Mean per-token entropy of the router's softmax [..., E]: low means confident routing."""
    probs = np.asarray(router_probs, dtype=np.float64)
    if probs.ndim == 0 or probs.size == 0:
        raise ValueError(f"router probabilities must be an array [..., E], got shape {probs.shape}")
    probs = probs.reshape(-1, probs.shape[-1])
    return float((-(probs * np.log(np.clip(probs, _EPS, None))).sum(axis=-1)).mean() / np.log(base))


def load_cv(counts) -> float:
    """Coefficient of variation (std / mean) of per-expert load: 0 is perfectly balanced."""
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 1 or c.size == 0 or c.mean() <= 0:
        raise ValueError("load counts must be a non-empty 1-D array with a positive mean")
    return float(c.std() / c.mean())


def coactivation(topk_ids, num_experts: int) -> np.ndarray:
    """[E, E] int64: entry (i, j) counts tokens that selected both i and j; the diagonal counts tokens
    that selected i. A repeated id within one token's top-k counts once."""
    ids = _ids(topk_ids, num_experts)
    onehot = np.zeros((ids.shape[0], num_experts), dtype=np.int64)
    np.put_along_axis(onehot, ids, 1, axis=1)
    return onehot.T @ onehot


def js_divergence(p, q, base: float = 2.0) -> float:
    """Jensen-Shannon divergence between two usage distributions (normalised first); in [0, 1] bits."""
    a, b = _distribution(p, "p"), _distribution(q, "q")
    if a.shape != b.shape:
        raise ValueError(f"distributions differ in length: {a.size} and {b.size}")
    m = (a + b) / 2

    def kl(x: np.ndarray) -> float:
        nz = x > 0
        return float((x[nz] * np.log(x[nz] / m[nz])).sum())

    return (kl(a) + kl(b)) / 2 / np.log(base)
