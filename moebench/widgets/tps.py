"""Live tokens-per-second chart: one point per decoded token, one trace per arm.

An arm is the fused switch (on/off, told apart by colour) times recording (recorded internals drawn with
open markers and a dotted line, clean decoding solid), so the cost of looking and the kernel's effect
each show as a gap between traces. The last `window` tokens are kept as one window for all traces (a
trace never keeps points older than the others), a line never bridges tokens of another arm, and the
figure is redrawn at most `redraw_hz` times a second with one `batch_update`. Marks (a flip of the
switch or of recording) stack in rows so their labels never overlap.
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
MARK_GAP = 0.15  # marks closer than this share of the window's width go to different rows


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


def place_marks(marks: list[tuple[int, str]], width: float) -> list[tuple[int, str, int]]:
    """(x, label, row) per label: each mark takes the lowest row whose last label ends `width` before it;
    when every row is that crowded it joins the nearest row's last label, so no two labels overlap."""
    placed: list[list] = []
    last: list[int] = []  # per row, the index in `placed` of its last label
    for x, text in marks:
        row = next((r for r, i in enumerate(last) if x - placed[i][0] >= width), None)
        if row is None and len(last) < MARK_ROWS:
            row = len(last)
            last.append(-1)
        if row is None:
            nearest = max(last, key=lambda i: placed[i][0])
            placed[nearest][1] += f", {text} ({x})"
            continue
        placed.append([x, text, row])
        last[row] = len(placed) - 1
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
        marks = place_marks([(s, t) for s, t in self._marks if s >= oldest], MARK_GAP * max(newest - oldest, 10))
        with self.figure.batch_update():
            for fused, rec in ARMS:
                trace = self.trace(rec, fused)
                xs, ys = with_gaps([(p, r) for p, r, arm in self._points if arm == (fused, rec)])
                trace.x, trace.y = xs, ys
                trace.name = self.summary(rec, fused)
                trace.showlegend = bool(xs)
            self.figure.layout.xaxis.range = [oldest - 0.5, max(newest, oldest + 1) + 0.5]
            self.figure.layout.shapes = [
                {"type": "line", "x0": s, "x1": s, "yref": "paper", "y0": 0, "y1": 1 + 0.07 * row,
                 "line": {"dash": "dot", "color": "#555", "width": 1}} for s, _, row in marks
            ]
            self.figure.layout.annotations = [
                {"x": s, "y": 1 + 0.07 * row, "yref": "paper", "text": t, "showarrow": False, "xanchor": "left",
                 "yanchor": "bottom", "font": {"size": 10}, "bgcolor": "rgba(255,255,255,0.8)"}
                for s, t, row in marks
            ]
        self._last_draw = time.monotonic()
        self._dirty = False
