"""Decoding one sequence: the Session its steps are built in, and the pipelined loop over it.

A Session holds what a decode carries from step to step (the KV cache, or a compiled step's static
cache; the sampling key) and builds each step through the model's Executor, which decides how it runs.
A built step is scheduled at once (mx.async_eval) and taken later. Session.next is the one decode loop's
step: `generate_tokens` asks it for a step and keeps steps queued ahead of the token it reads, and
moebench.inspect.record.Stepper does the same with recording, one step ahead; a queued step built under
another state or from another token is rolled back and built again. A step is counted in the dispatch
counts when it is taken.
"""

from __future__ import annotations

import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from numbers import Integral
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..errors import DeviceMemoryError, NonFiniteError
from ..execution.executor import PREFILL_CHUNK, executor
from ..execution.kernel import available_backend
from ..execution.plan import Plan
from ..execution.settings import KernelSettings
from ..models.hooks import Record
from .cache import (
    GROW_STEP,
    forward_bytes,
    kv_cache_bytes,
    layer_caches,
    linear_state_bytes,
    make_cache,
    require_memory,
)
from .compiled import CompiledForward, compile_blocker
from .sampling import GREEDY, DecodeError, Sampling, sample, seen_tokens

# Steps queued ahead of the token being read (mlx-lm's generate_step queues one): a step stays queued
# behind the running one while the host reads a token and builds the next
# (docs/benchmarks/cache-writes-h200-2026-12-01.md); tokens are the same at any depth.
STEPS_AHEAD = 2
# Where generate decodes through the compiled step by default (use_compiled): per backend, the fused switch settings
# under which it was measured faster there. CUDA: the fused kernels
# (docs/benchmarks/attention-kernel-h200-2026-11-30.md). The CPU ('reference'): fused and fallback alike, with
# logits equal bit for bit to the eager loop's: eagerly the host builds every op of every layer again each token,
# and on a CPU that host time is taken from the cores computing the step before
# (docs/benchmarks/cpu-default-path-2026-12-03.md). Metal: not measured, eager.
COMPILED_BY_DEFAULT: dict[str, tuple[bool, ...]] = {"cuda": (True,), "reference": (True, False)}


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

    def __repr__(self) -> str:
        """A summary line: a long prompt's ids would bury the numbers (the ids stay in the fields)."""
        return (f"{type(self).__name__}: {len(self.prompt_ids)} prompt tokens, {len(self.token_ids)} generated; "
                f"prefill {self.prompt_seconds * 1e3:.1f} ms ({self.prompt_tps:.1f} tok/s), decode "
                f"{self.decode_seconds * 1e3:.1f} ms ({self.decode_tps:.1f} tok/s); data: .token_ids, .prompt_ids")


def is_moebench_model(model) -> bool:
    return hasattr(model, "moe_blocks")


def compiled_by_default(backend: str, fused: bool) -> bool:
    """Whether a moebench model decodes through the compiled step by default on `backend` with the fused kernels
    on or off (COMPILED_BY_DEFAULT)."""
    return fused in COMPILED_BY_DEFAULT.get(backend, ())


def use_compiled(model, compiled: bool | None) -> bool:
    """Whether to decode through the compiled step: as asked, or by default (None) where it was measured to win
    (compiled_by_default: CUDA with the fused kernels, the CPU either way); elsewhere (Metal, the fallback on CUDA,
    other engines' models) eager."""
    if compiled is not None:
        return compiled
    return is_moebench_model(model) and compiled_by_default(available_backend(), executor(model).settings.fused)


def check_prompt(model, prompt_ids: Iterable[int]) -> list[int]:
    """The prompt as a list of ints: token ids as a list, tuple or 1-D numpy / MLX integer array, every one inside
    the model's vocabulary (MLX does not bounds-check the embedding lookup: an id past the table reads garbage or
    crashes the process)."""
    if isinstance(prompt_ids, (str, bytes)):
        raise DecodeError("the prompt is text: give token ids (tokenizer.encode), or use Stepper, which takes text")
    try:
        ids = np.asarray(prompt_ids)
    except (TypeError, ValueError, OverflowError, RuntimeError) as e:  # ragged lists, bfloat16 arrays, ...
        raise DecodeError(f"the prompt must be a flat sequence of integer token ids: {e}") from e
    if ids.size == 0:
        raise DecodeError("the prompt is empty: give at least one token")
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise DecodeError(f"the prompt must be a flat sequence of integer token ids, got {ids.dtype} values of shape "
                          f"{ids.shape}")
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    bad = ids[(ids < 0) | (ids >= vocab)] if vocab else ids[ids < 0]
    if bad.size:
        raise DecodeError(f"prompt token id {bad[0]} is outside the model's vocabulary of {vocab} (ids 0..{vocab - 1})")
    return ids.tolist()


def check_count(name: str, value: object) -> int:
    """A count a caller gives (max_tokens, ahead): an integer >= 1."""
    try:
        count = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        count = None
    if count is None or count < 1:
        raise DecodeError(f"{name} must be at least 1 (an integer), got {value!r}")
    return count


def check_length(model, prompt: int, positions: int, every_position: bool = False) -> None:
    """Before a decode asks MLX for anything: the most positions it will feed (`positions`, the `prompt` first)
    within the model's max_position_embeddings, and the memory of its cache and of its prefill (require_memory):
    PREFILL_CHUNK prompt tokens at a time, or the whole prompt at once when `every_position`'s logits are kept."""
    if not is_moebench_model(model):
        return
    args = model.args
    limit = args.max_position_embeddings
    if limit is not None and positions > limit:
        raise DecodeError(f"the decode would feed {positions} positions (a prompt of {prompt} tokens and the ones "
                          f"generated), past the model's max_position_embeddings of {limit} (config.json)")
    cached = -(-(positions + 1) // GROW_STEP) * GROW_STEP
    queries = prompt if every_position else min(prompt, PREFILL_CHUNK)
    prefill = forward_bytes(args, queries, prompt, prompt if every_position else 1)
    states = linear_state_bytes(model, STEPS_AHEAD + 1)
    require_memory(kv_cache_bytes(model, cached) + states + prefill,
                   f"a decode of {positions} positions (its KV cache and a prefill of {prompt} tokens)")


@dataclass
class Step:
    """A built (and scheduled) forward call: the token it chose, its logits, the plan it ran, how many tokens
    it fed, the position it started at, and the sampling key and token history before it (to roll it back).
    `checked` is the token, or the vocabulary size when the logits it was chosen from were not all finite
    (computed on the device with the token, and read instead of it: no extra wait a step). `state`: what it
    was built under (Session.state); `extras`: what its builder kept beside it (a Stepper's records)."""

    token: mx.array
    checked: mx.array
    logits: mx.array
    plan: Plan | None
    tokens: int
    position: int
    key_before: mx.array | None
    history_before: mx.array | None
    state: tuple = ()
    extras: object = None


class Mark(NamedTuple):
    """A session after its last taken step: what Session.restore puts back."""

    position: int
    key: mx.array | None
    history: mx.array | None
    last_read: int | None


# build(tokens [n], state) -> the scheduled Step feeding them
Builder = Callable[[mx.array, tuple], Step]


class Session:
    """One sequence being decoded (see the module docstring). `compiled`: through the compiled step (None:
    use_compiled; it is declined while recording). `capacity`: the most tokens the sequence will hold (a
    compiled step's static cache is sized for it). `ahead`: the most steps the caller queues behind the one it
    reads (a linear-attention layer's state keeps that many writes and one more, to roll them back).

    The one decode loop: `next` hands out the step that feeds the given tokens, from the queue of steps built
    ahead when one was built from them under the same state, else built now (the queue rolled back), and
    keeps `ahead` steps queued behind it. Everything a built step depends on besides its tokens is in its
    state (`state`: the kernel settings, the interventions, and whatever the caller adds)."""

    def __init__(self, model, sampling: Sampling = GREEDY, compiled: bool | None = None, capacity: int = 0,
                 recording: bool = False, ahead: int = STEPS_AHEAD):
        if not isinstance(sampling, Sampling):
            raise DecodeError(f"sampling must be a moebench.Sampling, got {type(sampling).__name__}")
        if compiled is not None and not isinstance(compiled, bool):
            raise DecodeError(f"compiled must be True, False or None (the default for this backend), got {compiled!r}")
        self.model, self.sampling = model, sampling
        self.key = mx.random.key(sampling.seed) if sampling.seed is not None else None
        self.history: mx.array | None = None  # the ids fed so far, when the repetition penalty needs them
        self.executor = executor(model) if is_moebench_model(model) else None
        if self.executor is not None:
            self.executor.refresh()
        self.compiled = None
        if self.executor is not None and use_compiled(model, compiled) and compile_blocker(recording) is None:
            self.compiled = CompiledForward(self.executor, capacity, ahead + 1)
        self.cache = None
        if self.compiled is None:
            self.cache = layer_caches(model, ahead + 1) if self.executor is not None else make_cache(len(model.layers))
        self.queue: deque[Step] = deque()  # steps built ahead, oldest first
        self.last_read: int | None = None  # the token id taken last
        self.thread = threading.current_thread()  # where its arrays live
        # one step of one model at a time across threads (its plans, traced steps and counts are shared)
        self._lock = self.executor.lock if self.executor is not None else nullcontext()

    def check_thread(self) -> None:
        """MLX keeps its streams per thread: a session's arrays live on the stream of the thread that made it, and
        another thread using them fails (or, evaluating them, can end the process). Raise before anything is
        touched, so the session stays usable from its own thread."""
        if threading.current_thread() is not self.thread:
            raise DecodeError(f"this decode was started on thread {self.thread.name!r} and is used from "
                              f"{threading.current_thread().name!r}: MLX keeps its streams per thread, so step it "
                              "from the thread that started it (or start a decode on this one)")

    @property
    def position(self) -> int:
        """Positions fed so far, the queued steps' included."""
        return self.compiled.position if self.compiled is not None else self.cache[0].offset

    def state(self, settings: KernelSettings | None = None, *extra: object) -> tuple:
        """What a step built now depends on besides its tokens: its kernel settings (`settings`, else the model's),
        the interventions set on the model, and `extra` (a caller's own, such as recording)."""
        if self.executor is None:
            return (None, (), *extra)
        return (settings or self.executor.settings, self.executor.interventions(), *extra)

    def build(self, tokens: mx.array, state: tuple | None = None, record: Record | None = None,
              every_position: bool = False, extras: object = None) -> Step:
        """Build the forward over `tokens` [n] and the choice of the next token under `state` (Session.state),
        and schedule both. `record` (eager only) receives the internals; `every_position`: logits of every
        position [n, V] (else the last's [V])."""
        state = self.state() if state is None else state
        settings, position = state[0], self.position
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
        checked = finite_or_flag(token, last, self.sampling)
        mx.async_eval(checked, logits)
        return Step(token, checked, logits, plan, tokens.size, position, key_before, history_before, state, extras)

    def next(self, feed: list[int], state: tuple, ahead: int, remaining: int, build: Builder | None = None) -> Step:
        """The step feeding `feed` (the prompt, the token read last, or another) under `state`: the queued one
        when it was built from the token read last and `feed` is that token, under the same state; else built
        now, the queue rolled back first. Then up to `ahead` steps are queued behind it (at most `remaining` - 1:
        `remaining` counts the steps the caller may still take, this one included), each from the lazy token of
        the one before."""
        self.check_thread()
        build = build or self.build
        with self._lock:
            if self.queue and (feed != [self.last_read] or self.queue[0].state != state):
                self.drop_queue()
            step = self.queue.popleft() if self.queue else build(mx.array(feed, dtype=mx.uint32), state)
            while len(self.queue) < min(ahead, remaining - 1):
                behind = self.queue[-1] if self.queue else step
                self.queue.append(build(behind.token.reshape(1).astype(mx.uint32), state))
        return step

    def take(self, step: Step, count: bool = True) -> int:
        """The step's token id, once it is evaluated; the step is counted as run (unless `count` is False: the
        caller counts it, Session.count). Logits that hold NaN or Inf are a NonFiniteError, never a token."""
        self.check_thread()
        try:
            with self._lock:
                tid = step.checked.item()
        except RuntimeError as e:  # an allocation the device could not make (cudaMallocAsync, metal::malloc)
            if "memory" not in str(e).lower() and "malloc" not in str(e).lower():
                raise
            raise DeviceMemoryError(f"the decode step at position {step.position} ran out of device memory: {e}") from e
        if tid == step.logits.shape[-1]:
            raise NonFiniteError(f"the logits at position {step.position + step.tokens - 1} hold NaN or Inf, so no "
                                 "token is chosen from them (moebench.checkpoint.weights.nonfinite_weights(model) "
                                 "names weights that hold them)")
        self.last_read = tid
        if count:
            self.count(step)
        return tid

    def count(self, step: Step) -> None:
        """Count a taken step in the model's dispatch counts."""
        if step.plan is not None:
            self.executor.count(step.plan)

    def _rewind(self, position: int) -> None:
        """Forget every position from `position` on (later writes overwrite their slots)."""
        if self.compiled is not None:
            self.compiled.rewind_to(position)
        else:
            for c in self.cache:
                c.rewind_to(position)

    def rollback(self, step: Step) -> None:
        """Undo the last built step, which will not be taken: the cache position, the sampling key and the
        token history."""
        self._rewind(step.position)
        self.key, self.history = step.key_before, step.history_before

    def drop_queue(self) -> None:
        """Roll back every queued step, newest first."""
        while self.queue:
            self.rollback(self.queue.pop())

    def mark(self) -> Mark:
        """The session after the step taken last (the queued steps not included)."""
        if self.queue:
            first = self.queue[0]
            return Mark(first.position, first.key_before, first.history_before, self.last_read)
        return Mark(self.position, self.key, self.history, self.last_read)

    def restore(self, mark: Mark) -> None:
        """Back to `mark`: every layer's cache position (a forward stopped half-way leaves them apart), the
        sampling key and token history, the token read last; the queue is dropped. Idempotent."""
        self.queue.clear()
        self._rewind(mark.position)
        self.key, self.history, self.last_read = mark.key, mark.history, mark.last_read


def finite_or_flag(token: mx.array, logits: mx.array, sampling: Sampling) -> mx.array:
    """`token`, or the vocabulary size when `logits` [V] hold a NaN or +Inf, computed on the device with the
    token (a few scalar ops, read with it). Greedy: argmax picks a NaN or +Inf wherever one is (MLX's argmax,
    as numpy's; tests/decode pins it), so the chosen token's logit is finite exactly when no logit is NaN or
    +Inf. Sampled: the logits' sum, which is finite exactly when they are (categorical passes NaN over)."""
    probe = logits[token] if sampling.temperature <= 0 else logits.sum()
    return mx.where(mx.isfinite(probe), token, logits.shape[-1])


def generate_tokens(
    model, prompt_ids: Iterable[int], max_tokens: int, sampling: Sampling = GREEDY,
    stop_ids: Iterable[int] = (), compiled: bool | None = None, ahead: int = STEPS_AHEAD,
) -> Iterator[tuple[int, mx.array]]:
    """Yield (token id, next-token logits [V]) one step at a time; evaluation is pipelined `ahead` steps
    ahead of the token being read (a stop token leaves that many steps computed and not taken). A change of
    the kernel settings or the interventions between two tokens applies to the next one: the steps queued
    under the old ones are rolled back and built again (Session.next).

    `compiled` (default: use_compiled) decodes through one mx.compile'd step over a static cache
    (moebench.decode.compiled), interventions included. Every argument is checked before MLX is asked for
    anything, the length and memory too (check_length).
    """
    prompt_ids = check_prompt(model, prompt_ids)
    max_tokens, ahead = check_count("max_tokens", max_tokens), check_count("ahead", ahead)
    stop_ids = check_stop_ids(stop_ids)
    check_length(model, len(prompt_ids), len(prompt_ids) + max_tokens - 1)
    session = Session(model, sampling, compiled, len(prompt_ids) + max_tokens, ahead=ahead)
    feed = prompt_ids
    for n in range(max_tokens):
        # The first token leaves after one step queued behind it (as before it), later ones after `ahead`, so
        # the host is building step n + ahead while the device runs n + 1.
        step = session.next(feed, session.state(), min(ahead, n + 1), max_tokens - n)
        tid = session.take(step)
        yield tid, step.logits
        if tid in stop_ids:
            return
        feed = [tid]


def check_stop_ids(stop_ids: Iterable[int]) -> frozenset[int]:
    """Token ids that end a decode: integers, in a list, tuple or set."""
    ids = list(stop_ids) if isinstance(stop_ids, Iterable) and not isinstance(stop_ids, (str, bytes)) else None
    if ids is None or any(isinstance(i, bool) or not isinstance(i, Integral) for i in ids):
        raise DecodeError(f"stop_ids must be a sequence of integer token ids, got {stop_ids!r}")
    return frozenset(int(i) for i in ids)


def generate(model, prompt_ids: Iterable[int], max_tokens: int, sampling: Sampling = GREEDY,
             stop_ids: Iterable[int] = (), compiled: bool | None = None,
             ahead: int = STEPS_AHEAD) -> GenerationResult:
    """Run prefill and decode; time both (the first token marks the end of prefill)."""
    result = GenerationResult(check_prompt(model, prompt_ids))
    start = time.perf_counter()
    first = None
    for tid, _ in generate_tokens(model, result.prompt_ids, max_tokens, sampling, stop_ids, compiled, ahead):
        result.token_ids.append(tid)
        if first is None:
            first = time.perf_counter()
            result.prompt_seconds = first - start
    if first is not None:
        result.decode_seconds = time.perf_counter() - first
    return result
