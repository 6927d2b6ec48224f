"""Decoding one sequence: the Session its steps are built in, and the pipelined loop over it.

A Session holds what a decode carries from step to step (the KV cache, or a compiled step's static
cache; the sampling key) and builds each step through the model's Executor, which decides how it runs.
A built step is scheduled at once (mx.async_eval) and taken later: `generate_tokens` queues steps ahead
of the token it reads, moebench.inspect.record.Stepper one, and either can roll a step back that it
will not take. A step is counted in the dispatch counts when it is taken.
"""

from __future__ import annotations

import operator
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from numbers import Integral

import mlx.core as mx
import numpy as np

from ..errors import DeviceMemoryError, NonFiniteError
from ..execution.executor import PREFILL_CHUNK, executor
from ..execution.kernel import available_backend
from ..execution.plan import Plan
from ..execution.settings import KernelSettings
from ..models.hooks import Record
from .cache import GROW_STEP, forward_bytes, kv_cache_bytes, make_cache, require_memory
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
    require_memory(kv_cache_bytes(model, cached) + prefill,
                   f"a decode of {positions} positions (its KV cache and a prefill of {prompt} tokens)")


@dataclass
class Step:
    """A built (and scheduled) forward call: the token it chose, its logits, the plan it ran, how many tokens
    it fed, the position it started at, and the sampling key and token history before it (to roll it back).
    `checked` is the token, or the vocabulary size when the logits it was chosen from were not all finite
    (computed on the device with the token, and read instead of it: no extra wait a step)."""

    token: mx.array
    checked: mx.array
    logits: mx.array
    plan: Plan | None
    tokens: int
    position: int
    key_before: mx.array | None
    history_before: mx.array | None


class Session:
    """One sequence being decoded (see the module docstring). `compiled`: through the compiled step (None:
    use_compiled; it is declined while recording or with an intervention set). `capacity`: the most tokens
    the sequence will hold (a compiled step's static cache is sized for it)."""

    def __init__(self, model, sampling: Sampling = GREEDY, compiled: bool | None = None, capacity: int = 0,
                 recording: bool = False):
        if not isinstance(sampling, Sampling):
            raise DecodeError(f"sampling must be a moebench.Sampling, got {type(sampling).__name__}")
        if compiled is not None and not isinstance(compiled, bool):
            raise DecodeError(f"compiled must be True, False or None (the default for this backend), got {compiled!r}")
        self.model, self.sampling = model, sampling
        self.key = mx.random.key(sampling.seed) if sampling.seed is not None else None
        self.history: mx.array | None = None  # the ids fed so far, when the repetition penalty needs them
        self.executor = executor(model) if is_moebench_model(model) else None
        self._blocks = tuple(model.moe_blocks().values()) if self.executor is not None else ()
        if self.executor is not None:
            self.executor.refresh()
        self.compiled = None
        if self.executor is not None and use_compiled(model, compiled) and compile_blocker(model, recording) is None:
            self.compiled = CompiledForward(self.executor, capacity)
        self.cache = make_cache(len(model.layers)) if self.compiled is None else None

    @property
    def position(self) -> int:
        return self.compiled.position if self.compiled is not None else self.cache[0].offset

    def state(self) -> tuple:
        """What a built step depends on besides its tokens: the model's kernel settings and the interventions."""
        if self.executor is None:
            return ()
        return (self.executor.settings, *(b.intervention for b in self._blocks))

    def build(self, tokens: mx.array, record: Record | None = None, settings: KernelSettings | None = None,
              every_position: bool = False) -> Step:
        """Build the forward over `tokens` [n] and the choice of the next token, and schedule both. `record`
        (eager only) receives the internals; `every_position`: logits of every position [n, V] (else the
        last's [V]); `settings`: this step's kernel settings instead of the model's."""
        settings = settings or (self.executor.settings if self.executor is not None else None)
        position = self.position
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
        return Step(token, checked, logits, plan, tokens.size, position, key_before, history_before)

    def take(self, step: Step, count: bool = True) -> int:
        """The step's token id, once it is evaluated; the step is counted as run (unless `count` is False: the
        caller counts it, Session.count). Logits that hold NaN or Inf are a NonFiniteError, never a token."""
        try:
            tid = step.checked.item()
        except RuntimeError as e:  # an allocation the device could not make (cudaMallocAsync, metal::malloc)
            if "memory" not in str(e).lower() and "malloc" not in str(e).lower():
                raise
            raise DeviceMemoryError(f"the decode step at position {step.position} ran out of device memory: {e}") from e
        if tid == step.logits.shape[-1]:
            raise NonFiniteError(f"the logits at position {step.position + step.tokens - 1} hold NaN or Inf, so no "
                                 "token is chosen from them (moebench.checkpoint.weights.nonfinite_weights(model) "
                                 "names weights that hold them)")
        if count:
            self.count(step)
        return tid

    def count(self, step: Step) -> None:
        """Count a taken step in the model's dispatch counts."""
        if step.plan is not None:
            self.executor.count(step.plan)

    def rollback(self, step: Step) -> None:
        """Undo the last built step, which will not be taken: the cache position, the sampling key and the
        token history."""
        if self.compiled is not None:
            self.compiled.rewind(step.tokens)
        else:
            for c in self.cache:
                c.offset -= step.tokens
        self.key, self.history = step.key_before, step.history_before


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
    under the old ones are rolled back and built again.

    `compiled` (default: use_compiled) decodes through one mx.compile'd step over a static cache
    (moebench.decode.compiled) unless an intervention is set, which runs eagerly. Every argument is checked
    before MLX is asked for anything, the length and memory too (check_length).
    """
    prompt_ids = check_prompt(model, prompt_ids)
    max_tokens, ahead = check_count("max_tokens", max_tokens), check_count("ahead", ahead)
    stop_ids = check_stop_ids(stop_ids)
    check_length(model, len(prompt_ids), len(prompt_ids) + max_tokens - 1)
    session = Session(model, sampling, compiled, len(prompt_ids) + max_tokens)
    state = session.state()
    queued = deque([session.build(mx.array(prompt_ids, dtype=mx.uint32))])
    tid = None
    for n in range(max_tokens):
        if n and session.state() != state:  # the caller changed the switch or an intervention since the last token
            state = _rebuild(session, queued, tid)
        # Queue the next steps before reading this one: the first token leaves after one (as before it),
        # later ones after `ahead`, so the host is building step n + ahead while the device runs n + 1.
        while len(queued) <= min(ahead, n + 1) and n + len(queued) < max_tokens:
            queued.append(session.build(queued[-1].token.reshape(1).astype(mx.uint32)))
        step = queued.popleft()
        tid = session.take(step)
        yield tid, step.logits
        if tid in stop_ids:
            return


def _rebuild(session: Session, queued: deque[Step], last: int) -> tuple:
    """Roll back the queued steps (built under the old settings or interventions) and build the next from `last`,
    the token read last; the state it was built under. A compiled decode cannot take an intervention."""
    if session.compiled is not None and (blocker := compile_blocker(session.model, False)) is not None:
        raise DecodeError(f"{blocker} during a compiled decode; set it before the decode starts, or decode with "
                          "compiled=False")
    while queued:
        session.rollback(queued.pop())
    queued.append(session.build(mx.array([last], dtype=mx.uint32)))
    return session.state()


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
