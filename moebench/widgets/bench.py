"""Decode speed measured like a benchmark: the four arms (fused on/off x recording on/off) interleaved
round by round, the first round(s) dropped as warm-up, median and spread per arm.

Each arm decodes the same prompt with a fresh Stepper (greedy, so every arm is fed the same tokens while
fused and fallback agree) and is timed as decode.generate times a decode: tokens after the first per
second (Trace.decode_tps), with no view work in between. The arm order rotates every round so no arm
always runs first or last.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import pandas as pd

from .controls import model_name
from .figure import LiveFigure, go
from .mainthread import Owner
from .stale import StaleNote
from .static import live_mark, show
from .text import error_html
from .tps import ARMS, COLORS, arm_name


def measure(make_stepper, tokens: int = 32, rounds: int = 5, warmup: int = 1, on_arm=None) -> pd.DataFrame:
    """One row per (round, arm): fused, recording, warmup, tok/s, and the decoded text.
    `make_stepper(record=..., fused=...)` gives a fresh Stepper on the prompt (PromptControls.stepper)."""
    if tokens < 2 or rounds < 1 or warmup < 0:
        raise ValueError(f"need tokens >= 2, rounds >= 1, warmup >= 0; got {tokens}, {rounds}, {warmup}")
    rows = []
    total = (warmup + rounds) * len(ARMS)
    for r in range(warmup + rounds):
        order = ARMS[r % len(ARMS):] + ARMS[: r % len(ARMS)]
        for fused, recording in order:
            trace = make_stepper(record=recording, fused=fused, stop_ids=()).run(tokens)
            rows.append({"round": r, "warmup": r < warmup, "fused": fused, "recording": recording,
                         "arm": arm_name(fused, recording), "tok_s": trace.decode_tps, "text": trace.text})
            if on_arm is not None:
                on_arm(len(rows), total)
    return pd.DataFrame(rows)


def summarize(runs: pd.DataFrame) -> pd.DataFrame:
    """Per arm (in tps.ARMS order) over the measured rounds: median, min, max and the number of rounds."""
    kept = runs[~runs["warmup"]]
    out = kept.groupby("arm")["tok_s"].agg(["median", "min", "max", "count"])
    arms = pd.DataFrame([{"fused": f, "recording": r, "arm": arm_name(f, r)} for f, r in ARMS])
    return arms.join(out, on="arm")


TITLE = "decode tok/s per arm{on}<br><sub>one dot per measured round, dash = median, line = min-max</sub>"


class DecodeBenchmark:
    """Rounds and tokens to set, a run button, a progress bar, a chart of every round and a summary table.
    `controls`: the notebook's PromptControls (the model and prompt are read when a run starts). After another
    model is picked, the last measurement stays, named by its model, under a line offering to measure the new one."""

    def __init__(self, controls, tokens: int = 32, rounds: int = 5, warmup: int = 1):
        self.controls = controls
        self.owner = Owner(on_error=self._failed)
        self.runs: pd.DataFrame | None = None
        self.model = None  # the model `runs` measured
        self.tokens = widgets.BoundedIntText(value=tokens, min=2, max=4096, description="tokens",
                                             layout=widgets.Layout(width="160px"))
        self.rounds = widgets.BoundedIntText(value=rounds, min=1, max=50, description="rounds",
                                             layout=widgets.Layout(width="160px"))
        self.warmup = widgets.BoundedIntText(value=warmup, min=0, max=10, description="warm-up",
                                             layout=widgets.Layout(width="160px"))
        self.button = widgets.Button(description="run benchmark", icon="play", button_style="primary")
        self.button.add_class("moebench-bench-run")
        self.button.on_click(lambda _: self.owner.submit(self.run))
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="", layout=widgets.Layout(width="300px"))
        self.table = widgets.HTML("<i>not run yet</i>")
        self.table.add_class("moebench-bench-table")
        self.figure = LiveFigure(layout=go.Layout(
            title={"text": TITLE.format(on=""), "x": 0},
            height=380, margin={"l": 60, "r": 20, "t": 80, "b": 60}, yaxis={"title": "tokens / second",
                                                                           "rangemode": "tozero"},
            xaxis={"type": "category", "categoryorder": "array", "categoryarray": [arm_name(*a) for a in ARMS]},
            showlegend=False, modebar={"orientation": "v"}))
        for fused, recording in ARMS:  # the medians as wide dashes with their min-max (plotly's bars drew at "0")
            self.figure.add_scatter(x=[], y=[], mode="markers", name=arm_name(fused, recording),
                                    marker={"color": COLORS[fused], "symbol": "line-ew-open", "size": 44,
                                            "line": {"width": 4, "color": COLORS[fused]}},
                                    error_y={"type": "data", "symmetric": False, "array": [], "arrayminus": [],
                                             "color": COLORS[fused], "thickness": 1 if recording else 2})
        for fused, recording in ARMS:
            self.figure.add_scatter(x=[], y=[], mode="markers", name=arm_name(fused, recording),
                                    marker={"color": COLORS[fused], "size": 7, "line": {"width": 1, "color": "#000"},
                                            "symbol": "circle-open" if recording else "circle"})
        self.stale = StaleNote("these numbers measured", "run benchmark", rerun=lambda: self.owner.submit(self.run))
        self.widget = widgets.VBox([widgets.HBox([self.tokens, self.rounds, self.warmup, self.button]),
                                    self.progress, self.stale.widget, self.figure, self.table, live_mark()])
        self.widget.add_class("moebench-bench")
        controls.picker.on_change(lambda *_: self._picked())

    def _picked(self) -> None:
        """Another model is picked: the numbers shown (if any) are the last model's; the note says so."""
        if self.model is not None and self.model is not self.controls.picker.model:
            self.stale.show(model_name(self.model), model_name(self.controls.picker.model))

    def run(self) -> pd.DataFrame:
        """Measure with the values in the boxes (on the thread the model's arrays live on)."""
        self.button.disabled = True
        self.progress.value, self.progress.bar_style = 0, ""
        model = self.controls.picker.model
        try:
            def step(done, total):
                self.progress.max, self.progress.value = total, done
            self.runs = measure(self.controls.stepper, self.tokens.value, self.rounds.value, self.warmup.value,
                                on_arm=step)
        finally:
            self.button.disabled = False
        self.model = model
        self.progress.bar_style = "success"
        self._draw()
        self.stale.hide()
        return self.runs

    def _draw(self) -> None:
        table = summarize(self.runs)
        kept = self.runs[~self.runs["warmup"]]
        with self.figure.batch_update():
            self.figure.layout.title.text = TITLE.format(on=f" on {model_name(self.model)}")
            for i, row in enumerate(table.itertuples()):
                median = self.figure.data[i]
                median.x, median.y = [row.arm], [row.median]
                median.error_y.array, median.error_y.arrayminus = [row.max - row.median], [row.median - row.min]
                dots = kept[kept["arm"] == row.arm]
                self.figure.data[len(ARMS) + i].x = [row.arm] * len(dots)
                self.figure.data[len(ARMS) + i].y = dots["tok_s"].tolist()
        medians = {(r.fused, r.recording): r.median for r in table.itertuples()}
        costs = [f"fused {'on' if f else 'off'}: clean {medians[(f, False)] / medians[(f, True)]:.2f}x recording"
                 for f in (True, False)]
        kernel = [f"{'clean' if not rec else 'recording'}: fused on {medians[(True, rec)] / medians[(False, rec)]:.2f}x"
                  " off" for rec in (False, True)]
        rows = "".join(f"<tr><td>{html.escape(r.arm)}</td><td>{r.median:.1f}</td><td>{r.min:.1f}-{r.max:.1f}</td>"
                       f"<td>{r.count}</td></tr>" for r in table.itertuples())
        texts = set(self.runs["text"])
        same = "every arm decoded the same text" if len(texts) == 1 else f"{len(texts)} different texts among the arms"
        n_warm = int(self.runs["warmup"].sum() / len(ARMS))
        self.table.value = (
            "<table><tr><th>arm</th><th>median tok/s</th><th>min-max</th><th>rounds</th></tr>" + rows + "</table>"
            f"<div>{n_warm} warm-up round(s) dropped; arms interleaved, order rotated each round; {same}.<br>"
            f"cost of looking (median ratio): {'; '.join(costs)}.<br>fused kernels (median ratio): "
            f"{'; '.join(kernel)}.</div><div><b>decoded text</b>: <code>{html.escape(self.runs['text'].iloc[0])}"
            "</code></div>")

    def _failed(self, error: BaseException) -> None:
        self.progress.bar_style = "danger"
        self.table.value = error_html(error)

    def _ipython_display_(self):
        show(self.widget, [self.figure])
