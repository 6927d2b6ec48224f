"""Live tokens-per-second chart: one point per decoded token, one trace per arm.

An arm is the fused switch (on/off, told apart by colour) times recording (recorded internals drawn with
open markers and a dotted line, clean decoding solid), so the cost of looking and the kernel's effect
each show as a gap between traces. The last `window` tokens are kept as one window for all traces (a
trace never keeps points older than the others), a line never bridges tokens of another arm, and the
figure is redrawn at most `redraw_hz` times a second with one `batch_update`. Marks (a flip of the
switch or of recording) are dotted lines with a label above the plot: each label is measured (its text at
the label's font, against the narrowest plot the chart is drawn at), written left of its line where the
right would run past the axis, and put in the lowest row where it overlaps no other, so labels are neither
clipped nor stacked on one another; a mark with no room in any row keeps its line and says so in the
label before it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from statistics import median, quantiles

from .figure import LiveFigure, go

TITLE = "decode speed: tokens per second, one point per token (higher is faster)"
ARMS = [(fused, recording) for fused in (True, False) for recording in (False, True)]
COLORS = {True: "#1f77b4", False: "#ff7f0e"}
MARK_ROWS = 4
MARK_ROW_STEP = 0.07  # a row's height, as a share of the plot's height
MARK_FONT_PX = 10
CHAR_PX = 6.5  # widest average character of the label font at MARK_FONT_PX (upper case included)
LABEL_PAD_PX = 8  # the label's background box and the gap kept to the next label
PLOT_PX = 600  # the narrowest plot area the chart is drawn at (plotly's default 700 px figure less margins)


def arm_name(fused: bool, recording: bool) -> str:
    return f"fused {'on' if fused else 'off'}, {'recording' if recording else 'clean'}"


def spread(rates: list[float]) -> str:
    """'median 71.2 tok/s (IQR 69.0-73.5, n 40)'; quartiles need two points."""
    if len(rates) < 2:
        return f"{rates[0]:.1f} tok/s (n 1)"
    q1, _, q3 = quantiles(rates, n=4, method="inclusive")
    return f"median {median(rates):.1f} tok/s (IQR {q1:.1f}-{q3:.1f}, n {len(rates)})"


def with_gaps(points: list[tuple[int, float]]) -> tuple[list, list]:
    """x and y with a None between points that are not neighbours, so plotly breaks the line there."""
    xs, ys = [], []
    for i, (x, y) in enumerate(points):
        if i and x != points[i - 1][0] + 1:
            xs.append(None)
            ys.append(None)
        xs.append(x)
        ys.append(y)
    return xs, ys


def label_extent(x: float, text: str, lo: float, hi: float) -> tuple[float, float, str]:
    """(left, right, xanchor) of a mark's label in axis units: right of the line, or left of it where the
    right side would pass the axis's end."""
    width = (CHAR_PX * len(text) + LABEL_PAD_PX) * (hi - lo) / PLOT_PX
    if x + width <= hi or x - width < lo:
        return x, x + width, "left"
    return x - width, x, "right"


def place_marks(marks: list[tuple[float, str]], lo: float, hi: float) -> list[tuple[float, str, int, str, str]]:
    """(x, label, row, xanchor, hover) per labelled mark on the axis range [lo, hi]: each label takes the lowest
    row in which it overlaps no label placed before it. A mark that fits in no row gets no label (its line is
    still drawn); the label placed last before it names it in its hover text."""
    placed: list[list] = []
    ends: list[float] = []  # per row, where its rightmost label ends
    for x, text in sorted(marks, key=lambda m: m[0]):
        left, right, anchor = label_extent(x, text, lo, hi)
        row = next((r for r, end in enumerate(ends) if left >= end), None)
        if row is None and len(ends) < MARK_ROWS:
            row = len(ends)
            ends.append(-math.inf)
        if row is not None:
            ends[row] = right
            placed.append([x, text, row, anchor, f"{text} at token {x}"])
        elif placed:
            placed[-1][4] += f"<br>{text} at token {x} (no room for its label)"
    return [tuple(p) for p in placed]


class TokensPerSecondChart:
    """`chart.add(position, seconds, recording, fused)` per token; `chart.mark(position, text)` for events."""

    def __init__(self, window: int = 200, redraw_hz: float = 4.0, title: str = TITLE):
        if window < 2:
            raise ValueError(f"window must hold at least 2 points, got {window}")
        self.window = window
        self.min_interval = 1.0 / redraw_hz if redraw_hz > 0 else 0.0
        self._points: deque[tuple[int, float, tuple[bool, bool]]] = deque(maxlen=window)
        self._marks: deque[tuple[int, str]] = deque(maxlen=window)
        self._last_draw = -math.inf  # the first point always draws
        self._dirty = False
        self.points_received = 0
        self.figure = LiveFigure(
            data=[go.Scatter(x=[], y=[], mode="lines+markers", name=arm_name(*arm), connectgaps=False,
                             line={"color": COLORS[arm[0]], "dash": "dot" if arm[1] else "solid", "width": 1.5},
                             marker={"size": 6 if arm[1] else 4, "symbol": "circle-open" if arm[1] else "circle"})
                  for arm in ARMS],
            layout=go.Layout(
                title={"text": title, "x": 0}, height=380, margin={"l": 60, "r": 20, "t": 110, "b": 40},
                xaxis={"title": "token position in the sequence"},
                yaxis={"title": "tokens / second", "rangemode": "tozero"},
                legend={"orientation": "h", "y": -0.2}, modebar={"orientation": "v"},
            ),
        )
        self.figure.add_class("moebench-tps-chart")

    def add(self, position: int, seconds: float, recording: bool, fused: bool = True) -> None:
        """One decoded token that took `seconds`; redraws when the throttle allows."""
        if not seconds > 0:
            raise ValueError(f"position {position}: a token cannot take {seconds} seconds")
        self._points.append((position, 1.0 / seconds, (bool(fused), bool(recording))))
        self.points_received += 1
        self._dirty = True
        self._maybe_draw()

    def mark(self, position: int, text: str) -> None:
        """A labelled vertical line at `position` (e.g. 'fused OFF')."""
        self._marks.append((position, text))
        self._dirty = True
        self._maybe_draw()

    def trace(self, recording: bool, fused: bool = True):
        """The plotly trace of one arm."""
        return self.figure.data[ARMS.index((bool(fused), bool(recording)))]

    def rates(self, recording: bool, fused: bool = True) -> list[float]:
        return [r for _, r, arm in self._points if arm == (bool(fused), bool(recording))]

    def summary(self, recording: bool, fused: bool = True) -> str:
        """The arm's median and spread over the window, or a plain statement that there is none."""
        rates = self.rates(recording, fused)
        name = arm_name(fused, recording)
        return f"{name}: {spread(rates)}" if rates else f"{name}: no tokens yet"

    def summaries(self) -> list[str]:
        """summary() of every arm that has tokens in the window."""
        return [self.summary(rec, fused) for fused, rec in ARMS if self.rates(rec, fused)]

    def clear(self) -> None:
        """Forget every point and mark (another model: its rates do not compare with the last one's) and redraw."""
        self._points.clear()
        self._marks.clear()
        self._draw()

    def flush(self) -> None:
        """Draw now, whatever the throttle says (end of a run)."""
        if self._dirty:
            self._draw()

    def _maybe_draw(self) -> None:
        if time.monotonic() - self._last_draw >= self.min_interval:
            self._draw()

    def _draw(self) -> None:
        oldest = self._points[0][0] if self._points else 0
        newest = self._points[-1][0] if self._points else 1
        lo, hi = oldest - 0.5, max(newest, oldest + 1) + 0.5
        shown = [(s, t) for s, t in self._marks if s >= oldest]
        marks = place_marks(shown, lo, hi)
        tops = {x: 1 + MARK_ROW_STEP * row for x, _, row, _, _ in marks}
        with self.figure.batch_update():
            for fused, rec in ARMS:
                trace = self.trace(rec, fused)
                xs, ys = with_gaps([(p, r) for p, r, arm in self._points if arm == (fused, rec)])
                trace.x, trace.y = xs, ys
                trace.name = self.summary(rec, fused)
                trace.showlegend = bool(xs)
            self.figure.layout.xaxis.range = [lo, hi]
            self.figure.layout.shapes = [
                {"type": "line", "x0": s, "x1": s, "yref": "paper", "y0": 0, "y1": tops.get(s, 1),
                 "line": {"dash": "dot", "color": "#555", "width": 1}} for s in sorted({s for s, _ in shown})
            ]
            self.figure.layout.annotations = [
                {"x": s, "y": 1 + MARK_ROW_STEP * row, "yref": "paper", "text": t, "hovertext": hover,
                 "showarrow": False, "xanchor": anchor, "yanchor": "bottom", "font": {"size": MARK_FONT_PX},
                 "bgcolor": "rgba(255,255,255,0.8)"}
                for s, t, row, anchor, hover in marks
            ]
        self._last_draw = time.monotonic()
        self._dirty = False
