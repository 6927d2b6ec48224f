"""How a decoder layer runs its two parts: by its own modules, or by the steps an execution plan chose.

The layer's forward (h = x + attention(norm(x)); out = h + mlp(norm(h))) is written once, in the model
file; what runs each part is a LayerRun. Each part takes its norm with the residual stream and returns the stream
with its output added, so a fused step may normalise inside its first kernel and add inside its last. A call
without a plan runs the modules (MODULES); the execution layer (moebench.execution.plan.LayerPlan) hands in a
fused kernel step where it decided one can run.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

from .hooks import Record


class LayerRun(Protocol):
    def attend(self, attn, norm, residual: mx.array, cache, record: Record | None = None) -> mx.array:
        """residual + the token mixing `attn` of norm(residual), continuing `cache`; `record`: where the token
        mixing records what it computes (a hybrid layer's `mixer` place), handed to whichever runs it."""

    def feed_forward(self, mlp, norm, residual: mx.array, record: Record | None) -> mx.array:
        """residual + the MLP (or MoE block) of norm(residual); `record` only for a MoE block."""


class Modules:
    """Each part by the model's own module."""

    def attend(self, attn, norm, residual: mx.array, cache, record: Record | None = None) -> mx.array:
        return residual + attn(norm(residual), cache, record)

    def feed_forward(self, mlp, norm, residual: mx.array, record: Record | None) -> mx.array:
        xn = norm(residual)
        return residual + (mlp(xn) if record is None else mlp(xn, record))


MODULES = Modules()


def token_mixer(layer):
    """A decoder layer's token-mixing module (its `mixer`: attention, or a hybrid's linear or full attention). Its
    `spec` says what it computes (moebench.models.declare)."""
    return layer.mixer


def feed_forward_norm(layer):
    """A decoder layer's norm before its MLP or MoE block (its `ffn_norm`)."""
    return layer.ffn_norm
