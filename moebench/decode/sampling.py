"""Choosing the next token from logits: greedy, or temperature with top-p."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from ..errors import MoebenchError


class DecodeError(MoebenchError, ValueError):
    """A prompt or sampling setting decoding cannot use: no tokens, ids outside the vocabulary, top_p 0, ..."""


@dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy; top_p < 1 keeps the smallest set of tokens with that much mass."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise DecodeError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DecodeError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise DecodeError(f"seed must be an integer or None, got {self.seed!r}")


def sample(logits: mx.array, sampling: Sampling, key: mx.array | None = None) -> mx.array:
    """logits [B, V] -> token ids [B]."""
    if sampling.temperature <= 0:
        return mx.argmax(logits, axis=-1)
    logits = logits.astype(mx.float32) / sampling.temperature
    if sampling.top_p < 1.0:
        probs = mx.softmax(logits, axis=-1)
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        keep_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) < sampling.top_p
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        logits = mx.where(keep, logits, -mx.inf)
    return mx.random.categorical(logits, key=key)


GREEDY = Sampling()
