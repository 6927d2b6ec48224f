"""The one place that decides how a forward call of a model runs, runs it, and counts what ran.

Each model gets one Executor (`executor(model)`), holding its kernel settings (KernelSettings, from the
environment when first asked for), the arrays its kernels read (execution.steps.LayerWeights), the
plans decided so far (one per settings, backend, shape class and where interventions are set) and the
count of every decision taken. The decode loops (moebench.decode) build their steps with `forward`,
the compiled step traces it, and each counts a step once it is taken (`count`): nothing is counted
twice, nothing taken back.

The user-facing switch: `set_fused_moe(on)` / `with fused_moe(on):` for one model (`model=`) or, without
one, for every model of this process and the ones opened later; it covers every fused decode kernel.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import mlx.core as mx
from mlx.utils import tree_flatten

from ..models.declare import LinearAttentionSpec
from ..models.hooks import Record, layer_scope
from ..models.run import feed_forward_norm, token_mixer
from ..models.sharding import attention_note, block_note
from . import support
from .kernel import GPU_BACKENDS, available_backend
from .plan import SWITCHED_OFF, Counts, Decision, Launches, LayerPlan, Plan, Shape, tokens_decision
from .settings import KernelSettings, parse_switch
from .steps import (
    AttentionKernel,
    LayerWeights,
    LinearAttentionKernel,
    MoeKernel,
    attention_step_note,
    attention_step_reason,
    moe_note,
)

# Prompt tokens a forward call runs through the layers at once (mlx-lm's prefill step): a longer prompt runs in
# chunks, so its activations (attention scores above all) take the memory of one chunk, not of the whole prompt.
PREFILL_CHUNK = 2048
_process: dict[str, bool] = {}  # what set_fused_moe() without a model set, for every model
_making = threading.Lock()  # one Executor a model, whichever thread asks first
_executors: dict[int, Executor] = {}  # by id(model); an entry leaves when its model is freed (weakref.finalize)


def default_settings() -> KernelSettings:
    """The environment's settings, with what set_fused_moe() set for every model."""
    return replace(KernelSettings.from_env(), **_process)


class Executor:
    """How `model`'s forward calls run (see the module docstring)."""

    def __init__(self, model, settings: KernelSettings | None = None):
        self._model = weakref.ref(model)  # nothing here holds the model: `del model` frees it, and its executor
        self.settings = settings or default_settings()
        blocks = model.moe_blocks()
        self.weights = [LayerWeights(layer, blocks.get(i)) for i, layer in enumerate(model.layers)]
        self.blocks, self.moe_layers = list(blocks.values()), list(blocks)
        self.taken: Counter[Plan] = Counter()  # steps taken, by the plan they ran
        self.last: Plan | None = None  # the plan of the step taken last
        self.last_decode: Plan | None = None  # the plan of the decode step (one token) taken last
        self._plans: dict[tuple, Plan] = {}
        self.compiled: dict[tuple, object] = {}  # traced steps per plan (moebench.decode.compiled)
        self._fingerprint = self._weights_fingerprint()
        self.lock = threading.RLock()  # held while a decode step of this model is built or read (decode.loop)

    @property
    def model(self):
        return self._model()

    # -- plans -------------------------------------------------------------------------------------
    def _weights_fingerprint(self) -> tuple[int, ...]:
        return tuple(id(a) for _, a in tree_flatten(self.model.parameters()))

    def refresh(self) -> None:
        """Drop the plans (and traced steps) when a weight array was replaced since they were made: what a
        kernel can run depends on how the weights are stored. Called when a decode starts."""
        fingerprint = self._weights_fingerprint()
        if fingerprint != self._fingerprint:
            self._plans.clear()
            self.compiled.clear()
            self._fingerprint = fingerprint

    def plan(self, tokens: int, cache: list, settings: KernelSettings | None = None) -> Plan:
        """The plan of a forward call over `tokens` tokens continuing `cache` (a list of layer caches)."""
        return self.plan_for(tokens, cache[0].static, settings)

    def plan_for(self, tokens: int, static: bool, settings: KernelSettings | None = None) -> Plan:
        """The plan of a forward call over `tokens` tokens whose cache is a compiled step's static one or not.
        Looked up at every step, so the key is a few cheap values: the settings, the backend, the shape class
        and the interventions set on the blocks (a traced step holds its plan's interventions, so each gets its
        own plan)."""
        settings = settings or self.settings
        interventions = self.interventions()
        key = (settings, available_backend(), tokens, static, interventions)
        plan = self._plans.get(key)
        if plan is None:
            if tokens > 1 and sum(k[2] > 1 for k in self._plans) >= 8:  # prefill plans: a few lengths kept
                self._plans = {k: p for k, p in self._plans.items() if k[2] == 1}
            shape, set_on = Shape(tokens, static), dict(zip(self.moe_layers, interventions, strict=True))
            reasons = [self._attention_reason(i, shape, settings) for i in range(len(self.model.layers))]
            by_ops = [i for i, r in enumerate(reasons) if r is not None and not self._linear(i)]
            plan = self._plans[key] = Plan(key, tuple(self._layer_plan(i, shape, settings, key[1], set_on.get(i),
                                                                       reasons[i], by_ops)
                                                      for i in range(len(self.model.layers))), shape)
        return plan

    def interventions(self) -> tuple:
        """The intervention set on each MoE block (None where none is): the one place they are gathered."""
        return tuple(b.intervention for b in self.blocks)

    def _linear(self, i: int) -> bool:
        return isinstance(token_mixer(self.model.layers[i]).spec, LinearAttentionSpec)

    def _attention_reason(self, i: int, shape: Shape, settings: KernelSettings) -> str | None:
        """Why layer `i`'s token mixing runs as MLX ops in a call of `shape` under `settings`, or None."""
        base = _base_decision(shape, settings)
        reason = base.reason if base else attention_step_reason(token_mixer(self.model.layers[i]), self.weights[i])
        if reason is None and not settings.attention_kernel:
            reason = f"the {'gated delta' if self._linear(i) else 'attention'} kernel switched off " \
                     "(KernelSettings.attention_kernel)"
        return reason

    def _layer_plan(self, i: int, shape: Shape, settings: KernelSettings, backend: str, intervention: object,
                    reason: str | None, by_ops: list[int]) -> LayerPlan:
        """Layer `i`'s plan; `intervention`: the one set on its MoE block (from the plan's key), or None; `reason`:
        why its token mixing runs as MLX ops (_attention_reason), or None; `by_ops`: the attention layers whose
        token mixing does. A static cache is written in place by the kernels only when no attention layer's is
        (the others' whole-buffer update would race the in-place writes)."""
        mixer, weights, linear = token_mixer(self.model.layers[i]), self.weights[i], self._linear(i)
        dtype, in_place = self.model.dtype, shape.static and not by_ops
        attention_step = None if reason else self._attention_step(mixer, weights, backend, in_place, dtype)
        # a linear layer's notes: none either way (the shard report names the linear heads a rank holds)
        note = None if linear else attention_note(mixer) if reason else \
            attention_step_note(mixer, attention_step, by_ops if shape.static else [])
        attn = Decision("fallback", reason, note) if reason else Decision(backend, note=note)
        attn_launches = attention_step.launches(in_place, dtype) if attn.fused else \
            Launches(None, f"attention by MLX ops: {attn.reason}")
        block = weights.block
        if block is None:
            launches = attn_launches + Launches(None, "a dense MLP by its module's MLX ops")
            return LayerPlan(attn, None, launches, attention_step)
        experts = block.parts().experts.quantized_parts()
        base = _base_decision(shape, settings)
        reason = base.reason if base else support.moe_reason(block.spec, experts, backend, settings.max_dff)
        if reason:
            launches = attn_launches + Launches(None, f"MoE block by MLX ops: {reason}")
            return LayerPlan(attn, Decision("fallback", reason, block_note(block)), launches, attention_step)
        moe_step = MoeKernel(block, weights, backend, settings.rows, intervention,
                             feed_forward_norm(self.model.layers[i]), dtype)
        note = moe_note(block, weights, moe_step.router_note)
        return LayerPlan(attn, Decision(backend, note=note), attn_launches + moe_step.launches(dtype),
                         attention_step, moe_step)

    @staticmethod
    def _attention_step(mixer, weights: LayerWeights, backend: str, in_place: bool,
                        dtype: mx.Dtype) -> AttentionKernel | LinearAttentionKernel:
        """The kernel step of a token mixing the plan fused: the gated delta step for a linear-attention layer,
        the decode-attention kernel (writing a static cache in place on a GPU where `in_place`) for an attention
        layer."""
        if isinstance(mixer.spec, LinearAttentionSpec):
            return LinearAttentionKernel(mixer, backend)
        return AttentionKernel(mixer, weights, backend, in_place and backend in GPU_BACKENDS, dtype)

    # -- running and counting ----------------------------------------------------------------------
    def forward(self, tokens: mx.array, cache: list, plan: Plan, record: Record | None = None,
                every_position: bool = False) -> mx.array:
        """Next-token logits [B, vocab] after `tokens` [B, L] continuing `cache` ([B, L, vocab] of every
        position with `every_position`), each layer as `plan` says; with `record`, the internals of every
        position (moebench.models.hooks) and each layer's decisions."""
        m = self.model
        if record is None and not every_position and not cache[0].static:
            while tokens.shape[1] > PREFILL_CHUNK:  # a long prompt a chunk at a time, each evaluated before the next
                m.model(tokens[:, :PREFILL_CHUNK], cache, None, plan.layers)
                mx.eval([c.state for c in cache])
                tokens = tokens[:, PREFILL_CHUNK:]
        h = m.model(tokens, cache, record, plan.layers)
        if record is not None:
            for i, layer_plan in enumerate(plan.layers):
                layer_plan.record(record.scope(layer_scope(i)))
        return m.unembed(h if every_position else h[:, -1])

    def count(self, plan: Plan) -> None:
        """Count one forward call that ran `plan` (a decode loop calls it once per step it takes): one tally a
        step, spread over the layers' decisions only when the counts are read."""
        self.taken[plan] += 1
        self.last = plan
        if plan.shape.tokens == 1:
            self.last_decode = plan

    def reset_counts(self) -> None:
        self.taken.clear()
        self.last = self.last_decode = None

    def counts(self) -> tuple[dict[int, Counts], dict[int, Counts]]:
        """({layer: its attention's Counts}, {MoE layer: its block's Counts}) of the steps taken."""
        attention = {i: Counts() for i in range(len(self.weights))}
        moe_layers = {i: Counts() for i in self.moe_layers}
        for plan, n in self.taken.items():
            for i, layer_plan in enumerate(plan.layers):
                attention[i].add(layer_plan.attention, n)
                if layer_plan.moe is not None:
                    moe_layers[i].add(layer_plan.moe, n)
        return attention, moe_layers

    def launches(self) -> dict | None:
        """What the last decode step taken launches a layer on the GPU path (Plan.launches), or None before one."""
        return self.last_decode.launches() if self.last_decode is not None else None

    def dispatch(self) -> dict:
        """Per layer, what ran: {'moe': {layer: counts}, 'attention': {layer: counts}} (Counts.as_dict), and
        'launches': what the last decode step launches a layer on the GPU path (Executor.launches)."""
        attention, moe_layers = self.counts()
        return {"moe": {i: c.as_dict() for i, c in moe_layers.items()},
                "attention": {i: c.as_dict() for i, c in attention.items()}, "launches": self.launches()}

    def summary(self) -> dict:
        """The counts summed over layers: MoE fused runs per backend, fallbacks, decline reasons and notes, the
        same of the attention layers under 'attention', and under 'launches' the last decode step's launches a
        layer on the GPU path (Plan.launches without the per-layer names)."""
        attention, moe_layers = self.counts()
        launches = self.launches()
        return {"moe_layers": len(self.blocks), **_summed(moe_layers.values()),
                "attention": {"layers": len(attention), **_summed(attention.values())},
                "launches": None if launches is None else {k: v for k, v in launches.items() if k != "layers"}}


def _base_decision(shape: Shape, settings: KernelSettings) -> Decision | None:
    """The fallback every layer of a call takes whatever it declares (a prompt of several tokens, the switch off),
    or None."""
    return tokens_decision(shape.tokens) if shape.tokens != 1 else None if settings.fused else SWITCHED_OFF


def _summed(counts) -> dict:
    total = Counts()
    for c in counts:
        total.fused.update(c.fused)
        total.reasons.update(c.reasons)
        total.notes.update(c.notes)
    return total.as_dict()


def executor(model) -> Executor:
    """The model's Executor, made on first use (once, when several threads ask at the same time)."""
    ex = _executors.get(id(model))
    if ex is None:
        with _making:
            ex = _executors.get(id(model))
            if ex is None:
                ex = _executors[id(model)] = Executor(model)
                weakref.finalize(model, _executors.pop, id(model), None)
    return ex


def _every_executor() -> list[Executor]:
    """The executors of every model alive now."""
    return list(_executors.values())


def dispatch(model) -> dict:
    """What ran in `model`'s forward calls so far, per layer (Executor.dispatch)."""
    return executor(model).dispatch()


# -- the user-facing switch --------------------------------------------------------------------------
def fused_moe_enabled(model=None) -> bool:
    """Whether the fused decode kernels are on for `model` (or, without one, for every model)."""
    return executor(model).settings.fused if model is not None else default_settings().fused


def set_fused_moe(enabled: object, model=None) -> None:
    """Switch the fused decode kernels on or off from the next forward call on: for `model`, or without one
    for every model of this process and those opened later. `enabled`: a bool or one of the words
    MOEBENCH_FUSED_MOE takes ('on', 'off', ...); anything else is a ConfigError."""
    on = parse_switch(enabled, "set_fused_moe")
    if model is None:
        _process["fused"] = on
        targets = _every_executor()
    else:
        targets = [executor(model)]
    for ex in targets:
        ex.settings = replace(ex.settings, fused=on)


@contextmanager
def fused_moe(enabled: object, model=None) -> Iterator[None]:
    """Run a block of code with the fused kernels switched on or off (see set_fused_moe), then restore
    exactly the settings there were."""
    on = parse_switch(enabled, "fused_moe")
    before_process = dict(_process)
    before = {ex: ex.settings for ex in ([executor(model)] if model is not None else _every_executor())}
    set_fused_moe(on, model)
    try:
        yield
    finally:
        _process.clear()
        _process.update(before_process)
        for ex, settings in before.items():
            ex.settings = settings
