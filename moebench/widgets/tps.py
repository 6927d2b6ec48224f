"""Live tokens-per-second chart: a plotly FigureWidget fed one point per decoded token.

Instrumented steps (internals recorded) and uninstrumented steps are separate traces, so the cost of
looking is visible instead of hiding inside one number. Points are buffered and the figure is redrawn
at most `redraw_hz` times a second with one `batch_update`; only the last `window` points are kept.
"""

from __future__ import annotations

import math
import time
from collections import deque

import plotly.graph_objects as go

TITLE = "decode speed: tokens per second, one point per token (higher is faster)"
TRACES = {True: "recording internals", False: "not recording (clean speed)"}
COLORS = {True: "#d62728", False: "#1f77b4"}


class TokensPerSecondChart:
    """`chart.add(position, seconds, instrumented)` per token; `chart.mark(position, text)` for events (a toggle)."""

    def __init__(self, window: int = 200, redraw_hz: float = 4.0, title: str = TITLE):
        if window < 2:
            raise ValueError(f"window must hold at least 2 points, got {window}")
        self.window = window
        self.min_interval = 1.0 / redraw_hz if redraw_hz > 0 else 0.0
        self._points = {flag: deque(maxlen=window) for flag in TRACES}
        self._marks: deque[tuple[int, str]] = deque(maxlen=window)
        self._last_draw = -math.inf  # the first point always draws
        self._dirty = False
        self.points_received = 0
        self.figure = go.FigureWidget(
            data=[go.Scatter(x=[], y=[], mode="lines+markers", name=TRACES[flag],
                             line={"color": COLORS[flag]}, marker={"size": 4}) for flag in TRACES],
            layout=go.Layout(
                title=title, height=320, margin={"l": 60, "r": 20, "t": 50, "b": 40},
                xaxis={"title": "token position in the sequence"},
                yaxis={"title": "tokens / second", "rangemode": "tozero"},
                legend={"orientation": "h", "y": -0.25},
            ),
        )

    def add(self, position: int, seconds: float, instrumented: bool) -> None:
        """One decoded token that took `seconds`; redraws when the throttle allows."""
        if not seconds > 0:
            raise ValueError(f"position {position}: a token cannot take {seconds} seconds")
        self._points[bool(instrumented)].append((position, 1.0 / seconds))
        self.points_received += 1
        self._dirty = True
        self._maybe_draw()

    def mark(self, position: int, text: str) -> None:
        """A labelled vertical line at `position` (e.g. 'fused OFF')."""
        self._marks.append((position, text))
        self._dirty = True
        self._maybe_draw()

    def trace(self, instrumented: bool):
        """The plotly trace of instrumented (True) or clean (False) tokens."""
        return self.figure.data[list(TRACES).index(bool(instrumented))]

    def summary(self, instrumented: bool) -> str:
        """Mean tokens/s over the window for one trace, or a plain statement that there is none."""
        rates = [r for _, r in self._points[instrumented]]
        if not rates:
            return f"{TRACES[instrumented]}: no tokens yet"
        return f"{TRACES[instrumented]}: {sum(rates) / len(rates):.1f} tok/s (mean of last {len(rates)})"

    def flush(self) -> None:
        """Draw now, whatever the throttle says (end of a run)."""
        if self._dirty:
            self._draw()

    def _maybe_draw(self) -> None:
        if time.monotonic() - self._last_draw >= self.min_interval:
            self._draw()

    def _draw(self) -> None:
        oldest = min((p[0][0] for p in self._points.values() if p), default=0)
        marks = [(s, t) for s, t in self._marks if s >= oldest]
        with self.figure.batch_update():
            for flag in TRACES:
                trace = self.trace(flag)
                trace.x = [s for s, _ in self._points[flag]]
                trace.y = [r for _, r in self._points[flag]]
                trace.name = self.summary(flag)
            self.figure.layout.shapes = [
                {"type": "line", "x0": s, "x1": s, "yref": "paper", "y0": 0, "y1": 1,
                 "line": {"dash": "dot", "color": "#555"}} for s, _ in marks
            ]
            self.figure.layout.annotations = [
                {"x": s, "y": 1, "yref": "paper", "text": t, "showarrow": False, "yanchor": "bottom",
                 "font": {"size": 10}} for s, t in marks
            ]
        self._last_draw = time.monotonic()
        self._dirty = False
