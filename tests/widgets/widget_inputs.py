"""Inputs more than one widget test module reads: what the shared fixtures (conftest) are made from."""

from types import SimpleNamespace

import numpy as np

# The tiny Qwen3-Next of `hybrid_trace`: full, linear, linear, full (its config's layer_types).
HYBRID_LAYER_TYPES = ["full_attention", "linear_attention", "linear_attention", "full_attention"]

# The prompts the shipped model and its router-swapped copy are compared on (`swapped`).
DRIFT_TEXTS = ["def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
               "Now is the winter of our discontent made glorious summer by this sun of York."]


def biased_step(n: int, layers: int, top_k: int, seed: int):
    """A recorded step as the router view reads it, over `n` experts top-k, its logits made with a known bias; and
    the biases, per layer."""
    rng = np.random.default_rng(seed)
    biases = {layer: rng.normal(0, 1, n) for layer in range(layers)}
    rows = {}
    for layer in range(layers):
        logits = rng.normal(0, 2, n) + biases[layer]
        probs = np.exp(logits - logits.max())
        ids = np.argsort(-logits)[:top_k]
        rows[layer] = SimpleNamespace(router_logits=logits, router_probs=probs / probs.sum(), topk_ids=ids,
                                      shared_gate=None, selection_bias_effect=lambda: None)
    return SimpleNamespace(layers=rows, interventions={}, position=0, input_text="x"), biases
