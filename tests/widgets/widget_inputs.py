"""Inputs more than one widget test module reads: what the shared fixtures (conftest) are made from."""

# The tiny Qwen3-Next of `hybrid_trace`: full, linear, linear, full (its config's layer_types).
HYBRID_LAYER_TYPES = ["full_attention", "linear_attention", "linear_attention", "full_attention"]

# The prompts the shipped model and its router-swapped copy are compared on (`swapped`).
DRIFT_TEXTS = ["def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
               "Now is the winter of our discontent made glorious summer by this sun of York."]
