"""Decoding one sequence: the Session its steps are built in, and the pipelined loop over it.

A Session holds what a decode carries from step to step (the KV cache, or a compiled step's static
cache; the sampling key) and builds each step through the model's Executor, which decides how it runs.
A built step is scheduled at once (mx.async_eval) and taken later: `generate_tokens` queues steps ahead
of the token it reads, moebench.inspect.record.Stepper one, and either can roll a step back that it
will not take. A step is counted in the dispatch counts when it is taken.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from ..execution.executor import executor
from ..execution.kernel import available_backend
from ..execution.plan import Plan
from ..execution.settings import KernelSettings
from ..models.hooks import Record
from .cache import make_cache
from .compiled import CompiledForward, compile_blocker
from .sampling import GREEDY, DecodeError, Sampling, sample, seen_tokens

# Steps queued ahead of the token being read (mlx-lm's generate_step queues one): a step stays queued
# behind the running one while the host reads a token and builds the next (docs/benchmarks/h200.md,
# step 8); tokens are the same at any depth.
STEPS_AHEAD = 2
COMPILED_BY_DEFAULT = ("cuda",)  # backends whose fused decode was measured faster through the compiled step


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


def is_moebench_model(model) -> bool:
    return hasattr(model, "moe_blocks")


def use_compiled(model, compiled: bool | None) -> bool:
    """Whether to decode through the compiled step: as asked, or by default (None) where it was measured
    to win, a moebench model with the fused kernels on CUDA (docs/benchmarks/h200.md, steps 4-5);
    elsewhere (CPU, Metal, the fallback, other engines' models) eager."""
    if compiled is not None:
        return compiled
    return (is_moebench_model(model) and available_backend() in COMPILED_BY_DEFAULT
            and executor(model).settings.fused)


def check_prompt(model, prompt_ids: list[int]) -> list[int]:
    """The prompt as a list of ints, every id inside the model's vocabulary (MLX does not bounds-check the
    embedding lookup: an id past the table reads garbage silently)."""
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise DecodeError("the prompt is empty: give at least one token")
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    bad = [t for t in ids if not 0 <= t < (vocab or float("inf"))]
    if bad:
        raise DecodeError(f"prompt token id {bad[0]} is outside the model's vocabulary of {vocab} (ids 0..{vocab - 1})")
    return ids


@dataclass
class Step:
    """A built (and scheduled) forward call: the token it chose, its logits, the plan it ran, how many tokens
    it fed, and the sampling key and token history before it (to roll it back)."""

    token: mx.array
    logits: mx.array
    plan: Plan | None
    tokens: int
    key_before: mx.array | None
    history_before: mx.array | None


class Session:
    """One sequence being decoded (see the module docstring). `compiled`: through the compiled step (None:
    use_compiled; it is declined while recording or with an intervention set). `capacity`: the most tokens
    the sequence will hold (a compiled step's static cache is sized for it)."""

    def __init__(self, model, sampling: Sampling = GREEDY, compiled: bool | None = None, capacity: int = 0,
                 recording: bool = False):
        self.model, self.sampling = model, sampling
        self.key = mx.random.key(sampling.seed) if sampling.seed is not None else None
        self.history: mx.array | None = None  # the ids fed so far, when the repetition penalty needs them
        self.executor = executor(model) if is_moebench_model(model) else None
        if self.executor is not None:
            self.executor.refresh()
        self.compiled = None
        if self.executor is not None and use_compiled(model, compiled) and compile_blocker(model, recording) is None:
            self.compiled = CompiledForward(self.executor, capacity)
        self.cache = make_cache(len(model.layers)) if self.compiled is None else None

    @property
    def position(self) -> int:
        return self.compiled.position if self.compiled is not None else self.cache[0].offset

    def build(self, tokens: mx.array, record: Record | None = None, settings: KernelSettings | None = None,
              every_position: bool = False) -> Step:
        """Build the forward over `tokens` [n] and the choice of the next token, and schedule both. `record`
        (eager only) receives the internals; `every_position`: logits of every position [n, V] (else the
        last's [V]); `settings`: this step's kernel settings instead of the model's."""
        settings = settings or (self.executor.settings if self.executor is not None else None)
        if self.compiled is not None:
            if record is not None or every_position:
                raise DecodeError("a compiled decode neither records nor returns every position's logits")
            logits, plan = self.compiled(tokens, settings)
            last = logits
        elif self.executor is not None:
            plan = self.executor.plan(tokens.size, self.cache, settings)
            logits = self.executor.forward(tokens[None], self.cache, plan, record, every_position)[0]
            last = logits[-1] if every_position else logits
        else:  # another engine's model (mlx-lm's) under this loop: its forward unembeds every position
            plan, logits = None, self.model(tokens[None], self.cache)[0]
            last = logits[-1]
            logits = logits if every_position else last
        key_before, sub, history_before = self.key, None, self.history
        if self.key is not None:
            self.key, sub = mx.random.split(self.key)
        self.history = seen_tokens(self.history, tokens, self.sampling)
        token = sample(last[None], self.sampling, sub, self.history)[0]
        mx.async_eval(token, logits)
        return Step(token, logits, plan, tokens.size, key_before, history_before)

    def take(self, step: Step) -> int:
        """The step's token id, once it is evaluated; the step is counted as run."""
        tid = step.token.item()
        if step.plan is not None:
            self.executor.count(step.plan)
        return tid

    def rollback(self, step: Step) -> None:
        """Undo the last built step, which will not be taken: the cache position, the sampling key and the
        token history."""
        if self.compiled is not None:
            self.compiled.rewind(step.tokens)
        else:
            for c in self.cache:
                c.offset -= step.tokens
        self.key, self.history = step.key_before, step.history_before


def generate_tokens(
    model, prompt_ids: list[int], max_tokens: int, sampling: Sampling = GREEDY,
    stop_ids: tuple[int, ...] = (), compiled: bool | None = None, ahead: int = STEPS_AHEAD,
) -> Iterator[tuple[int, mx.array]]:
    """Yield (token id, next-token logits [V]) one step at a time; evaluation is pipelined `ahead` steps
    ahead of the token being read (a stop token leaves that many steps computed and not taken).

    `compiled` (default: use_compiled) decodes through one mx.compile'd step over a static cache
    (moebench.decode.compiled) unless an intervention is set, which runs eagerly.
    """
    prompt_ids = check_prompt(model, prompt_ids)
    if ahead < 1:
        raise DecodeError(f"ahead must be at least 1 (steps queued ahead of the token read), got {ahead}")
    session = Session(model, sampling, compiled, len(prompt_ids) + max_tokens)
    queued = deque([session.build(mx.array(prompt_ids, dtype=mx.uint32))])
    for n in range(max_tokens):
        # Queue the next steps before reading this one: the first token leaves after one (as before it),
        # later ones after `ahead`, so the host is building step n + ahead while the device runs n + 1.
        while len(queued) <= min(ahead, n + 1) and n + len(queued) < max_tokens:
            queued.append(session.build(queued[-1].token.reshape(1).astype(mx.uint32)))
        step = queued.popleft()
        tid = session.take(step)
        yield tid, step.logits
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
