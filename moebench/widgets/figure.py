"""The plotly pieces every view shares: LiveFigure, and the expert axis of a layer x expert heatmap.

LiveFigure is a plotly FigureWidget whose kernel-side state follows every update.

plotly's FigureWidget sends each update to the browser as a one-off message and keeps its synced state
(`_widget_data`, `_widget_layout`) as it was at construction, so a reloaded tab (which asks the kernel for
each widget's state) draws the first, empty figure. LiveFigure copies the figure into that state after
every update without sending it again (the open views applied the update already), and refreshes the
static picture of the figure (static.Snapshot) that a saved notebook keeps.
"""

from __future__ import annotations

import sys
from copy import deepcopy

import numpy as np


def _import_plotly_widget():
    """plotly's FigureWidget imports nbformat, whose jsonschema imports the optional rfc3987_syntax, which
    builds a parser grammar for ~10 s on a small CPU. The widgets never validate IRIs: jsonschema is
    imported here without that checker (only when nothing imported jsonschema before)."""
    if "jsonschema" not in sys.modules and "rfc3987_syntax" not in sys.modules:
        sys.modules["rfc3987_syntax"] = None  # an import of it raises ImportError, which jsonschema expects
        try:
            import jsonschema  # noqa: F401
        finally:
            del sys.modules["rfc3987_syntax"]
    import plotly.graph_objects as go

    return go


go = _import_plotly_widget()
UPDATES = ("_py2js_addTraces", "_py2js_restyle", "_py2js_relayout", "_py2js_update", "_py2js_deleteTraces",
           "_py2js_moveTraces", "_py2js_removeLayoutProps", "_py2js_removeTraceProps")
STATE = frozenset({"_widget_data", "_widget_layout"})


class LiveFigure(go.FigureWidget):
    """A FigureWidget that a reloaded browser tab draws as it is now, with a static picture beside it."""

    def __init__(self, *args, **kwargs):
        self._quiet = False
        self._snapshot = None  # a static.Snapshot once the figure is displayed
        super().__init__(*args, **kwargs)
        self.observe(self._updated, names=list(UPDATES))

    def _updated(self, change) -> None:
        if change["new"] is not None:
            return  # plotly sets each message, then None once it is sent
        self._quiet = True
        try:
            self._widget_data = deepcopy(self._data)
            self._widget_layout = deepcopy(self._layout_obj._props)
        finally:
            self._quiet = False
        if self._snapshot is not None:
            self._snapshot.update()

    def _should_send_property(self, key, value):
        if self._quiet and key in STATE:
            return False
        return super()._should_send_property(key, value)


# Tick spacings an expert axis may use: a reader counts along 1, 2, 4, 5, 8, 10, 16, ... easily.
NICE_STEPS = (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100, 128, 250, 256, 500, 512, 1000, 1024)
CHAR_PX = 0.62  # a digit's width in the axis font, as a share of the font size (measured on Chromium's sans)
TICK_GAP_PX = 6  # clear space between neighbouring tick labels


def axis_pixels(layout, axis: str = "xaxis") -> float:
    """How many pixels `axis` spans: the figure's fixed width less its side margins, times the axis domain."""
    domain = layout[axis].domain or (0, 1)
    return (layout.width - layout.margin.l - layout.margin.r) * (domain[1] - domain[0])


def tick_step(n: int, pixels: float, font_px: float) -> int:
    """The smallest nice spacing between labelled experts at which `n` experts' labels cannot overlap."""
    label = len(str(max(n - 1, 0))) * CHAR_PX * font_px + TICK_GAP_PX
    return next((s for s in NICE_STEPS if s * pixels / max(n, 1) >= label), NICE_STEPS[-1])


def ordered(weights: np.ndarray | None, n: int) -> np.ndarray:
    """Expert ids left to right: by id when `weights` is None, else heaviest first (ties by id)."""
    if weights is None:
        return np.arange(n)
    return np.argsort(-np.asarray(weights, dtype=float), kind="stable")


class ExpertAxis:
    """The expert (x) axis of a layer x expert heatmap: columns in `order` (expert ids), a label on every
    `step`-th column thinned to what the axis' pixels hold, the ids kept for hover and clicks.

    Columns are positions 0..n-1; `ids[pos]` is the expert drawn there and `position[id]` where it sits,
    so a sorted order moves the columns but every label, hover and click still names the real expert.
    """

    def __init__(self, order: np.ndarray, pixels: float, font_px: float):
        self.ids = np.asarray(order, dtype=int)
        self.n = len(self.ids)
        self.position = np.empty(self.n, dtype=int)
        self.position[self.ids] = np.arange(self.n)
        self.pixels = pixels
        self.column_px = pixels / max(self.n, 1)
        self.step = tick_step(self.n, pixels, font_px)

    def ticks(self) -> dict:
        """plotly axis settings: the thinned labels, each naming the expert drawn under it."""
        vals = list(range(0, self.n, self.step))
        return {"tickmode": "array", "tickvals": vals, "ticktext": [str(self.ids[v]) for v in vals]}

    def span(self, mark_px: float = 0.0) -> list[float]:
        """The axis range: every column, plus room for a mark `mark_px` wide centred on the first or last."""
        pad = max(0.0, mark_px / 2 / self.column_px - 0.5)
        return [-0.5 - pad, self.n - 0.5 + pad]

    def id_at(self, x) -> int:
        """The expert drawn at a clicked column position."""
        return int(self.ids[int(round(float(x)))])
