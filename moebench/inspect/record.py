"""Step-wise decoding with recorded internals: the engine behind the notebooks.

    stepper = Stepper(model, tokenizer, "def add(a, b):", record=True)
    for step in stepper: ...                  # prompt records, then one record per generated token
    trace = Stepper(model, tokenizer, ids).run(16)   # the synchronous twin, for scripts and CI

What a record holds is what the forward pass computed: the forward hands its internals to a Recorder
(names from moebench.models.hooks) while the graph is built, and they are evaluated together with the
logits, never recomputed. With recording off the forward does no extra work.

The stepper decodes in a moebench.decode.loop.Session and builds step n+1 while step n evaluates.
Changes a caller makes between tokens (fused switch, interventions, `record`) still apply to the very
next token: the speculative step remembers the state it was built under and is rolled back (cache
position, sampling key; it was never counted) and rebuilt when that state changed or the caller feeds a
different token.

A call that fails (an error, a KeyboardInterrupt) leaves the stepper at its last whole step: the cache
position, sampling key, token history, trace and counts are put back, the step it was building is
dropped, and the next call continues from there as if the failed one had not run. (One window stays: an
interrupt landing in the few lines between counting a finished step and marking it whole counts that
step twice in moebench.dispatch; tokens and records are right either way.)
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields, replace
from numbers import Integral
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..checkpoint.chat import prompt_ids as chat_prompt_ids
from ..checkpoint.tokenizer import stop_ids as default_stop_ids
from ..decode.loop import GenerationResult, Mark, Session, Step, check_length, check_prompt, check_stop_ids
from ..decode.sampling import Sampling
from ..errors import DecodeError, MoebenchError
from ..execution.plan import Decision
from ..execution.settings import KernelSettings
from ..models import hooks
from ..models.routing import Intervention
from .routing_files import unbiased_top


class Recorder:
    """Collects the named internals of one forward pass (the models' Record): `values` by full hook name."""

    def __init__(self, values: dict[str, object] | None = None, prefix: str = "") -> None:
        self.values = {} if values is None else values
        self._prefix = prefix

    def __call__(self, name: str, value: object) -> None:
        self.values[self._prefix + name] = value

    def scope(self, child: str) -> Recorder:
        return Recorder(self.values, f"{self._prefix}{child}.")

    def arrays(self) -> list[mx.array]:
        return [v for v in self.values.values() if isinstance(v, mx.array)]


def _numpy(value: mx.array | None) -> np.ndarray | None:
    if value is None:
        return None
    if mx.issubdtype(value.dtype, mx.floating) and value.dtype != mx.float32:
        value = value.astype(mx.float32)  # numpy has no bfloat16; the upcast is exact
    return np.array(value)


# -- summaries: every record's repr is a few lines whatever the decode's length, the data one attribute away --
MAX_LISTED = 8  # experts, layer spans or path kinds a summary lists before it says how many more


def clip(text: str, width: int) -> str:
    """`text` cut after `width` characters, the cut marked."""
    return text if len(text) <= width else text[:width] + "..."


def short_text(text: str, width: int = 24) -> str:
    """A token or a text as Python writes it (whitespace visible), cut after `width` characters."""
    return repr(text[:width]) + ("..." if len(text) > width else "")


def token_label(token_id: int, text: str | None) -> str:
    """A token as its text and id ("' a' (263)"), the id alone without a tokenizer."""
    return str(token_id) if text is None else f"{short_text(text)} ({token_id})"


def span_text(indices: Iterable[int]) -> str:
    """Sorted integers as runs ("0-3, 5, 7-9"), the first MAX_LISTED runs and how many more."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:MAX_LISTED])
    return text + (f", ... ({len(runs) - MAX_LISTED} more runs)" if len(runs) > MAX_LISTED else "")


def decision_text(decision: Decision | None) -> str:
    """A path as a reader wants it: the backend, or fallback and why (its note left to the caller)."""
    if decision is None:
        return "none"
    return decision.path + (f" ({clip(decision.reason, 60)})" if decision.reason else "")


def intervention_text(pairs: Iterable[tuple[int, Intervention]]) -> str:
    """(layer, intervention) pairs grouped by intervention, each with its layers and the fields it changes."""
    groups: dict[Intervention, set[int]] = {}
    for layer, intervention in pairs:
        groups.setdefault(intervention, set()).add(layer)
    if not groups:
        return "none"
    parts = []
    for intervention, layers in list(groups.items())[:MAX_LISTED]:
        changed = ", ".join(f"{f.name}={getattr(intervention, f.name)!r}" for f in fields(intervention)
                            if getattr(intervention, f.name) != f.default) or "no change"
        parts.append(f"layers {span_text(layers)}: {clip(changed, 80)}")
    more = f"; ... ({len(groups) - MAX_LISTED} more)" if len(groups) > MAX_LISTED else ""
    return "; ".join(parts) + more


def path_counts(decisions: Iterable[Decision]) -> str:
    """How often each path ran, most frequent first ("reference x64, fallback (2 tokens ...) x8")."""
    counts = Counter(decision_text(d) for d in decisions)
    text = ", ".join(f"{path} x{n}" for path, n in counts.most_common(MAX_LISTED // 2))
    return text + (f", {len(counts) - MAX_LISTED // 2} other kinds" if len(counts) > MAX_LISTED // 2 else "")


@dataclass
class LayerRecord:
    """One MoE layer at one token position. Fields are named after the hook names (moebench.models.hooks).

    topk_ids, topk_scores and expert_out are ordered by score, highest first (the router itself
    returns them unordered). expert_out is each selected expert's own output before weighting,
    float32 on the fused path and the activation dtype (upcast here) on the fallback. shared_out and
    shared_gate are None when the layer has no shared expert or an intervention switched it off.

    The token mixing (recorded by the hybrids, None elsewhere): mixer_kind is 'linear_attention' or
    'full_attention'; a linear layer's decay and beta per value head [Hv], and state_norm [Hv], the norm of each
    head's delta state after this token (only a forward call's last position has one: a prompt's earlier positions
    None); output_gate [H, Dh] is silu(z) of a linear layer, sigmoid(gate) of a full-attention layer.
    """

    layer: int
    router_logits: np.ndarray
    router_probs: np.ndarray
    topk_ids: np.ndarray
    topk_scores: np.ndarray
    expert_out: np.ndarray
    routed_out: np.ndarray
    shared_out: np.ndarray | None
    shared_gate: float | None
    block_out: np.ndarray
    resid_pre: np.ndarray
    resid_mid: np.ndarray
    resid_post: np.ndarray
    path: Decision
    attn_path: Decision | None = None  # the layer's attention (kernel or MLX ops); None without a KV cache
    mixer_kind: str | None = None
    decay: np.ndarray | None = None
    beta: np.ndarray | None = None
    state_norm: np.ndarray | None = None
    output_gate: np.ndarray | None = None
    choice_scores: np.ndarray | None = None  # a selection-biased router's (hooks.CHOICE_SCORES), None elsewhere

    def selection_bias_effect(self) -> tuple[list[int], list[int]] | None:
        """(the chosen experts the router's selection bias alone put in, the experts it kept out of the top-k) against
        what the router would choose without it (routing_files.unbiased_top), or None for a router without one."""
        if self.choice_scores is None:
            return None
        chosen = set(self.topk_ids.tolist())
        unbiased = set(unbiased_top(self.router_probs, self.choice_scores, len(chosen)).tolist())
        return sorted(chosen - unbiased), sorted(unbiased - chosen)

    @property
    def output_gate_means(self) -> np.ndarray | None:
        """The output gate averaged over each head's dimensions [H] (None where nothing was recorded)."""
        return None if self.output_gate is None else self.output_gate.mean(axis=-1)

    @property
    def resid_mid_norm(self) -> float:
        """L2 norm of the residual stream entering the MoE block."""
        return float(np.linalg.norm(self.resid_mid))

    @property
    def resid_post_norm(self) -> float:
        """L2 norm of the residual stream leaving the MoE block (and the layer)."""
        return float(np.linalg.norm(self.resid_post))

    def __repr__(self) -> str:
        """A summary: the routing and the norms, not the vectors (the fields hold those)."""
        experts = ", ".join(f"{e} {p:.3f}" for e, p in zip(self.topk_ids[:MAX_LISTED].tolist(),
                                                          self.topk_scores[:MAX_LISTED].tolist(), strict=True))
        more = f", ... {len(self.topk_ids) - MAX_LISTED} more" if len(self.topk_ids) > MAX_LISTED else ""
        gate = "none" if self.shared_gate is None else f"{self.shared_gate:.3f}"
        notes = [f"  {what} note: {clip(d.note, 100)}"
                 for what, d in (("MoE", self.path), ("attention", self.attn_path)) if d is not None and d.note]
        kind = "" if self.mixer_kind is None else f" ({mixer_text(self.mixer_kind)})"
        return "\n".join([
            f"LayerRecord: MoE layer {self.layer}{kind}, path {decision_text(self.path)}"
            f" (attention {decision_text(self.attn_path)})",
            *notes,
            *self._mixing_lines(),
            f"  top-{len(self.topk_ids)} of {len(self.router_probs)} experts (id score): {experts}{more};"
            f" shared gate {gate}",
            *self._selection_bias_lines(),
            f"  residual norm {self.resid_mid_norm:.4g} into the MoE block, {self.resid_post_norm:.4g} out;"
            f" block output norm {float(np.linalg.norm(self.block_out)):.4g}",
            f"  data: .router_probs {list(self.router_probs.shape)}, .expert_out {list(self.expert_out.shape)},"
            f" .resid_post {list(self.resid_post.shape)}, ... (named as the hooks)",
        ])

    def _selection_bias_lines(self) -> list[str]:
        """What a selection-biased router's bias alone changed in the top-k (nothing for other routers)."""
        effect = self.selection_bias_effect()
        if effect is None:
            return []
        put_in, kept_out = (", ".join(map(str, ids)) or "none" for ids in effect)
        return [f"  its selection bias alone put in {put_in}; kept out {kept_out}"]

    def _mixing_lines(self) -> list[str]:
        """The token mixing's recorded values as ranges over the heads (none for a family that records none)."""
        parts = [f"{name} {value_range(v)}" for name, v in (
            ("decay", self.decay), ("beta", self.beta), ("state norm", self.state_norm),
            ("output gate (head means)", self.output_gate_means)) if v is not None]
        return [f"  {mixer_text(self.mixer_kind)} per head (min-max): " + ", ".join(parts)] if parts else []


def mixer_text(kind: str | None) -> str:
    """'linear_attention' -> 'linear attention' (None: the one kind other families have)."""
    return "attention" if kind is None else kind.replace("_", " ")


def value_range(values: np.ndarray) -> str:
    """'min-max' of `values`, three significant digits each."""
    return f"{float(values.min()):.3g}-{float(values.max()):.3g}"


class Candidate(NamedTuple):
    token_id: int
    text: str | None
    prob: float


@dataclass
class StepRecord:
    """One token position of a decode.

    The internals (`layers`) are those computed on `input_id` at `position`; `candidates` and
    `token_id` are this position's prediction. Prompt positions before the last have token_id None
    (the next prompt token follows, not a choice). `seconds` is the time spent inside the call that
    produced the record: the whole prefill for prompt records, one step for decode records.
    """

    index: int
    phase: str
    position: int
    input_id: int
    input_text: str | None
    token_id: int | None
    token_text: str | None
    candidates: list[Candidate]
    seconds: float
    fused_switch: bool
    interventions: dict[int, Intervention]
    layers: dict[int, LayerRecord] = field(default_factory=dict)
    logits: np.ndarray | None = None

    def __repr__(self) -> str:
        """A summary: the token fed and chosen, the candidates, what ran; the layers stay in .layers."""
        chose = ("the next prompt token follows" if self.token_id is None
                 else f"chose {token_label(self.token_id, self.token_text)}")
        seconds = f"{self.seconds * 1e3:.1f} ms" + (" (the whole prompt)" if self.phase == "prefill" else "")
        candidates = ", ".join(f"{c.token_id if c.text is None else short_text(c.text, 12)} {c.prob:.3f}"
                               for c in self.candidates[:MAX_LISTED])
        layers = (f"{len(self.layers)} MoE layers recorded ({span_text(self.layers)}), paths "
                  f"{path_counts(r.path for r in self.layers.values())}" if self.layers
                  else "not recorded (record=False)")
        logits = "" if self.logits is None else f", .logits {list(self.logits.shape)}"
        return "\n".join([
            f"StepRecord {self.index}: {self.phase} at position {self.position}, fed "
            f"{token_label(self.input_id, self.input_text)}, {chose}",
            f"  candidates: {candidates or 'none kept (top=0)'}",
            f"  fused switch {'on' if self.fused_switch else 'off'}, {seconds}; interventions: "
            f"{intervention_text(self.interventions.items())}",
            f"  internals: {layers}",
            f"  data: .layers[layer] (LayerRecord), .candidates{logits}",
        ])


@dataclass
class Trace:
    """Every record of one decode, prompt positions first, with wall-clock timings like decode.generate."""

    prompt_ids: list[int]
    steps: list[StepRecord] = field(default_factory=list)
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    special_ids: frozenset[int] = frozenset()  # the tokenizer's control tokens: in the records, not in `text`

    @property
    def prefill(self) -> list[StepRecord]:
        return [s for s in self.steps if s.phase == "prefill"]

    @property
    def generated(self) -> list[StepRecord]:
        """The records that chose a token: the last prompt position, then every decode step."""
        return [s for s in self.steps if s.token_id is not None]

    @property
    def token_ids(self) -> list[int]:
        return [s.token_id for s in self.generated]

    @property
    def text(self) -> str:
        """The generated text as a reader sees it: control tokens (<|im_end|>, ...) left out."""
        return "".join(s.token_text or "" for s in self.generated if s.token_id not in self.special_ids)

    def result(self) -> GenerationResult:
        """The trace as decode.generate reports a decode, with the same tok/s definitions."""
        return GenerationResult(self.prompt_ids, self.token_ids, self.prompt_seconds, self.decode_seconds)

    @property
    def decode_tps(self) -> float:
        return self.result().decode_tps

    def __repr__(self) -> str:
        """A summary: tokens, text, speed, paths and interventions; the records stay in .steps."""
        generated = self.generated
        head = f"Trace: {len(self.prompt_ids)} prompt tokens, {len(generated)} generated"
        if not self.steps:
            return f"{head} (nothing decoded yet)\n  data: .prompt_ids"
        recorded = [s for s in self.steps if s.layers]
        on = sum(s.fused_switch for s in generated)
        result = self.result()
        if recorded:
            layers = sorted({layer for s in recorded for layer in s.layers})
            internals = (f"  internals: {len(recorded)} of {len(self.steps)} positions recorded, MoE layers "
                         f"{span_text(layers)}; paths (layer x position) "
                         f"{path_counts(r.path for s in recorded for r in s.layers.values())}")
        else:
            internals = "  internals: not recorded (record=False)"
        touched = sum(bool(s.interventions) for s in self.steps)
        return "\n".join([
            head,
            f"  text: {short_text(self.text, 72)}" if any(s.token_text is not None for s in generated)
            else f"  token ids (no tokenizer): {clip(str(self.token_ids), 72)}",
            f"  prefill {self.prompt_seconds * 1e3:.1f} ms ({result.prompt_tps:.1f} tok/s), decode "
            f"{self.decode_seconds * 1e3:.1f} ms ({self.decode_tps:.1f} tok/s); fused switch on for {on} of "
            f"{len(generated)} generated tokens",
            internals,
            f"  interventions: {intervention_text(p for s in self.steps for p in s.interventions.items())}"
            + (f" (on {touched} of {len(self.steps)} positions)" if touched else ""),
            f"  data: .steps ({len(self.steps)} StepRecords; .prefill, .generated), .text, .token_ids, "
            "moebench.inspect.export.to_frames(trace)",
        ])


class _Mark(NamedTuple):
    """A stepper at its last whole step: what a failed call puts back (Stepper._restore)."""

    session: Mark
    steps: int
    generated: int
    first_token_at: float | None
    done: bool
    prompt_seconds: float
    decode_seconds: float


class Stepper:
    """Decode a prompt one token at a time, recording internals when `record` is set.

    prompt: token ids, text (needs the tokenizer), or chat messages ([{'role': ..., 'content': ...}], through the
    checkpoint's chat template; `chat` sends text as one user turn, `system` adds a system message, and
    template variables such as enable_thinking=False pass through). sampling: as decode.generate (greedy
    by default). stop_ids: default the model's eos ids and the tokenizer's end of turn.
    top: how many next-token candidates each record lists. keep_logits: store each record's full
    next-token logits. fused: force the fused kernels on/off for this stepper's forward calls (None
    follows the model's switch, moebench.set_fused_moe). max_tokens: stop after this many generated
    tokens (None: only at a stop id). pipeline: build the next step while the current one evaluates.
    `record`, the fused switch and the blocks' interventions may change between any two steps.
    """

    def __init__(self, model, tokenizer=None, prompt: str | list[int] | list[dict] = "", *, record: bool = False,
                 sampling: Sampling | None = None, top: int = 5, keep_logits: bool = False,
                 fused: bool | None = None, max_tokens: int | None = None,
                 stop_ids: tuple[int, ...] | None = None, pipeline: bool = True, chat: bool = False,
                 system: str | None = None, **template_variables):
        prompt_ids = check_prompt(model, chat_prompt_ids(prompt, tokenizer, chat=chat, system=system,
                                                         **template_variables))
        vocab = model.args.vocab_size
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= vocab:
            raise DecodeError(f"top must be an integer between 0 and the vocabulary size {vocab}, got {top!r}")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
            raise DecodeError(f"max_tokens must be an integer or None, got {max_tokens!r}")
        if fused is not None and not isinstance(fused, bool):
            raise DecodeError(f"fused must be True, False or None (the model's switch), got {fused!r}")
        positions = len(prompt_ids) + (max_tokens - 1 if max_tokens is not None and max_tokens > 1 else 0)
        check_length(model, len(prompt_ids), positions, every_position=True)
        self.model, self.tokenizer = model, tokenizer
        sampling = Sampling() if sampling is None else sampling
        self.session = Session(model, sampling, compiled=False)
        self.record, self.sampling, self.top, self.keep_logits = record, sampling, top, keep_logits
        self.fused, self.max_tokens, self.pipeline = fused, max_tokens, pipeline
        self.stop_ids = default_stop_ids(model.args.eos_token_id, tokenizer) if stop_ids is None else tuple(
            check_stop_ids(stop_ids))
        self.trace = Trace(prompt_ids, special_ids=tokenizer.special_ids if tokenizer is not None else frozenset())
        self._generated = 0
        self._first_token_at: float | None = None
        self.done = False
        self._mark = self._current_mark()
        self._open = False  # a public call is running, or failed before it finished

    # -- the state a built step depends on -------------------------------------------------------
    def _settings(self) -> KernelSettings:
        settings = self.session.executor.settings
        return settings if self.fused is None or settings.fused == self.fused else replace(settings, fused=self.fused)

    def _state(self) -> tuple:
        return self.session.state(self._settings(), self.record)

    def _text(self, token_id: int) -> str | None:
        """One token as it is, a control token's name included (Trace.text leaves those out)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None else None

    # -- a call either finishes or leaves the stepper at its last whole step ------------------------------
    def _current_mark(self) -> _Mark:
        return _Mark(self.session.mark(), len(self.trace.steps), self._generated, self._first_token_at, self.done,
                     self.trace.prompt_seconds, self.trace.decode_seconds)

    def _settle(self) -> None:
        """Put back the last whole step when the previous call did not finish (a second interrupt during the
        restore of the first leaves it to do)."""
        if self._open:
            self._restore()

    def _end(self, step: Step | None) -> None:
        """Finish a call: count the step it took, and mark the stepper whole there (the mark made first, so that
        only the count and the assignment lie between the two)."""
        mark = self._current_mark()
        if step is not None:
            self.session.count(step)
        self._mark, self._open = mark, False

    def _restore(self) -> None:
        """Back to the last whole step (Session.restore; the steps built ahead are dropped). Idempotent, so an
        interrupt inside it is harmless."""
        m = self._mark
        self.session.restore(m.session)
        del self.trace.steps[m.steps:]
        self._generated, self._first_token_at, self.done = m.generated, m.first_token_at, m.done
        self.trace.prompt_seconds, self.trace.decode_seconds = m.prompt_seconds, m.decode_seconds
        self._open = False

    # -- building and finishing steps -------------------------------------------------------------
    def _build(self, tokens: mx.array, state: tuple) -> Step:
        """One step with recording as `state` says (its last word), its top candidates scheduled beside it."""
        recorder = Recorder() if state[-1] else None
        step = self.session.build(tokens, state, recorder, every_position=True)
        top = None
        if self.top:
            logits = step.logits
            ids = mx.argpartition(-logits, kth=self.top - 1, axis=-1)[:, : self.top]
            picked = mx.take_along_axis(logits, ids, axis=-1).astype(mx.float32)
            top = ids, mx.exp(picked - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True))
        mx.async_eval(*(top or ()), *(recorder.arrays() if recorder is not None else ()))
        step.extras = (top, recorder.values if recorder is not None else None)
        return step

    def _next(self, feed: list[int]) -> Step:
        """The step feeding `feed` through the session's loop (Session.next), one step built ahead when
        pipelining, not past max_tokens or the model's max_position_embeddings."""
        ahead = 1 if self.pipeline else 0
        remaining = self.max_tokens - self._generated if self.max_tokens is not None else ahead + 1  # no bound
        limit = self.model.args.max_position_embeddings
        if limit is not None:
            remaining = min(remaining, 1 + limit - len(self.trace.steps) - len(feed))
        return self.session.next(feed, self._state(), ahead, remaining, self._build)

    def _finish(self, step: Step, inputs: list[int], phase: str) -> list[StepRecord]:
        """Wait for a step and turn what it computed into records, one per input position."""
        token_id = self.session.take(step, count=False)
        top, recorded = step.extras
        start = len(self.trace.steps)
        top_ids = top_probs = None
        if top is not None:
            top_ids, top_probs = top[0].tolist(), top[1].tolist()
        logits = _numpy(step.logits) if self.keep_logits else None
        layers = _layer_records(recorded) if recorded is not None else [{}] * len(inputs)
        settings, interventions = step.state[0], step.state[1]
        interventions = {i: v for i, v in zip(self.session.executor.moe_layers, interventions, strict=True)
                         if v is not None}
        records = []
        for j, input_id in enumerate(inputs):
            last = j == len(inputs) - 1
            candidates = []
            if top_ids is not None:
                ranked = sorted(zip(top_ids[j], top_probs[j], strict=True), key=lambda c: -c[1])
                candidates = [Candidate(t, self._text(t), p) for t, p in ranked]
            records.append(StepRecord(
                index=start + j, phase=phase, position=step.position + j, input_id=input_id,
                input_text=self._text(input_id), token_id=token_id if last else None,
                token_text=self._text(token_id) if last else None, candidates=candidates, seconds=0.0,
                fused_switch=settings.fused, interventions=interventions, layers=layers[j],
                logits=None if logits is None else logits[j],
            ))
        return records

    def _accept(self, records: list[StepRecord]) -> None:
        self.trace.steps.extend(records)
        self._generated += 1
        now = time.perf_counter()
        if self._first_token_at is None:
            self._first_token_at = now
        else:
            self.trace.decode_seconds = now - self._first_token_at
        token = records[-1].token_id
        if token in self.stop_ids or (self.max_tokens is not None and self._generated >= self.max_tokens):
            self.session.drop_queue()
            self.done = True

    # -- the public stepping API -------------------------------------------------------------------
    @property
    def prefilled(self) -> bool:
        return bool(self.trace.steps)

    def prefill(self) -> list[StepRecord]:
        """Run the prompt; one record per prompt token, the last carrying the first generated token."""
        self.session.check_thread()
        self._settle()
        if self.prefilled:
            raise MoebenchError("prefill already ran for this stepper")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise MoebenchError(f"max_tokens must be at least 1, got {self.max_tokens}")
        self._open = True
        try:
            start = time.perf_counter()
            prompt = list(self.trace.prompt_ids)
            step = self._next(prompt)
            records = self._finish(step, prompt, "prefill")
            seconds = time.perf_counter() - start
            for r in records:
                r.seconds = seconds
            self.trace.prompt_seconds = seconds
            self._accept(records)
            self._end(step)
        except BaseException:
            self._restore()
            raise
        return records

    def step(self, feed: int | None = None) -> StepRecord:
        """One decode step: feed the last chosen token (or `feed`, for teacher forcing); return its record."""
        self.session.check_thread()
        self._settle()
        if not self.prefilled:
            raise MoebenchError("call prefill() before step() (iterating the stepper does both)")
        if self.done:
            raise MoebenchError("the decode has finished (stop token or max_tokens); start a new Stepper")
        fed = self.session.last_read if feed is None else feed
        vocab = self.model.args.vocab_size
        if isinstance(fed, bool) or not isinstance(fed, Integral) or not 0 <= fed < vocab:
            raise DecodeError(f"feed token id {fed!r} is not an id of the vocabulary 0..{vocab - 1}")
        fed = int(fed)
        limit = self.model.args.max_position_embeddings
        if limit is not None and len(self.trace.steps) >= limit:
            raise DecodeError(f"the decode holds {len(self.trace.steps)} positions, the model's "
                              f"max_position_embeddings (config.json): it cannot take another token")
        self._open = True
        try:
            start = time.perf_counter()
            step = self._next([fed])
            records = self._finish(step, [fed], "decode")
            records[0].seconds = time.perf_counter() - start
            self._accept(records)
            self._end(step)
        except BaseException:
            self._restore()
            raise
        return records[0]

    def __iter__(self) -> Iterator[StepRecord]:
        """Yield the prompt records, then one record per generated token until a stop id or max_tokens."""
        if not self.prefilled:
            yield from self.prefill()
        while not self.done:
            yield self.step()

    def run(self, n: int) -> Trace:
        """Generate up to n tokens (counting the one prefill chooses) synchronously; returns the trace. The
        positions they take are checked first (check_length), so a run past the model's length never starts."""
        self.session.check_thread()
        self._settle()
        if isinstance(n, bool) or not isinstance(n, Integral) or n < 1:
            raise DecodeError(f"n must be an integer >= 1, got {n!r}")
        if self.done:
            raise MoebenchError(f"the decode has finished ({len(self.trace.generated)} tokens generated, at a stop "
                                "token or max_tokens): its trace is stepper.trace; start a new Stepper to decode again")
        prompt = len(self.trace.prompt_ids)
        fed = len(self.trace.steps) + n if self.prefilled else prompt + n - 1
        check_length(self.model, 1 if self.prefilled else prompt, fed, every_position=not self.prefilled)
        target = self._generated + n
        if self.max_tokens is None or self.max_tokens > target:
            self.max_tokens = target
        if not self.prefilled:
            self.prefill()
        while not self.done:
            self.step()
        return self.trace

    def close(self) -> None:
        """Drop a speculative step and end the decode."""
        self.session.check_thread()
        self._settle()
        self._open = True
        self.session.drop_queue()
        self.done = True
        self._end(None)


def decode(model, tokenizer=None, prompt: str | list[int] = "", n: int = 16, **options) -> Trace:
    """Stepper(model, tokenizer, prompt, **options).run(n): a whole decode in one call."""
    return Stepper(model, tokenizer, prompt, **options).run(n)


def _layer_records(values: dict[str, object]) -> list[dict[int, LayerRecord]]:
    """Split one forward's recorded internals [L, ...] into per-position {layer: LayerRecord}."""
    by_layer: dict[int, dict[str, object]] = {}
    for name, value in values.items():
        layer, hook = hooks.parse(name)
        by_layer.setdefault(layer, {})[hook] = value
    moe = {i: v for i, v in by_layer.items() if hooks.TOPK_IDS in v}
    n = next(iter(moe.values()))[hooks.TOPK_IDS].shape[0] if moe else 0
    out: list[dict[int, LayerRecord]] = [{} for _ in range(n)]
    for layer, v in sorted(moe.items()):
        arrays = {h: _numpy(v.get(h)) for h in hooks.MOE_HOOKS if h != hooks.PATH}
        arrays.update({h: _numpy(v[h]).reshape(n, -1) for h in hooks.RESID_HOOKS})  # [B=1, L, D] -> [L, D]
        order = np.argsort(-arrays[hooks.TOPK_SCORES], axis=-1, kind="stable")
        arrays[hooks.TOPK_IDS] = np.take_along_axis(arrays[hooks.TOPK_IDS].astype(np.int64), order, axis=-1)
        arrays[hooks.TOPK_SCORES] = np.take_along_axis(arrays[hooks.TOPK_SCORES], order, axis=-1)
        arrays[hooks.EXPERT_OUT] = np.take_along_axis(arrays[hooks.EXPERT_OUT], order[..., None], axis=1)
        mixing = {h: _numpy(v.get(h)) for h in hooks.MIXER_HOOKS}
        for j in range(n):
            gate = arrays[hooks.SHARED_GATE]
            out[j][layer] = LayerRecord(
                layer=layer,
                **{h: (None if arrays[h] is None else arrays[h][j]) for h in arrays if h != hooks.SHARED_GATE},
                shared_gate=None if gate is None else float(gate[j, 0]),
                path=v[hooks.PATH],
                attn_path=v.get(hooks.ATTN_PATH),
                mixer_kind=v.get(hooks.MIXER_KIND),
                **_mixing_at(mixing, j, n),
            )
    return out


def _mixing_at(mixing: dict[str, np.ndarray | None], j: int, n: int) -> dict[str, np.ndarray | None]:
    """Position j's token-mixing values of a call of n positions: the state norm (one per call, [B=1, Hv]) only at
    the last."""
    values = {h: None if v is None else v[j] for h, v in mixing.items() if h != hooks.STATE_NORM}
    norm = mixing[hooks.STATE_NORM]
    values[hooks.STATE_NORM] = None if norm is None or j != n - 1 else norm[0]
    return values
