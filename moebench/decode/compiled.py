"""A compiled single-token decode step: one plan's forward traced once by mx.compile over a fixed-capacity
KV cache (moebench.decode.cache.StaticCache), so each token replays one graph instead of rebuilding it in
Python, and MLX can fuse the elementwise work between kernels.

The traced step runs the same plan (moebench.execution.plan) as an eager step would; one traced graph is
kept per plan in the model's Executor, and dropped with the plans when weights are replaced (the graph
holds the arrays it was traced with). Recording hands arrays out of the forward as it is built, so this
path declines it (compile_blocker) and the eager step runs instead; interventions are part of the plan. So does a
hybrid: the static cache holds keys and values, and its linear-attention layers carry a recurrent state.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import DecodeError
from ..execution.executor import PREFILL_CHUNK, Executor
from ..execution.plan import Plan
from ..execution.settings import KernelSettings
from ..models.switch import on_main_thread
from .cache import StaticCache, StepPosition, kv_cache_bytes, linear_layers, require_memory

CAPACITY_STEP = 256


def compile_blocker(recording: bool, model=None) -> str | None:
    """Why a decode step (of `model`, when given) cannot be compiled, or None. Interventions compile: each set of
    them is its own plan, and each plan its own traced step."""
    if recording:
        return "recording (recording runs eagerly)"
    if not on_main_thread():
        return "not the main thread (mx.compile'd graphs used from other threads end the process at exit)"
    linear = linear_layers(model) if model is not None else []
    if linear:
        return (f"{len(linear)} layers of {linear[0].kind} (the compiled step's static cache holds keys and values, "
                "not their recurrent state)")
    return None


def static_logits(executor: Executor, tokens: mx.array, cache: StaticCache, plan: Plan) -> mx.array:
    """Next-token logits [vocab] of one sequence's `tokens` at the cache's position; their keys and values
    written."""
    logits = executor.forward(tokens.reshape(1, -1), cache.layers(), plan)[0]
    cache.commit()
    return logits


def _traced_step(executor: Executor, plan: Plan):
    def step(token: mx.array, offset: mx.array, keys: mx.array, values: mx.array):
        cache = StaticCache(keys, values, StepPosition.at(offset, keys.shape[2]))  # one position for every layer
        return static_logits(executor, token, cache, plan), cache.keys, cache.values
    return mx.compile(step)


class CompiledForward:
    """Next-token logits for one sequence: prefill eagerly into a static cache, then compiled single steps.

    Each call first schedules the previous call's logits (mx.async_eval: nothing to do when the caller did,
    as the decode loop does), so the steps run in call order even when a token is not built from the last
    logits: on a GPU the attention kernels write the cache in place, an order MLX's graph does not see
    (moebench.decode.cache.StaticCache)."""

    def __init__(self, executor: Executor, capacity: int):
        self.executor = executor
        self.capacity = -(-max(capacity, 1) // CAPACITY_STEP) * CAPACITY_STEP
        model = executor.model
        if linear_layers(model):
            raise DecodeError(f"no compiled step for this model: {compile_blocker(False, model)}")
        # allocated whole up front: MLX kills the process on CPU when an allocation fails
        require_memory(kv_cache_bytes(model, self.capacity), f"the compiled step's static cache of {self.capacity} "
                       "positions")
        attn = model.layers[0].self_attn  # this process's key/value heads (a rank's own where attention is sharded)
        self.cache = StaticCache.empty(len(model.layers), attn.n_kv_heads, self.capacity, attn.head_dim, model.dtype)
        self.position = 0
        self.last: mx.array | None = None  # the previous call's logits

    def __call__(self, tokens: mx.array, settings: KernelSettings) -> tuple[mx.array, Plan]:
        """(logits [vocab], the plan it ran) after `tokens` [n]."""
        n = tokens.size
        if self.position + n > self.capacity:
            raise DecodeError(f"a sequence of {self.position + n} tokens exceeds the compiled cache of {self.capacity} "
                              "positions")
        if self.last is not None:
            mx.async_eval(self.last)
        offset = mx.array(self.position, dtype=mx.int32)
        cache, ex = self.cache, self.executor
        plan = ex.plan_for(n, True, settings)
        if n > 1:  # a prompt, PREFILL_CHUNK tokens at a time, each chunk evaluated before the next
            for start in range(0, n, PREFILL_CHUNK):
                at = self.position + start
                cache.position = StepPosition.at(mx.array(at, dtype=mx.int32), self.capacity, known=at)
                logits = static_logits(ex, tokens[start : start + PREFILL_CHUNK], cache, plan)
                if start + PREFILL_CHUNK < n:
                    mx.eval(cache.keys, cache.values)
        else:
            if plan.key not in ex.compiled:
                ex.compiled[plan.key] = _traced_step(ex, plan)
            logits, cache.keys, cache.values = ex.compiled[plan.key](tokens, offset, cache.keys, cache.values)
        self.position += n
        self.last = logits
        return logits, plan

    def rewind_to(self, position: int) -> None:
        """Forget every position from `position` on (steps built and not taken); later writes overwrite their
        slots."""
        self.position = position
