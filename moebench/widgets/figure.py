"""The plotly pieces every view shares: LiveFigure, and the expert axis of a layer x expert heatmap.

LiveFigure is a plotly FigureWidget whose kernel-side state follows every update.

plotly's FigureWidget sends each update to the browser as a one-off message and keeps its synced state
(`_widget_data`, `_widget_layout`) as it was at construction, so a reloaded tab (which asks the kernel for
each widget's state) draws the first, empty figure. LiveFigure copies the figure into that state after
every update without sending it again (the open views applied the update already), and refreshes the
static picture of the figure (static.Snapshot) that a saved notebook keeps.

LiveFigure also loads plotly's front end outside anywidget's initialisation window. anywidget (0.11) gives a
model 2 s from its creation in the browser to import its ES module and run `initialize`; past that it rejects
the model's `ready` ("[anywidget] Failed to initialize model.", an unhandled rejection when nothing waits on it)
and, since every comm message of the model first awaits `ready`, drops every later message: the figure stays
as first drawn while the kernel goes on updating it (JupyterLab swallows the error). plotly ships its whole
front end (a 5 MB bundle) as each FigureWidget's module, imported from a fresh blob URL per figure: fetching and
compiling it can pass 2 s on a busy machine. Here the module anywidget imports is a few lines (FRONT_END):
`initialize` returns at once and starts the bundle's import (kept once per page, shared by every figure);
plotly's own widget takes over once it is evaluated, replaying in order the updates the kernel sent meanwhile,
and views render when it is there.
"""

from __future__ import annotations

import sys
from copy import deepcopy
from functools import cache

import numpy as np
import traitlets


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


# The module anywidget imports for a LiveFigure: plotly's widget, loaded after `initialize` returned.
FRONT_END = """
const PY2JS = ["_py2js_addTraces", "_py2js_deleteTraces", "_py2js_moveTraces", "_py2js_restyle",
  "_py2js_relayout", "_py2js_update", "_py2js_animate", "_py2js_removeLayoutProps", "_py2js_removeTraceProps"];
// plotly's bundle, imported once per page (per bundle text: kernels may run different plotly versions)
const bundles = (globalThis[Symbol.for("moebench.plotly-front-end")] ??= new Map());

function importBundle(source) {
  if (!bundles.has(source)) {
    const url = URL.createObjectURL(new Blob([source], { type: "text/javascript" }));
    bundles.set(source, import(url).finally(() => URL.revokeObjectURL(url)));
  }
  return bundles.get(source);
}

export default () => {
  let widget; // plotly's widget for this figure: a promise until its module is evaluated
  return {
    initialize({ model }) {
      let loaded = false;
      let replaying = null; // [name, message]: a kernel update plotly missed, being applied now
      const early = [];
      const handlers = {};
      for (const name of PY2JS) {
        model.on(`change:${name}`, () => {
          const message = model.get(name);
          if (!loaded && message !== null) early.push([name, message]);
        });
      }
      const figureModel = {
        get: (key) => (replaying && replaying[0] === key ? replaying[1] : model.get(key)),
        set: (key, value) => model.set(key, value),
        save_changes: () => model.save_changes(),
        on: (event, handler) => {
          // ipywidgets logs a handler's error by its message alone ("Error setting state: ..."): log where it is
          const logged = (...args) => {
            try { return handler(...args); }
            catch (error) { console.error(`plotly's ${event} handler failed: ${error.stack}`); throw error; }
          };
          model.on(event, logged);
          if (!loaded) (handlers[event] ??= []).push(logged);
        },
      };
      widget = importBundle(model.get("_plotly_esm")).then((bundle) => {
        const plotly = bundle.default();
        plotly.initialize({ model: figureModel });
        for (replaying of early) (handlers[`change:${replaying[0]}`] ?? []).forEach((handler) => handler());
        replaying = null;
        loaded = true;
        return plotly;
      });
    },
    async render({ el }) {
      return (await widget).render({ el });
    },
  };
};
"""


@cache
def plotly_bundle() -> str:
    """plotly's FigureWidget front end, as anywidget would send it for a plain FigureWidget (anywidget turns
    plotly's file path into its contents)."""
    return str(go.FigureWidget._esm)


class LiveFigure(go.FigureWidget):
    """A FigureWidget that a reloaded browser tab draws as it is now, with a static picture beside it; its
    front end initialises at once, whatever the time plotly's bundle takes to load (see the module's doc)."""

    _esm = FRONT_END
    _plotly_esm = traitlets.Unicode().tag(sync=True)

    @traitlets.default("_plotly_esm")
    def _bundle(self) -> str:
        return plotly_bundle()

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


def layer_rows(axes, labels: list[str]) -> None:
    """Category rows, exactly `labels` top-down, on each of `axes` (a figure's panels side by side). The panels'
    axes are set alike rather than matched: plotly keeps the categories of matched category axes across updates,
    and a model with fewer layers then made it throw ("Cannot read properties of undefined (reading 'length')") and
    leave the chart as it was."""
    for axis in axes:
        axis.update(type="category", range=[len(labels) - 0.5, -0.5], autorange=False, categoryorder="array",
                    categoryarray=labels)


def json_grid(grid) -> list[list[float | None]]:
    """A 2-D grid as plotly sends it to the browser (nested lists), NaN and infinities as None (a gap, drawn as no
    cell): the kernel's messages are JSON, which has no NaN ("Out of range float values are not JSON compliant")."""
    values = np.asarray(grid, dtype=float)
    return [[float(v) if np.isfinite(v) else None for v in row] for row in values]


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
