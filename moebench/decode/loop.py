"""Prefill and decode loops with a KV cache."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from ..execution.dispatch import available_backend, fused_moe_enabled
from .cache import make_cache
from .compiled import CompiledForward, compile_blocker
from .sampling import GREEDY, DecodeError, Sampling, sample


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def prompt_tps(self) -> float:
        return len(self.prompt_ids) / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens after the first, per second of decoding (the first comes out of prefill)."""
        n = len(self.token_ids) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds else 0.0


# Steps queued ahead of the token being read (mlx-lm's generate_step queues one). With two, a step stays
# queued behind the running one while the host reads a token and builds the next. On the H200 the
# compiled step decoded 13% faster two ahead than one in a run on a slow host moment and the same on a
# quiet one (docs/benchmarks/h200.md, step 8); tokens are the same at any depth.
STEPS_AHEAD = 2
COMPILED_BY_DEFAULT = ("cuda",)  # backends whose fused decode was measured faster through the compiled step


def use_compiled(model, compiled: bool | None) -> bool:
    """Whether to decode through the compiled step: as asked, or by default (None) where it was measured
    to win, a moebench model with the fused kernels on CUDA (docs/benchmarks/h200.md, steps 4-5: 1.3-1.4x
    the eager fused loop); elsewhere (CPU, Metal, the fallback, other engines' models) eager."""
    if compiled is not None:
        return compiled
    return hasattr(model, "dispatch_counters") and available_backend() in COMPILED_BY_DEFAULT and fused_moe_enabled()


def generate_tokens(
    model, prompt_ids: list[int], max_tokens: int, sampling: Sampling = GREEDY,
    stop_ids: tuple[int, ...] = (), compiled: bool | None = None, ahead: int = STEPS_AHEAD,
) -> Iterator[tuple[int, mx.array]]:
    """Yield (token id, next-token logits [V]) one step at a time; evaluation is pipelined `ahead` steps
    ahead of the token being read (a stop token leaves that many steps computed and unused).

    `compiled` (default: use_compiled) decodes through one mx.compile'd step over a static cache
    (moebench.decode.compiled) unless a recorder or an intervention is attached, which run eagerly.
    """
    if not prompt_ids:
        raise DecodeError("the prompt is empty: give at least one token")
    if ahead < 1:
        raise DecodeError(f"ahead must be at least 1 (steps queued ahead of the token read), got {ahead}")
    # MLX does not bounds-check the embedding lookup: an id past the table reads garbage silently
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    bad = [t for t in prompt_ids if not 0 <= t < (vocab or float("inf"))]
    if bad:
        raise DecodeError(f"prompt token id {bad[0]} is outside the model's vocabulary of {vocab}")
    key = mx.random.key(sampling.seed) if sampling.seed is not None else None
    if use_compiled(model, compiled) and compile_blocker(model) is None:
        forward = CompiledForward(model, len(prompt_ids) + max_tokens)
    else:
        cache = make_cache(len(model.layers))
        last_logits = getattr(model, "last_logits", None)  # other models (e.g. mlx-lm's) unembed every position

        def forward(tokens: mx.array) -> mx.array:
            if last_logits is not None:
                return last_logits(tokens[None], cache)[0]
            return model(tokens[None], cache)[0, -1]

    def step(tokens: mx.array, key: mx.array | None) -> tuple[mx.array, mx.array, mx.array | None]:
        logits = forward(tokens)
        sub = None
        if key is not None:
            key, sub = mx.random.split(key)
        return sample(logits[None], sampling, sub)[0], logits, key

    token, logits, key = step(mx.array(prompt_ids, dtype=mx.uint32), key)
    mx.async_eval(token, logits)
    queued = deque([(token, logits)])
    for n in range(max_tokens):
        # Queue the next steps before reading this one: the first token leaves after one (as before it),
        # later ones after `ahead`, so the host is building step n + ahead while the device runs n + 1.
        while len(queued) <= min(ahead, n + 1) and n + len(queued) < max_tokens:
            token, logits, key = step(queued[-1][0].reshape(1).astype(mx.uint32), key)
            mx.async_eval(token, logits)
            queued.append((token, logits))
        token, logits = queued.popleft()
        tid = token.item()
        yield tid, logits
        if tid in stop_ids:
            return


def generate(model, prompt_ids: list[int], max_tokens: int, sampling: Sampling = GREEDY,
             stop_ids: tuple[int, ...] = (), compiled: bool | None = None,
             ahead: int = STEPS_AHEAD) -> GenerationResult:
    """Run prefill and decode; time both (the first token marks the end of prefill)."""
    result = GenerationResult(list(prompt_ids))
    start = time.perf_counter()
    first = None
    for tid, _ in generate_tokens(model, prompt_ids, max_tokens, sampling, stop_ids, compiled, ahead):
        result.token_ids.append(tid)
        if first is None:
            first = time.perf_counter()
            result.prompt_seconds = first - start
    if first is not None:
        result.decode_seconds = time.perf_counter() - first
    return result
