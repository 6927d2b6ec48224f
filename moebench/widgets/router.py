"""Router view: for one token, the router's probability for every (MoE layer, expert), top-k marked.

The shared expert is not routed: every token goes through it, scaled by its own sigmoid gate, so its
gate is drawn in a separate column rather than mixed into the expert probabilities.

From 60 to 512 experts the columns stay readable: the tick labels thinned to what the width holds, the
boxes sized to a column, the columns by id or most picked first (figure.ExpertAxis).
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np
from plotly.subplots import make_subplots

from .figure import ExpertAxis, LiveFigure, axis_pixels, go, ordered
from .static import live_mark, show
from .text import shown

NO_SHARED = "this model has<br>no shared expert"
SHARED_OFF = "shared expert<br>switched off by<br>an intervention"


def shared_note(record) -> str | None:
    """Why a step has no shared-expert gate to show, or None when every MoE layer has one."""
    missing = [i for i, layer in record.layers.items() if layer.shared_gate is None]
    if not missing:
        return None
    off = [i for i in missing if i in record.interventions and not record.interventions[i].shared_expert]
    return SHARED_OFF if off else NO_SHARED


def top_probability(records) -> float:
    """The largest router probability over the records: one colour scale for all of them."""
    return max((float(layer.router_probs.max()) for r in records for layer in r.layers.values()), default=1.0)


ORDERS = (("expert id", "id"), ("most picked first", "usage"))
FONT_PX = 10  # the expert ticks' font size
LABEL_PX = 18  # a column this wide (or wider) has room for a box's "#1"


def picks(records, n: int) -> np.ndarray:
    """How often each of `n` experts was in a top-k, over every MoE layer of `records`."""
    counts = np.zeros(n, dtype=int)
    for record in records:
        for layer in record.layers.values():
            np.add.at(counts, np.asarray(layer.topk_ids, dtype=int), 1)
    return counts


class RouterView:
    """`view.show(record)` draws one step; `view.marked` holds the top-k expert ids drawn per layer.

    The colour scale stays fixed while stepping (0..`zmax`, default 1), so colours compare across
    tokens; `scale_to(records)` sets it to the largest probability among those records, and counts their
    picks for the "most picked first" order. Hovering or clicking a cell names its expert (clicked:
    `view.picked`, as (layer, expert)), whichever order the columns are in.
    """

    def __init__(self, height_per_layer: int = 30, zmax: float = 1.0, title: str = "", order: str = "id"):
        if order not in dict(ORDERS).values():
            raise ValueError(f"order must be one of {[v for _, v in ORDERS]}, got {order!r}")
        self.height_per_layer = height_per_layer
        self.zmax = zmax
        self.prefix = title
        self.marked: dict[int, list[int]] = {}
        self.usage: np.ndarray | None = None
        self.record = None
        self.axis: ExpertAxis | None = None
        self.picked: tuple[int, int] | None = None
        fig = make_subplots(rows=1, cols=2, column_widths=[0.84, 0.16], shared_yaxes=True, horizontal_spacing=0.02,
                            subplot_titles=("router probability of each expert<br>(red boxes: the top-k it "
                                            "picked, #1 = highest)", "shared expert<br>gate (0..1)"))
        fig.add_trace(go.Heatmap(z=[[0.0]], colorscale="Blues", zmin=0, zmax=zmax,
                                 colorbar={"title": {"text": "router<br>prob"}, "x": 1.0, "xanchor": "left",
                                           "len": 0.9},
                                 hovertemplate="layer %{y}<br>expert %{customdata[0]}<br>probability %{z:.3f}"
                                               "%{customdata[1]}<extra></extra>"),
                      row=1, col=1)
        fig.add_trace(go.Scatter(x=[], y=[], mode="markers+text", name="top-k",
                                 marker={"symbol": "square-open", "size": 22, "color": "#d62728", "line": {"width": 3}},
                                 textfont={"size": 11}, textposition="middle center",
                                 hoverinfo="skip", showlegend=False), row=1, col=1)
        fig.add_trace(go.Heatmap(z=[[0.0]], colorscale="Greens", zmin=0, zmax=1, showscale=False,
                                 texttemplate="%{z:.2f}",
                                 hovertemplate="layer %{y}<br>shared gate %{z:.3f}<extra></extra>"), row=1, col=2)
        fig.add_trace(go.Scatter(x=[], y=[], mode="markers", name="ablated (may not be picked)",
                                 marker={"symbol": "x-thin", "size": 16, "color": "#000", "line": {"width": 2}},
                                 hoverinfo="skip", showlegend=False), row=1, col=1)
        fig.update_xaxes(title_text="expert id", tickfont={"size": FONT_PX}, row=1, col=1)
        fig.update_xaxes(showticklabels=False, row=1, col=2)
        fig.update_yaxes(title_text="MoE layer", autorange="reversed", type="category", row=1, col=1)
        fig.update_layout(margin={"l": 70, "r": 90, "t": 110, "b": 70}, width=860, title={"x": 0},
                          legend={"orientation": "h", "x": 0, "y": -0.3}, modebar={"orientation": "v"})
        self.figure = LiveFigure(fig)
        self.figure.data[0].on_click(self._clicked)
        self.order = widgets.ToggleButtons(options=ORDERS, value=order, description="experts",
                                           style={"button_width": "auto"})
        self.order.observe(self._reorder, names="value")
        self.readout = widgets.HTML("<i>hover a cell for its expert; click it to note it here</i>")
        self.widget = widgets.VBox([self.order, self.figure, self.readout, live_mark()])
        self.widget.add_class("moebench-router-view")

    def scale_to(self, records) -> None:
        """Fix the colour scale to the largest router probability among `records`; count their picks."""
        records = list(records)
        self.zmax = top_probability(records)
        self.figure.data[0].zmax = self.zmax
        sizes = {len(layer.router_probs) for r in records for layer in r.layers.values()}
        self.usage = picks(records, max(sizes)) if sizes else None

    def blank(self, text: str) -> None:
        """No routing to draw: empty panels and `text` as the title."""
        with self.figure.batch_update():
            for trace in self.figure.data:
                trace.x, trace.y = [], []
                if trace.type == "heatmap":
                    trace.z = []
            self.figure.layout.title.text = self.prefix + text
        self.marked = {}

    def expert_axis(self, probs: np.ndarray) -> ExpertAxis:
        """The columns for this step: by id, or by the picks counted in `scale_to` (this step's when none)."""
        n = probs.shape[1]
        weights = None
        if self.order.value == "usage":
            weights = self.usage if self.usage is not None and len(self.usage) == n else probs.sum(axis=0)
        return ExpertAxis(ordered(weights, n), axis_pixels(self.figure.layout), FONT_PX)

    def show(self, record) -> None:
        self.record = record
        layers = sorted(record.layers)
        if not layers:
            self.blank(f"position {record.position}: internals were not recorded for this token")
            return
        probs = np.stack([record.layers[layer].router_probs for layer in layers])
        axis = self.axis = self.expert_axis(probs)
        labels = [f"L{layer}" for layer in layers]
        xs, ys, ranks, colors = [], [], [], []
        rank_of = np.full(probs.shape, "", dtype=object)
        self.marked = {}
        dark = 0.6 * self.zmax
        for row, (layer, label) in enumerate(zip(layers, labels, strict=True)):
            ids = [int(i) for i in record.layers[layer].topk_ids]
            self.marked[layer] = ids
            xs += [int(axis.position[i]) for i in ids]
            ys += [label] * len(ids)
            ranks += [f"#{r + 1}" for r in range(len(ids))]
            rank_of[row, ids] = [f"<br>picked #{r + 1}" for r in range(len(ids))]
            colors += ["white" if probs[row, i] > dark else "#b71c1c" for i in ids]
        cell = min(axis.column_px, self.height_per_layer)
        box = float(np.clip(cell - 1, 7, 22))
        gates = [record.layers[layer].shared_gate for layer in layers]
        note = shared_note(record)
        k = {len(ids) for ids in self.marked.values()}
        with self.figure.batch_update():
            heat, boxes, shared, ablated = self.figure.data
            heat.z, heat.x, heat.y = probs[:, axis.ids], list(range(axis.n)), labels
            heat.customdata = [[[int(e), rank_of[row, e]] for e in axis.ids] for row in range(len(layers))]
            self.figure.layout.xaxis.update(range=axis.span(box + 3), **axis.ticks())
            self.figure.layout.xaxis.title.text = "expert id" + (" (most picked first)" if self.order.value ==
                                                                  "usage" else "")
            boxes.x, boxes.y, boxes.text = xs, ys, ranks
            boxes.mode = "markers+text" if cell >= LABEL_PX else "markers"
            boxes.marker.size = box
            boxes.textfont.color = colors
            shared.z = [[None if g is None else float(g)] for g in gates]
            shared.y, shared.x = labels, ["gate"]
            banned = {label: record.interventions[layer].ablate if layer in record.interventions else ()
                      for layer, label in zip(layers, labels, strict=True)}
            crossed = [(e, label) for label in labels for e in banned[label]]
            ablated.x, ablated.y = [int(axis.position[e]) for e, _ in crossed], [label for _, label in crossed]
            ablated.marker.size = box
            ablated.showlegend = bool(crossed)
            self.figure.layout.annotations = self.figure.layout.annotations[:2]
            if note is not None:
                self.figure.add_annotation(text=note, xref="x2 domain", yref="y2 domain", x=0.5, y=0.5,
                                           showarrow=False, font={"size": 11})
            self.figure.layout.title.text = (f"{self.prefix}routing of token {shown(record.input_text)} (position "
                                             f"{record.position}): {'/'.join(map(str, sorted(k)))} experts picked "
                                             "per MoE layer")
            self.figure.layout.height = 200 + self.height_per_layer * len(layers)
            heat.colorbar.nticks = max(2, self.height_per_layer * len(layers) // 25)  # labels a short bar can hold

    def _reorder(self, _change=None) -> None:
        if self.record is not None:
            self.show(self.record)

    def _clicked(self, _trace, points, _state) -> None:
        """A click on a cell: note its layer and expert (the real id, whatever the column order) below."""
        record, axis = self.record, self.axis
        if not points.xs or record is None or axis is None:
            return
        layer, expert = int(str(points.ys[0]).removeprefix("L")), axis.id_at(points.xs[0])
        self.picked = (layer, expert)
        probs = record.layers[layer].router_probs
        ids = [int(i) for i in record.layers[layer].topk_ids]
        rank = f", picked #{ids.index(expert) + 1}" if expert in ids else ", not picked"
        self.readout.value = (f"<b>layer {layer}, expert {expert}</b>: router probability {probs[expert]:.3f}"
                              f"{rank} (token {html.escape(shown(record.input_text))}, position {record.position})")

    def _ipython_display_(self):
        show(self.widget, [self.figure])
