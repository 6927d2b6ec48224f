"""Diff view: fused kernel vs gather_qmm fallback vs a float64 truth, per layer and per expert, plus
routing agreement between whole decodes with the switch on and off.

Reads the results of moebench.inspect.compare: `show_step(compare_step(...))` for the errors under identical
routing, `show_decode(compare_decode(...))` for what the two paths did to routing and tokens.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Callable

import ipywidgets as widgets
import numpy as np
import pandas as pd
from plotly.subplots import make_subplots

from ..inspect.compare import with_dtype
from .controls import model_name
from .figure import LiveFigure
from .mainthread import Owner
from .static import live_mark, show
from .text import error_html, visible

PAIR_NAMES = {
    "fused~truth": "fused kernel vs float64 truth",
    "fallback~truth": "fallback (gather_qmm) vs float64 truth",
    "fused~fallback": "fused vs fallback",
}
PAIR_COLORS = {"fused~truth": "#2ca02c", "fallback~truth": "#ff7f0e", "fused~fallback": "#7f7f7f"}
FLOOR = 1e-12  # errors of exactly 0 cannot sit on a log axis
ROUNDING = 1e-5  # below this normalized RMS, float32 paths differ only by rounding order


UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def log_ticks(values: np.ndarray) -> list[float]:
    """Tick values for a log axis that brackets `values`: powers of ten when they span two decades or more,
    else 1, 2 and 5 times each; from the last tick below the smallest value to the first above the largest,
    so the axis (ranged to them) always shows at least two labelled ticks."""
    positive = np.maximum(np.asarray(values, float), FLOOR)
    low, high = float(positive.min()), float(positive.max())
    steps = (1,) if high / low >= 100 else (1, 2, 5)
    ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
             for m in steps]
    first = max(i for i, t in enumerate(ticks) if t <= low)
    last = min(i for i, t in enumerate(ticks) if t >= high)
    return ticks[first: max(last, first + 1) + 1]


def relation(a: float, b: float) -> str:
    """How a compares with b, in words taken from the numbers ('about the same as' within a factor of 2)."""
    if a == b:
        return "equal to"
    if min(a, b) <= 0:
        return "larger than" if a > b else "smaller than"
    ratio = max(a, b) / min(a, b)
    if ratio < 2:
        return "about the same as"
    return f"{ratio:.0f}x {'larger' if a > b else 'smaller'} than"


class DiffView:
    """Three panels: routed-output error per layer, per-expert partial error, routing agreement per layer."""

    def __init__(self):
        fig = make_subplots(rows=1, cols=3, column_widths=[0.3, 0.45, 0.25], horizontal_spacing=0.07,
                            subplot_titles=("MoE output error per layer<br>(same routing on every path)",
                                            "error of each chosen expert's weighted output<br>"
                                            "(L layer, #rank, e expert id)",
                                            "routing agreement,<br>fused on vs off (1 = same)"))
        for pair in PAIR_NAMES:
            fig.add_bar(x=[], y=[], name=PAIR_NAMES[pair], marker_color=PAIR_COLORS[pair], legendgroup=pair,
                        row=1, col=1)
        for pair in ("fused~truth", "fallback~truth"):
            fig.add_bar(x=[], y=[], name=PAIR_NAMES[pair], marker_color=PAIR_COLORS[pair], legendgroup=pair,
                        showlegend=False, row=1, col=2)
        fig.add_bar(x=[], y=[], name="mean Jaccard of top-k sets", marker_color="#1f77b4", showlegend=False,
                    row=1, col=3)
        fig.update_yaxes(type="log", title_text="normalized RMS error (log)", tickformat=".0e", nticks=6, row=1, col=1)
        fig.update_yaxes(type="log", tickformat=".0e", nticks=6, row=1, col=2)
        fig.update_yaxes(range=[0, 1.05], row=1, col=3)
        fig.update_xaxes(title_text="MoE layer", type="category", row=1, col=1)
        fig.update_xaxes(type="category", tickangle=-90, row=1, col=2)
        fig.update_xaxes(title_text="MoE layer", type="category", row=1, col=3)
        fig.update_layout(barmode="group", height=500, width=900, margin={"l": 70, "r": 40, "t": 130, "b": 120},
                          legend={"orientation": "h", "y": -0.4}, title={"x": 0}, modebar={"orientation": "v"})
        self.figure = LiveFigure(fig)
        self.summary = widgets.HTML()
        self.widget = widgets.VBox([self.figure, self.summary, live_mark()])
        self.widget.add_class("moebench-diff-view")
        self.model_name: str | None = None  # named in the title when set (CompareSteps sets it)
        self._step_text = self._decode_text = ""

    def show_step(self, frame, seconds: float | None = None) -> None:
        """A compare_step frame: one row per (layer, part, pair); `seconds`: how long the comparison took."""
        routed = frame[frame["part"] == "routed"]
        experts = frame[frame["part"] == "expert"]
        with self.figure.batch_update():
            for trace, pair in zip(self.figure.data[:3], PAIR_NAMES, strict=True):
                rows = routed[routed["pair"] == pair]
                trace.x = [str(v) for v in rows["layer"]]
                trace.y = np.maximum(rows["nrms"].to_numpy(float), FLOOR)
            for trace, pair in zip(self.figure.data[3:5], ("fused~truth", "fallback~truth"), strict=True):
                rows = experts[experts["pair"] == pair]
                trace.x = [f"L{layer} #{slot + 1} e{e}" for layer, slot, e in
                           zip(rows["layer"], rows["slot"], rows["expert"], strict=True)]
                trace.y = np.maximum(rows["nrms"].to_numpy(float), FLOOR)
        backend, dtype = frame["backend"].iloc[0], frame["dtype"].iloc[0].replace("mlx.core.", "")
        rounding = UNIT_ROUNDOFF.get(dtype)
        for col, values in ((1, routed["nrms"]), (2, experts["nrms"])):
            shown = values.to_numpy(float)
            if col == 1 and rounding is not None:
                shown = np.append(shown, rounding)
            ticks = log_ticks(shown)
            self.figure.update_yaxes(tickvals=ticks, ticktext=[f"{t:.0e}" for t in ticks], row=1, col=col,
                                     range=[math.log10(ticks[0]), math.log10(ticks[-1]) + 0.05])
        self.figure.layout.shapes = [] if rounding is None else [
            {"type": "line", "xref": "x domain", "yref": "y", "x0": 0, "x1": 1, "y0": rounding, "y1": rounding,
             "line": {"dash": "dash", "color": "#444", "width": 1}}]
        on = f" on {self.model_name}" if self.model_name else ""
        self.figure.layout.title.text = (f"fused vs fallback{on}, {dtype} activations (fused backend '{backend}'); "
                                         f"dashed: {dtype}'s unit roundoff")
        medians = {pair: float(routed[routed["pair"] == pair]["nrms"].median()) for pair in PAIR_NAMES}
        fused, fallback = medians["fused~truth"], medians["fallback~truth"]
        if max(fused, fallback) < ROUNDING:
            closer = "both paths match the truth to float32 rounding (the differences are noise)"
        else:
            closer = ("the fused kernel is closer to the truth" if fused < fallback else
                      "the fallback is closer to the truth" if fallback < fused else "both paths are equally close")
        took = f" Compared in {seconds:.2f} s." if seconds is not None else ""
        partial = float(experts[experts["pair"] == "fused~truth"]["nrms"].median())
        cast = ("in float32 that cast changes nothing, so both panels show float32's summation order only"
                if dtype == "float32" else f"the fallback rounds to {dtype} at every product, so both its panels "
                                           f"show {dtype}'s rounding")
        self._step_text = (f"<b>errors under identical routing</b> ({dtype} activations, fused backend "
                           f"'{html.escape(backend)}'): median over layers, fused {fused:.2e} vs fallback "
                           f"{fallback:.2e}: {closer}. The fused path's per-layer error (left, {fused:.1e}) is "
                           f"{relation(fused, partial)} its per-expert error (middle, {partial:.1e}): the left panel "
                           f"includes each path's final cast of the routed sum to {dtype} (unit roundoff "
                           f"{rounding or float('nan'):.1e}, the dashed line), the middle one compares the float32 "
                           f"partials before it; {cast}.{took}")
        shared = frame[frame["part"] == "shared"]
        if len(shared):
            s_fused, s_fallback = (float(shared[shared["pair"] == pair]["nrms"].median())
                                   for pair in ("fused~truth", "fallback~truth"))
            self._step_text += (f" Shared expert (unweighted output), median over layers: fused {s_fused:.2e} vs "
                                f"fallback {s_fallback:.2e}.")
        self._render()

    def show_decode(self, comparison, seconds: float | None = None) -> None:
        """A compare_decode result: per-layer mean Jaccard, the first divergent token, KL per token."""
        per_layer = comparison.jaccard.groupby("layer")["jaccard"].mean()
        with self.figure.batch_update():
            trace = self.figure.data[5]
            trace.x = [str(v) for v in per_layer.index]
            trace.y = per_layer.to_numpy(float)
        n = len(comparison.kl)
        if comparison.identical:
            tokens = f"all {n} greedy tokens identical with the switch on and off"
        else:
            on, off = comparison.margins["on"], comparison.margins["off"]
            tokens = (f"tokens first differ at generated token {comparison.first_divergence} of {n} (top-1 margin "
                      f"there: {on['prob']:.3f} probability with fused, {off['prob']:.3f} without)")
        self._decode_text = (f"<b>whole decode</b> ({comparison.dtype.replace('mlx.core.', '')}): {tokens}; "
                             f"largest per-token KL {float(np.max(comparison.kl)):.2e} nats; mean routing "
                             f"agreement {float(per_layer.mean()):.3f}."
                             + (f" Both decodes took {seconds:.2f} s." if seconds is not None else ""))
        self._render()

    def _render(self) -> None:
        self.summary.value = "<br>".join(t for t in (self._step_text, self._decode_text) if t)

    def _ipython_display_(self):
        show(self.widget, [self.figure])


class CompareSteps:
    """A token picker over the decode steps of the controls' last decode and a DiffView of the picked one, following
    the controls: each decode (a new prompt, or another model picked) lists its tokens and compares afresh.

    `compare(model, step)` (e.g. compare_step) runs on the notebook's thread when the pick changes; `decode(model)`
    (e.g. a compare_decode of the prompt), when given, once per decode of the controls. Both get the model that
    decoded the trace, loaded with `dtype` when one is given (compare.with_dtype, once per model), so a token is
    never compared on a model other than the one that decoded it."""

    def __init__(self, controls, compare: Callable[[object, object], object],
                 decode: Callable[[object], object] | None = None, dtype=None, view: DiffView | None = None):
        self.controls, self.compare, self.decode, self.dtype = controls, compare, decode, dtype
        self.view = view or DiffView()
        self.owner = Owner(on_error=lambda e: setattr(self.view.summary, "value", error_html(e)))
        self.model = None  # the model compared (in `dtype`), and the one it was loaded from
        self._source = None
        self.steps: dict[int, object] = {}
        self.frame = self.comparison = None
        self.picker = widgets.Dropdown(description="token")
        self.picker.add_class("moebench-compare-picker")
        self._listing = False  # True while the picker's options are refilled: no comparison per option
        self.picker.observe(lambda _: None if self._listing else self.owner.submit(self.show), names="value")
        self.widget = widgets.VBox([self.picker, self.view.widget])
        self._callbacks: list[Callable[[CompareSteps], None]] = []
        controls.on_decode(self.follow)

    @property
    def source(self):
        """The model that decoded the steps compared (`model` is it, or its copy in `dtype`)."""
        return self._source

    def on_compare(self, callback: Callable[[CompareSteps], None]) -> None:
        """Call `callback(self)` after every comparison (another token picked, a new decode)."""
        self._callbacks.append(callback)

    def follow(self, trace) -> None:
        """List the decode steps of `trace` (the controls' new decode) and compare the last, on its model."""
        if self.controls.model is not self._source:
            self.model, self._source = with_dtype(self.controls.model, self.dtype), self.controls.model
        steps = [s for s in trace.generated if s.phase == "decode"] or trace.generated
        self.steps = {s.index: s for s in steps}
        self._listing = True
        try:
            self.picker.options = [(f"position {s.position}: '{visible(s.input_text)}'", s.index) for s in steps]
            self.picker.value = steps[-1].index
        finally:
            self._listing = False
        self.view.model_name = model_name(self._source)
        if self.decode is not None:
            start = time.perf_counter()
            self.comparison = self.decode(self.model)
            self.view.show_decode(self.comparison, seconds=time.perf_counter() - start)
        self.show()

    def show(self) -> None:
        start = time.perf_counter()
        self.frame = self.compare(self.model, self.steps[self.picker.value])
        self.view.show_step(self.frame, seconds=time.perf_counter() - start)
        for callback in self._callbacks:
            callback(self)

    def _ipython_display_(self):
        show(self.widget, [self.view.figure])


PARTS = ("routed", "expert", "shared")  # the left panel's, the middle one's, then the shared expert's


def medians(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Median normalized RMS over the layers of compare_step frames, per (activations, pair) and part, with each
    dtype's unit roundoff."""
    named = {frame["dtype"].iloc[0].replace("mlx.core.", ""): frame for frame in frames}
    table = pd.concat(named, names=["activations"]).pivot_table(index=["activations", "pair"], columns="part",
                                                                values="nrms", aggfunc="median")
    table = table[sorted(table.columns, key=PARTS.index)]
    table["unit roundoff"] = [UNIT_ROUNDOFF[dtype] for dtype, _ in table.index]
    return table


class MedianTable:
    """The numbers behind the panels of several CompareSteps (one per activation dtype): `medians` as a table,
    redrawn after each of them compares, once all of them compared the same model's decode."""

    def __init__(self, views: list[CompareSteps]):
        self.views = views
        self.medians: pd.DataFrame | None = None
        self.widget = widgets.HTML()
        self.widget.add_class("moebench-median-table")
        for view in views:
            view.on_compare(self.update)
        self.update()

    def update(self, _view: CompareSteps | None = None) -> None:
        sources = {id(view.source) for view in self.views}
        if len(sources) != 1 or any(view.frame is None for view in self.views):
            return  # after a new decode, until the last view has compared it too
        self.medians = medians([view.frame for view in self.views])
        self.widget.value = (f"<b>on {html.escape(model_name(self.views[0].source))}</b>"
                             + self.medians.style.format("{:.1e}").to_html())

    def _ipython_display_(self):
        show(self.widget)
