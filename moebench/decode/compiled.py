"""A compiled single-token decode step: the whole forward traced once by mx.compile over a
fixed-capacity KV cache (moebench.decode.cache.StaticCache), so each token replays one graph instead of
rebuilding it in Python and MLX can fuse the elementwise work between kernels.

What Python does during tracing happens once, so three things are handled here explicitly:
- the fused-kernel switch is read at trace time: one compiled graph is kept per switch state;
- the weights are captured at trace time: each generation first checks that the model still holds the
  arrays it was traced with (loaded, trained or edited weights are new arrays), and traces again if not;
- dispatch counters (attention and MoE) count at trace time: every later call replays the traced
  decisions into them.
Recording and interventions change the forward in Python, so this path declines them (with the
reason) and the eager path runs instead.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from ..execution.dispatch import Decision, fused_moe_enabled
from .cache import StaticCache, StepPosition

CAPACITY_STEP = 256


def compile_blocker(model) -> str | None:
    """Why this model's decode step cannot be compiled right now, or None."""
    if getattr(model, "recorder", None) is not None:
        return "a recorder is attached (recording runs eagerly)"
    if any(b.intervention is not None for b in model.moe_blocks().values()):
        return "an intervention is set (interventions run eagerly)"
    return None


class CompiledSteps:
    """The compiled decode steps of one model, one per fused-switch state, with their traced decisions."""

    def __init__(self, model):
        self.model = model
        self.steps: dict[bool, Callable] = {}
        self.decisions: dict[bool, list[Decision]] = {}
        self.weights: tuple[int, ...] = ()

    def check_weights(self) -> None:
        """Drop the traced steps when a parameter array was replaced since they were traced (the traced
        graphs keep the old arrays alive, so an id seen at trace time still names the same array)."""
        weights = tuple(id(a) for _, a in tree_flatten(self.model.parameters()))
        if weights != self.weights:
            self.steps.clear()
            self.decisions.clear()
            self.weights = weights

    @classmethod
    def of(cls, model) -> CompiledSteps:
        """The model's own instance, so repeated generations reuse the traced graphs."""
        steps = getattr(model, "compiled_steps", None)
        if steps is None:
            steps = model.compiled_steps = cls(model)  # a plain object: an attribute, not a child module
        return steps

    def __call__(self, token: mx.array, offset: mx.array, keys: mx.array,
                 values: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(logits, keys, values): one step from the cache buffers, and the buffers with its token written."""
        enabled = fused_moe_enabled()
        if enabled not in self.steps:
            self.steps[enabled] = mx.compile(self._forward)
        counters = self.model.dispatch_counters()
        before = counters[0].last
        out = self.steps[enabled](token, offset, keys, values)
        if counters[0].last is not before:  # this call traced: the counters already moved
            self.decisions[enabled] = [c.last for c in counters]
        else:
            for c, decision in zip(counters, self.decisions[enabled], strict=True):
                c.count(decision)
        return out

    def _forward(self, token: mx.array, offset: mx.array, keys: mx.array,
                 values: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        cache = StaticCache(keys, values, StepPosition.at(offset, keys.shape[2]))  # one position for every layer
        return static_logits(self.model, token, cache), cache.keys, cache.values


def static_logits(model, tokens: mx.array, cache: StaticCache) -> mx.array:
    """Next-token logits of one sequence's `tokens` at the cache's position; their keys and values written."""
    logits = model.last_logits(tokens.reshape(1, -1), cache.layers())[0]
    cache.commit()
    return logits


class CompiledForward:
    """Next-token logits for one sequence: prefill eagerly into a static cache, then compiled single steps.

    Each call first schedules the previous call's logits (mx.async_eval: nothing to do when the caller
    did, as generate does), so the steps run in call order even when a token is not built from the last
    logits: on a GPU the attention kernels write the cache in place, an order MLX's graph does not see
    (moebench.decode.cache.StaticCache)."""

    def __init__(self, model, capacity: int):
        self.model = model
        self.capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        a, dtype = model.args, model.norm.weight.dtype
        self.cache = StaticCache.empty(len(model.layers), a.num_key_value_heads, self.capacity, a.head_dim, dtype)
        self.position = 0
        self.last: mx.array | None = None  # the previous call's logits
        self.steps = CompiledSteps.of(model)
        self.steps.check_weights()

    def __call__(self, tokens: mx.array) -> mx.array:
        n = tokens.size
        if self.position + n > self.capacity:
            raise ValueError(f"sequence of {self.position + n} tokens exceeds the compiled cache of {self.capacity}")
        if self.last is not None:
            mx.async_eval(self.last)
        offset = mx.array(self.position, dtype=mx.int32)
        cache = self.cache
        if n > 1:
            cache.position = StepPosition.at(offset, self.capacity)
            logits = static_logits(self.model, tokens, cache)
        else:
            logits, cache.keys, cache.values = self.steps(tokens, offset, cache.keys, cache.values)
        self.position += n
        self.last = logits
        return logits
