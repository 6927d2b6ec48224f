"""A compiled single-token decode step: one plan's forward traced once by mx.compile over a fixed-capacity
cache (moebench.decode.cache.StaticCache: the attending layers' keys and values, and a hybrid's recurrent states),
so each token replays one graph instead of rebuilding it in Python, and MLX can fuse the elementwise work between
kernels.

The traced step runs the same plan (moebench.execution.plan) as an eager step would; one traced graph is
kept per plan in the model's Executor, and dropped with the plans when weights are replaced (the graph
holds the arrays it was traced with). Recording hands arrays out of the forward as it is built, so this
path declines it (compile_blocker) and the eager step runs instead; interventions are part of the plan.

A hybrid's linear-attention layers (Gated DeltaNet) keep no keys and values: their conv and delta states are
inputs and outputs of the traced step beside the key and value buffers, held in LinearAttentionStates, which keep
the last few by reference, so a rewind puts them back exactly as they were after that position.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import DecodeError
from ..execution.executor import PREFILL_CHUNK, Executor
from ..execution.plan import Plan
from ..execution.settings import KernelSettings
from ..models.switch import on_main_thread
from .cache import StaticCache, StepPosition, kv_cache_bytes, linear_layers, linear_state_bytes, require_memory
from .state import LinearAttentionState, empty_state

CAPACITY_STEP = 256


def compile_blocker(recording: bool) -> str | None:
    """Why a decode step cannot be compiled, or None. Interventions compile: each set of them is its own plan, and
    each plan its own traced step; so does a hybrid (its recurrent states are the traced step's inputs and
    outputs)."""
    if recording:
        return "recording (recording runs eagerly)"
    if not on_main_thread():
        return "not the main thread (mx.compile'd graphs used from other threads end the process at exit)"
    return None


def static_logits(executor: Executor, tokens: mx.array, cache: StaticCache, plan: Plan) -> mx.array:
    """Next-token logits [vocab] of one sequence's `tokens` at the cache's position; their keys and values
    and the recurrent states after them written."""
    logits = executor.forward(tokens.reshape(1, -1), cache.layers(), plan)[0]
    if cache.position.known:
        # A prompt chunk after the first attended over the slots before it, read from the buffers: with those
        # reads done first, the commit's update of the buffers reuses them; built on top of the reads, it copied
        # both whole buffers (the whole cache again at the peak of every later chunk).
        mx.eval(logits)
    cache.commit()
    return logits


States = list[tuple[mx.array, mx.array]]  # (conv, delta) of each linear-attention layer


def _traced_step(executor: Executor, plan: Plan, blocks: tuple[int | None, ...]):
    def step(token: mx.array, offset: mx.array, keys: mx.array, values: mx.array, states: States):
        held = [LinearAttentionState.holding(conv, delta) for conv, delta in states]
        cache = StaticCache(keys, values, StepPosition.at(offset, keys.shape[2]), blocks, held)  # one position
        logits = static_logits(executor, token, cache, plan)
        return logits, cache.keys, cache.values, [(s.conv, s.delta) for s in held]
    return mx.compile(step)


class CompiledForward:
    """Next-token logits for one sequence: prefill eagerly into a static cache, then compiled single steps.

    Each call first schedules the previous call's logits (mx.async_eval: nothing to do when the caller did,
    as the decode loop does), so the steps run in call order even when a token is not built from the last
    logits: on a GPU the attention kernels write the cache in place, an order MLX's graph does not see
    (moebench.decode.cache.StaticCache).

    `keep`: how many writes back `rewind_to` can restore a hybrid's recurrent states (a decode that queues
    `ahead` steps behind the one it reads needs ahead + 1, moebench.decode.loop.Session); the keys and values
    rewind to any position."""

    def __init__(self, executor: Executor, capacity: int, keep: int = 1):
        self.executor = executor
        self.capacity = -(-max(capacity, 1) // CAPACITY_STEP) * CAPACITY_STEP
        model = executor.model
        # allocated whole up front: MLX kills the process on CPU when an allocation fails
        require_memory(kv_cache_bytes(model, self.capacity) + linear_state_bytes(model, keep),
                       f"the compiled step's static cache of {self.capacity} positions")
        self.cache = StaticCache.for_model(model, self.capacity, keep)
        self.specs = linear_layers(model)  # of the cache's states, in order
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
        cache, ex = self.cache, self.executor
        plan = ex.plan_for(n, True, settings)
        if n > 1:  # a prompt, PREFILL_CHUNK tokens at a time, each chunk evaluated before the next
            for start in range(0, n, PREFILL_CHUNK):
                chunk, at = tokens[start : start + PREFILL_CHUNK], self.position
                cache.position = StepPosition.at(mx.array(at, dtype=mx.int32), self.capacity, known=at)
                logits = static_logits(ex, chunk, cache, plan)
                self.position += chunk.size  # with the states: a later chunk failing leaves both here
                if start + PREFILL_CHUNK < n:
                    mx.eval(cache.arrays())
        else:
            if plan.key not in ex.compiled:
                ex.compiled[plan.key] = _traced_step(ex, plan, cache.blocks)
            offset = mx.array(self.position, dtype=mx.int32)
            logits, cache.keys, cache.values, states = ex.compiled[plan.key](tokens, offset, cache.keys, cache.values,
                                                                             self._states())
            for state, (conv, delta) in zip(cache.states, states, strict=True):
                state.write(conv, delta, 1)
            self.position += 1
        self.last = logits
        return logits, plan

    def _states(self) -> States:
        """The recurrent states the next step continues (zeros before the first position)."""
        dtype = self.executor.model.dtype
        return [(s.conv, s.delta) if s.conv is not None else empty_state(spec, dtype)
                for s, spec in zip(self.cache.states, self.specs, strict=True)]

    def rewind_to(self, position: int) -> None:
        """Forget every position from `position` on (steps built and not taken): later writes overwrite their
        slots, and the recurrent states are put back as they were after `position` (a position not kept is a
        DecodeError, and nothing changes)."""
        for state in self.cache.states:
            state.rewind_to(position)
        self.position = position
