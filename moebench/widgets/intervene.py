"""Interventions as controls: pick a layer (or every MoE layer), experts to force or ablate, top-k, the
shared expert and its gate scale; decode; see the routing, the tokens and the effect beside the baseline.

The effect is measured two ways. Free-running: the intervened decode's tokens next to the baseline's,
differing ones marked. Teacher-forced: the intervened model is fed the baseline's tokens, so every position
compares the same context: KL(baseline || intervened) of the next-token distributions (nats) and the
change in log-probability of the token the baseline chose. Decodes run on the notebook's thread
(mainthread.Owner); interventions are set only for the duration of a decode (interventions.intervene).

Every intervened decode of the current baseline stays listed (a new prompt starts the list over), so the
views show what was run, from the controls or from code, and any earlier result is one pick away; clearing
puts the controls back to no intervention and keeps the list.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import ipywidgets as widgets
import numpy as np
from plotly.subplots import make_subplots

from ..inspect.interventions import intervene
from ..models.routing import Intervention, InterventionError
from .figure import LiveFigure
from .mainthread import Owner
from .router import RouterView
from .static import live_mark, show
from .text import error_html, visible

EVERY_LAYER = -1  # the layer picker's value for "every MoE layer" (a Dropdown shows None as no choice)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def effect(baseline, forced) -> dict[str, np.ndarray]:
    """Per generated position: KL(baseline || intervened) in nats and the change in log-probability of the
    baseline's token; `forced` is the intervened decode fed the baseline's tokens (both with logits)."""
    base = np.stack([s.logits for s in baseline.generated])
    other = np.stack([s.logits for s in forced.generated[: len(base)]])
    p, q = log_softmax(base), log_softmax(other)
    kl = (np.exp(p) * (p - q)).sum(axis=-1)
    ids = np.array(baseline.token_ids)
    rows = np.arange(len(ids))
    return {"kl": np.maximum(kl, 0.0), "dlogp": q[rows, ids] - p[rows, ids]}


def token_diff(baseline, other) -> str:
    """Both decodes' tokens as chips, position by position; where the intervened token differs it is red."""
    def chips(trace, against):
        out = []
        for i, s in enumerate(trace.generated):
            same = i < len(against.generated) and against.generated[i].token_id == s.token_id
            style = "background:#e3f2fd" if same else "background:#ffcdd2;outline:1px solid #b71c1c"
            out.append(f"<span style='{style};padding:0 2px;margin:1px;border-radius:3px;display:inline-block;"
                       f"font-family:monospace'>{html.escape(visible(s.token_text))}</span>")
        return "".join(out)

    same = sum(a.token_id == b.token_id for a, b in zip(baseline.generated, other.generated, strict=False))
    first = next((i for i, (a, b) in enumerate(zip(baseline.generated, other.generated, strict=False))
                  if a.token_id != b.token_id), None)
    where = "identical tokens" if first is None else f"first differs at generated token {first}"
    return (f"<div class='moebench-token-diff' style='font-size:13px'><b>tokens</b>: {same} of "
            f"{len(baseline.generated)} the same, {where} (glyphs: \u00b7 space, \u23ce newline)<br>"
            f"baseline:&nbsp;&nbsp;&nbsp;{chips(baseline, other)}<br>intervened: {chips(other, baseline)}</div>")


def describe(intervention: Intervention, where: str) -> str:
    """The intervention's changes from the default, in a few words: 'ablate 47 on every MoE layer'."""
    parts = []
    if intervention.force_experts is not None:
        parts.append("force " + ", ".join(map(str, intervention.force_experts)))
    if intervention.ablate:
        parts.append("ablate " + ", ".join(map(str, intervention.ablate))
                     + (" (renormalized)" if intervention.renormalize_ablation else ""))
    if intervention.top_k is not None:
        parts.append(f"top-{intervention.top_k}")
    if not intervention.shared_expert:
        parts.append("shared expert off")
    elif intervention.shared_gate_scale != 1.0:
        parts.append(f"shared gate x{intervention.shared_gate_scale:g}")
    return f"{'; '.join(parts) or 'no change'} on {where}"


@dataclass(frozen=True)
class Result:
    """One intervened decode of the baseline: free-running, fed the baseline's tokens, and its effect."""

    label: str
    summary: str
    intervened: object
    forced: object
    measured: dict[str, np.ndarray]


class InterventionPanel:
    """Controls for one Intervention, the routing before/after, the token diff and the per-token effect."""

    def __init__(self, controls):
        self.controls = controls
        self.owner = Owner(on_error=self._failed)
        self.baseline = None
        self.results: list[Result] = []  # every intervened decode of this baseline, oldest first
        self.summary = ""  # the last result in words (the status line shows it)
        self.layer = widgets.Dropdown(description="layer")
        self.force = widgets.IntsInput(value=[], min=0, placeholder="expert id, then Enter",
                                       layout=widgets.Layout(min_width="420px"))
        self.ablate = widgets.IntsInput(value=[], min=0, placeholder="expert id, then Enter",
                                        layout=widgets.Layout(min_width="420px"))
        self.hint = widgets.HTML()
        self.renormalize = widgets.Checkbox(value=False, description="renormalize over the experts left", indent=False)
        self.top_k = widgets.IntSlider(min=1, description="top-k")
        self.model = None
        self.shared = widgets.Checkbox(value=True, description="shared expert on", indent=False)
        self.gate_scale = widgets.FloatSlider(value=1.0, min=0.0, max=3.0, step=0.05, description="gate scale",
                                              readout_format=".2f")
        self.apply = widgets.Button(description="decode with it", icon="play", button_style="primary")
        self.apply.add_class("moebench-intervene-run")
        self.apply.on_click(lambda _: self.owner.submit(self.run))
        self.reset = widgets.Button(description="clear", icon="undo", tooltip="back to the baseline: no intervention")
        self.reset.on_click(lambda _: self.owner.submit(self.clear))
        self.shown = widgets.Dropdown(description="result", options=[], layout=widgets.Layout(width="640px"))
        self.shown.add_class("moebench-intervene-result")
        self._listing = False  # True while the picker's options are refilled: no redraw per option
        self.shown.observe(lambda _: None if self._listing else self._draw(), names="value")
        self.step = widgets.IntSlider(value=0, min=0, max=0, description="token", continuous_update=False)
        self.step.observe(lambda _: self._draw_routing(), names="value")
        self.status = widgets.HTML()
        self.status.add_class("moebench-intervene-status")
        self.diff = widgets.HTML()
        self.before = RouterView(title="baseline: ")
        self.after = RouterView(title="intervened: ")
        self.figure = LiveFigure(make_subplots(specs=[[{"secondary_y": True}]]))
        self.figure.add_bar(x=[], y=[], name="KL(baseline || intervened), nats", marker_color="#6a51a3")
        self.figure.add_scatter(x=[], y=[], mode="lines+markers", name="change in log p of the baseline's token",
                                line={"color": "#d94801"}, secondary_y=True)
        self.figure.update_layout(title={"text": "effect per generated token (teacher-forced on the baseline's "
                                                 "tokens)", "x": 0}, height=340, legend={"orientation": "h", "y": -0.3},
                                  margin={"l": 60, "r": 60, "t": 60, "b": 60}, modebar={"orientation": "v"})
        self.figure.update_xaxes(title_text="generated token")
        self.figure.update_yaxes(title_text="KL (nats)", rangemode="tozero", secondary_y=False)
        self.figure.update_yaxes(title_text="change in log p (nats)", secondary_y=True)
        labelled = [widgets.HBox([widgets.Label("force experts", layout=widgets.Layout(width="110px")), self.force]),
                    widgets.HBox([widgets.Label("ablate experts", layout=widgets.Layout(width="110px")), self.ablate]),
                    self.hint]
        self.widget = widgets.VBox([
            widgets.HBox([self.layer, self.top_k]), *labelled, widgets.HBox([self.renormalize, self.shared,
                                                                             self.gate_scale]),
            widgets.HBox([self.apply, self.reset]), self.status, self.shown, self.diff, self.figure, self.step,
            self.before.figure, self.after.figure, live_mark()])
        self.widget.add_class("moebench-interventions")
        controls.on_decode(self._new_baseline)

    @property
    def result(self) -> Result | None:
        """The result the views show (picked under 'result'; the newest after every decode)."""
        return self.results[self.shown.value] if self.shown.value is not None else None

    @property
    def intervened(self):
        return self.result.intervened if self.result is not None else None

    @property
    def forced(self):
        return self.result.forced if self.result is not None else None

    @property
    def measured(self) -> dict[str, np.ndarray] | None:
        return self.result.measured if self.result is not None else None

    @property
    def has_shared_expert(self) -> bool:
        """Whether the model the controls decode with has a shared expert (gpt-oss, Qwen3-MoE, OLMoE have none)."""
        return bool(self.model.args.shared_expert_intermediate_size)

    def intervention(self) -> Intervention:
        """The Intervention the controls describe (force wins over top-k: forcing fixes the count). A shared-expert
        setting on a model without one is refused: it would change nothing and chart rounding noise as an effect."""
        force = tuple(self.force.value) or None
        top_k = None if force is not None or self.top_k.value == self.default_k else self.top_k.value
        shared = (self.shared.value, float(self.gate_scale.value))
        if not self.has_shared_expert and shared != (True, 1.0):
            raise InterventionError(f"this model has no shared expert, so 'shared expert on' {shared[0]} and 'gate "
                                    f"scale' {shared[1]:g} would change nothing: press clear, or set a change to "
                                    "the routed experts (force, ablate, top-k)")
        return Intervention(force_experts=force, ablate=tuple(self.ablate.value),
                            renormalize_ablation=self.renormalize.value, top_k=top_k,
                            shared_expert=shared[0], shared_gate_scale=shared[1])

    def _configure(self, model) -> None:
        """Layers, expert ids and top-k of the model the controls decode with (the picker may change it)."""
        self.model = self.before.model = self.after.model = model  # the routing views name it, and split a bias
        n_experts = model.args.num_experts
        self.default_k = model.args.num_experts_per_tok
        self.layer.options = [("every MoE layer", EVERY_LAYER)] + [(f"layer {i}", i) for i in model.moe_blocks()]
        self.layer.value = EVERY_LAYER
        for box in (self.force, self.ablate):
            box.value, box.max = [], n_experts - 1
        self.hint.value = (f"<span style='color:#555;font-size:12px'>expert ids 0-{n_experts - 1}: type one and "
                           "press Enter to add it (again for more); click a tag's \u00d7 to remove it</span>")
        self.top_k.max, self.top_k.value = n_experts, self.default_k
        self.shared.value, self.gate_scale.value = True, 1.0
        self.shared.disabled = self.gate_scale.disabled = not self.has_shared_expert
        self.shared.description = "shared expert on" if self.has_shared_expert else "no shared expert in this model"

    def _new_baseline(self, trace) -> None:
        if self.controls.model is not self.model:  # another model picked: its layers, experts and shared expert
            self._configure(self.controls.model)
        self.baseline = trace
        self.results = []  # measured against the old baseline: they no longer apply
        self.step.max = len(trace.generated) - 1
        self._list_results()

    def run(self) -> None:
        """Decode with the intervention (free-running, then fed the baseline's tokens) and draw the effect."""
        intervention = self.intervention()
        if intervention == Intervention():
            raise InterventionError("no intervention is set (force and ablate empty, top-k and the shared expert as "
                                    "the model has them): the decode would be the baseline's, so there is no "
                                    "effect to measure")
        chosen = intervention if self.layer.value == EVERY_LAYER else {self.layer.value: intervention}
        self.apply.disabled = True
        self.status.value = "<i>decoding with the intervention...</i>"
        try:
            n = len(self.baseline.generated)
            with intervene(self.controls.picker.model, chosen):
                intervened = self.controls.stepper(max_tokens=n, keep_logits=False).run(n)
                forced = self.controls.stepper(keep_logits=True, stop_ids=())
                forced.prefill()
                for token in self.baseline.token_ids[:-1]:
                    forced.step(feed=token)
        finally:
            self.apply.disabled = False
        measured = effect(self.baseline, forced.trace)
        where = "every MoE layer" if self.layer.value == EVERY_LAYER else f"layer {self.layer.value}"
        self.summary = (f"{intervention!r} on {where}: mean KL {measured['kl'].mean():.3g} nats, largest "
                        f"{measured['kl'].max():.3g}; mean change in log p of the baseline's token "
                        f"{measured['dlogp'].mean():+.3g}")
        label = f"{len(self.results) + 1}: {describe(intervention, where)} (mean KL {measured['kl'].mean():.3g})"
        self.results.append(Result(label, self.summary, intervened, forced.trace, measured))
        self._list_results()  # the views first: the status says the decode is done only once they show it
        self.status.value = html.escape(self.summary)

    def clear(self) -> None:
        """Controls back to 'no intervention' (the model runs its baseline routing); the results stay listed."""
        self.layer.value, self.force.value, self.ablate.value = EVERY_LAYER, [], []
        self.renormalize.value, self.shared.value, self.gate_scale.value = False, True, 1.0
        self.top_k.value = self.default_k
        kept = (f"; the {len(self.results)} result(s) decoded so far stay listed under 'result'" if self.results
                else "")
        self.summary = f"cleared: no intervention is set (the model runs its baseline routing){kept}"
        self.status.value = html.escape(self.summary)

    def _list_results(self) -> None:
        """Refill the result picker and show its newest entry, or the baseline alone when there is none."""
        self._listing = True
        try:
            self.shown.options = [(r.label, i) for i, r in enumerate(self.results)]
        finally:
            self._listing = False
        newest = len(self.results) - 1 if self.results else None
        if self.shown.value == newest:
            self._draw()
        else:
            self.shown.value = newest  # draws it

    def _draw(self) -> None:
        self.diff.value = token_diff(self.baseline, self.intervened) if self.intervened is not None else ""
        with self.figure.batch_update():
            xs = list(range(len(self.measured["kl"]))) if self.measured is not None else []
            self.figure.data[0].x, self.figure.data[0].y = xs, self.measured["kl"] if xs else []
            self.figure.data[1].x, self.figure.data[1].y = xs, self.measured["dlogp"] if xs else []
        self._draw_routing()

    def _draw_routing(self) -> None:
        i = self.step.value
        shown = [self.baseline.generated[i]]
        if self.intervened is not None and i < len(self.intervened.generated):
            shown.append(self.intervened.generated[i])
        for view, record in zip((self.before, self.after), shown, strict=False):
            view.scale_to(shown)
            view.show(record)
        if len(shown) == 1:
            self.after.blank("no intervened decode yet: set an intervention and press 'decode with it'")

    def _failed(self, error: BaseException) -> None:
        self.status.value = error_html(error)

    def _ipython_display_(self):
        show(self.widget, [self.figure, self.before.figure, self.after.figure])
