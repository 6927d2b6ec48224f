"""Router view: for one token, the router's probability for every (MoE layer, expert), top-k marked.

The shared expert is not routed: every token goes through it, scaled by its own sigmoid gate, so its
gate is drawn in a separate column rather than mixed into the expert probabilities.

From 32 to 512 experts the columns stay readable: the tick labels thinned to what the width holds, the
boxes sized to a column, the columns by id or most picked first (figure.ExpertAxis).

A router with a bias (gpt-oss; a block's spec says `router_bias`) picks its top-k from logit = x.W + bias, so
an expert can be picked for its bias more than for the token. Given the model, the view reads the bias (a
weight of the block; nothing is run again) and draws the picked experts' logits split in a third panel: a
bar from 0 to x.W, then the bias from there to the recorded logit; every cell's hover says the same. A model
whose routers have no bias is drawn as before, with no third panel.

A selection-biased router (GLM-4.x MoE, DeepSeek-V3: a learned bias added to the scores only to choose) records what
it chose by; the view marks the picks its bias alone put in (an orange box over the red one) and the experts its
bias kept out of the top-k (orange rings), against the top-k of the unbiased scores in the same groups
(LayerRecord.selection_bias_effect).
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import mlx.core as mx
import numpy as np
from plotly.subplots import make_subplots

from .controls import model_name
from .figure import ExpertAxis, LiveFigure, axis_pixels, go, layer_rows, ordered
from .static import live_mark, show
from .text import shown

BASE_TRACES = 6  # heatmap, top-k boxes, shared gate, ablated, picked by the selection bias, kept out by it
BIAS_COLOUR_CHOICE = "#ff7f0e"
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
BOX_MIN_PX = 7  # a top-k box is never drawn smaller, however narrow its column
MARGIN = {"l": 70, "r": 90, "t": 110, "b": 60}  # the title and panel titles above; ticks and the axis title below
LEGEND_PX = 40  # below the axis title, where a legend is drawn (the logit panel's bars, ablated experts)
PLOT_MIN_PX = 160  # the plot's least height, so the colour bar beside one or two MoE layers has room for its ticks
# the title along the bar's right side: the whole length is left for the colours and their labels
COLORBAR = {"title": {"text": "router probability", "side": "right"}, "x": 1.0, "xanchor": "left", "len": 0.9,
            "thickness": 14}
# With the logit panel: a wider figure (that still fits a notebook's width), the heatmap keeping about the width it
# has without it; the colour bar stands right of the shared gate's column, the panel after it (domains as shares
# of the plot width; the right margin no longer holds the colour bar).
SPLIT_WIDTH = 1000
SPLIT_DOMAINS = ((0.0, 0.55), (0.565, 0.665), (0.8, 1.0))
SPLIT_COLORBAR_X = 0.675
SPLIT_MARGIN_R = 20
BAR_SPAN = 0.8  # a layer's row height the picked experts' bars share
XW_COLOUR, BIAS_COLOUR = "#6baed6", "#fd8d3c"
SPLIT_TITLE = "router logit of the picked<br>experts = x·W + bias"


def router_biases(model) -> dict[int, np.ndarray]:
    """Each MoE layer's router bias, read from its block where the block's spec declares one (float64); {} for no
    model, or one whose routers have no bias."""
    if model is None:
        return {}
    return {layer: np.array(block.gate["bias"].astype(mx.float32), dtype=np.float64)
            for layer, block in model.moe_blocks().items() if block.spec.router_bias}


def logit_parts(layer_record, bias: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(x.W, logit) over every expert of one recorded layer: the recorded logits are x.W + bias, so x.W is what is
    left when the bias (the block's weight) is taken off. A bias of another size names the mismatch."""
    logits = np.asarray(layer_record.router_logits, dtype=np.float64)
    if bias.shape != logits.shape:
        raise ValueError(f"RouterView.model's router bias of MoE layer {layer} has {bias.shape[0]} experts but the "
                         f"record has {logits.shape[-1]}: set view.model to the model that made the record")
    return logits - bias, logits


def logit_text(xw: float, logit: float, bias: float) -> str:
    """A hover row: how one expert's logit is made."""
    return f"<br>logit {logit:.3f} = x·W {xw:.3f} + bias {bias:.3f}"


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

    `model` (or `view.model = ...` after another is picked): the title names it, and where a router has a bias,
    its MoE layers show the picked experts' logits as x.W + bias (`view.biases`, per layer, read from the model).
    """

    def __init__(self, height_per_layer: int = 30, zmax: float = 1.0, title: str = "", order: str = "id",
                 model=None):
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
        self.model = model
        fig = make_subplots(rows=1, cols=2, column_widths=[0.84, 0.16], horizontal_spacing=0.02,
                            subplot_titles=("router probability of each expert<br>(red boxes: the top-k it "
                                            "picked, #1 = highest)", "shared expert<br>gate (0..1)"))
        # No cells until a step is shown: plotly cannot draw a cell on a category axis that has no category yet
        # (the browser throws "createImageData ... width is zero"), and a view may open before the first step.
        fig.add_trace(go.Heatmap(z=[], colorscale="Blues", zmin=0, zmax=zmax, colorbar=COLORBAR,
                                 hovertemplate="layer %{y}<br>expert %{customdata[0]}<br>probability %{z:.3f}"
                                               "%{customdata[1]}<extra></extra>"),
                      row=1, col=1)
        fig.add_trace(go.Scatter(x=[], y=[], mode="markers+text", name="top-k",
                                 marker={"symbol": "square-open", "size": 22, "color": "#d62728", "line": {"width": 3}},
                                 textfont={"size": 11}, textposition="middle center",
                                 hoverinfo="skip", showlegend=False), row=1, col=1)
        fig.add_trace(go.Heatmap(z=[], colorscale="Greens", zmin=0, zmax=1, showscale=False,
                                 texttemplate="%{z:.2f}",
                                 hovertemplate="layer %{y}<br>shared gate %{z:.3f}<extra></extra>"), row=1, col=2)
        fig.add_trace(go.Scatter(x=[], y=[], mode="markers", name="ablated (may not be picked)",
                                 marker={"symbol": "x-thin", "size": 16, "color": "#000", "line": {"width": 2}},
                                 hoverinfo="skip", showlegend=False), row=1, col=1)
        fig.add_trace(go.Scatter(x=[], y=[], mode="markers", name="picked for its selection bias alone",
                                 marker={"symbol": "square-open", "size": 22, "color": BIAS_COLOUR_CHOICE,
                                         "line": {"width": 3}}, hoverinfo="skip", showlegend=False), row=1, col=1)
        fig.add_trace(go.Scatter(x=[], y=[], mode="markers", name="kept out of the top-k by the selection bias",
                                 marker={"symbol": "circle-open", "size": 16, "color": BIAS_COLOUR_CHOICE,
                                         "line": {"width": 2}}, hoverinfo="skip", showlegend=False), row=1, col=1)
        fig.update_xaxes(title_text="expert id", tickfont={"size": FONT_PX}, row=1, col=1)
        fig.update_xaxes(showticklabels=False, row=1, col=2)
        fig.update_yaxes(title_text="MoE layer", type="category", row=1, col=1)
        fig.update_yaxes(showticklabels=False, type="category", row=1, col=2)  # the same rows: set in show()
        # the legend's place is counted from the figure's bottom edge, so it never meets the axis title
        fig.update_layout(margin=MARGIN, width=860, title={"x": 0, "font": {"size": 14}}, modebar={"orientation": "v"},
                          legend={"orientation": "h", "x": 0, "xanchor": "left", "yref": "container", "y": 0,
                                  "yanchor": "bottom"})
        self._plain = (fig.layout.width, fig.layout.xaxis.domain, fig.layout.xaxis2.domain)
        self.figure = LiveFigure(fig)
        self.figure.data[0].on_click(self._clicked)
        self.order = widgets.ToggleButtons(options=ORDERS, value=order, description="experts",
                                           style={"button_width": "auto"})
        self.order.observe(self._reorder, names="value")
        self.readout = widgets.HTML("<i>hover a cell for its expert; click it to note it here</i>")
        self.widget = widgets.VBox([self.order, self.figure, self.readout, live_mark()])
        self.widget.add_class("moebench-router-view")

    @property
    def model(self):
        return self._model

    @model.setter
    def model(self, model) -> None:
        """The model whose records are shown: its router biases are read now (`biases`)."""
        self._model = model
        self.biases = router_biases(model)

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
        split = {layer: logit_parts(record.layers[layer], self.biases[layer], layer) for layer in layers
                 if layer in self.biases}
        self._arrange(bool(split))  # before the expert axis, which fits its labels to the heatmap's width
        axis = self.axis = self.expert_axis(probs)
        labels = [f"L{layer}" for layer in layers]
        xs, ys, ranks, colors = [], [], [], []
        made = {"in": ([], []), "out": ([], [])}  # the picks a selection bias alone made, the experts it kept out
        rank_of = np.full(probs.shape, "", dtype=object)
        logit_of = np.full(probs.shape, "", dtype=object)
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
            if layer in split:
                logit_of[row] = [logit_text(*parts) for parts in zip(*split[layer], self.biases[layer], strict=True)]
            effect = record.layers[layer].selection_bias_effect()
            for side, experts in zip(("in", "out"), effect or ((), ()), strict=True):
                made[side][0].extend(int(axis.position[e]) for e in experts)
                made[side][1].extend([label] * len(experts))
                why = "<br>picked for its selection bias alone" if side == "in" else \
                    "<br>kept out of the top-k by the selection bias"
                rank_of[row, list(experts)] += why
            choice = record.layers[layer].choice_scores if effect is not None else None
            if choice is not None:  # a grouped router's experts outside the groups it kept
                rank_of[row, ~np.isfinite(choice)] += "<br>its group was not among the groups kept"
        plot_px = max(PLOT_MIN_PX, self.height_per_layer * len(layers))
        cell = min(axis.column_px, plot_px / len(layers))  # a box outlines its cell, at any expert or layer count
        box = max(BOX_MIN_PX, cell - 6)  # its 3 px line drawn inside the cell, a gap to the next box
        gates = [record.layers[layer].shared_gate for layer in layers]
        note = shared_note(record)
        k = {len(ids) for ids in self.marked.values()}
        with self.figure.batch_update():
            heat, boxes, shared, ablated, bias_in, bias_out = self.figure.data[:BASE_TRACES]
            heat.z, heat.x, heat.y = probs[:, axis.ids], list(range(axis.n)), labels
            heat.customdata = [[[int(e), rank_of[row, e] + logit_of[row, e]] for e in axis.ids]
                               for row in range(len(layers))]
            self.figure.layout.xaxis.update(range=axis.span(box + 3), **axis.ticks())
            layer_rows([self.figure.layout.yaxis, self.figure.layout.yaxis2], labels)  # the boxes are sized to them
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
            for trace, side, size in ((bias_in, "in", box), (bias_out, "out", max(BOX_MIN_PX, box - 8))):
                trace.x, trace.y = made[side]
                trace.marker.size = size
                trace.showlegend = bool(made[side][0])
            biased = any(made[side][0] for side in made)
            # the subplots' titles, then the rest, set in one assignment (in a batch, plotly drops an annotation
            # added after the list was cut back)
            titles = list(self.figure.layout.annotations[:2])
            if split:
                self._draw_split(record, split, labels)
                titles.append(go.layout.Annotation(titles[0], text=SPLIT_TITLE, x=sum(SPLIT_DOMAINS[2]) / 2))
            if note is not None:
                titles.append(go.layout.Annotation(text=note, xref="x2 domain", yref="y2 domain", x=0.5, y=0.5,
                                                   showarrow=False, font={"size": 11}))
            self.figure.layout.annotations = titles
            on = f" on {model_name(self.model)}" if self.model is not None else ""
            self.figure.layout.title.text = (f"{self.prefix}routing of token {shown(record.input_text)} (position "
                                             f"{record.position}){on}: {'/'.join(map(str, sorted(k)))} experts "
                                             "picked per MoE layer")
            bottom = MARGIN["b"] + (LEGEND_PX if split or crossed or biased else 0)
            self.figure.layout.margin.b, self.figure.layout.height = bottom, MARGIN["t"] + bottom + plot_px
            heat.colorbar.nticks = max(2, plot_px // 25)  # the labels the bar's length holds

    def _arrange(self, split: bool) -> None:
        """The logit panel there (a wider figure, a third column with its two bar traces) or not, as `split` says;
        without it the figure is laid out exactly as for a router without a bias."""
        if split == (len(self.figure.data) > BASE_TRACES):
            return
        layout = self.figure.layout
        width, heat_domain, shared_domain = (SPLIT_WIDTH, *SPLIT_DOMAINS[:2]) if split else self._plain
        with self.figure.batch_update():
            layout.width = width
            layout.margin.r = SPLIT_MARGIN_R if split else MARGIN["r"]
            self.figure.data[0].colorbar.x = SPLIT_COLORBAR_X if split else COLORBAR["x"]
            for axis, title, domain in zip((layout.xaxis, layout.xaxis2), layout.annotations[:2],
                                           (heat_domain, shared_domain), strict=True):
                axis.domain, title.x = domain, sum(domain) / 2
        if not split:  # outside a batch: there, a removed axis would stay behind as an empty one
            self.figure.data = self.figure.data[:BASE_TRACES]
            layout.xaxis3 = None
            return
        layout.xaxis3 = {"domain": SPLIT_DOMAINS[2], "anchor": "y", "title": {"text": "router logit"},
                         "zerolinecolor": "#555", "tickfont": {"size": FONT_PX}}
        hover = ("layer %{y}<br>expert %{customdata[0]} (picked #%{customdata[1]})<br>logit %{customdata[2]:.3f} "
                 "= x·W %{customdata[3]:.3f} + bias %{customdata[4]:.3f}<extra></extra>")
        for name, colour in (("x·W: the token through the router", XW_COLOUR),
                             ("router bias (hatched: negative, drawn back over x·W)", BIAS_COLOUR)):
            self.figure.add_trace(go.Bar(x=[], y=[], orientation="h", xaxis="x3", yaxis="y", name=name,
                                         marker={"color": colour, "line": {"width": 0}}, hovertemplate=hover))

    def _draw_split(self, record, split: dict[int, tuple[np.ndarray, np.ndarray]], labels: list[str]) -> None:
        """The picked experts' logits of each layer with a bias, rank #1 on top in its row: x.W from 0, then the
        bias from x.W to the recorded logit (hatched where it is negative and so covers the end of x.W)."""
        xw_bars, bias_bars = self.figure.data[BASE_TRACES:]
        rows: dict[str, list] = {"y": [], "offset": [], "width": [], "xw": [], "bias": [], "data": []}
        for label, layer in zip(labels, sorted(record.layers), strict=True):
            if layer not in split:
                continue
            ids = self.marked[layer]
            width = BAR_SPAN / len(ids)
            xw, logits = split[layer]
            for rank, e in enumerate(ids):
                rows["y"].append(label)
                rows["offset"].append(-BAR_SPAN / 2 + rank * width)
                rows["width"].append(width)
                rows["xw"].append(float(xw[e]))
                rows["bias"].append(float(self.biases[layer][e]))
                rows["data"].append([e, rank + 1, float(logits[e]), float(xw[e]), float(self.biases[layer][e])])
        for bars, x, base in ((xw_bars, rows["xw"], 0.0), (bias_bars, rows["bias"], rows["xw"])):
            bars.update(x=x, y=rows["y"], base=base, offset=rows["offset"], width=rows["width"],
                        customdata=rows["data"])
        bias_bars.marker.pattern.shape = ["/" if b < 0 else "" for b in rows["bias"]]  # the logit is where it ends

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
        if layer in self.biases:
            xw, logits = logit_parts(record.layers[layer], self.biases[layer], layer)
            rank += logit_text(xw[expert], logits[expert], self.biases[layer][expert]).replace("<br>", ", ")
        self.readout.value = (f"<b>layer {layer}, expert {expert}</b>: router probability {probs[expert]:.3f}"
                              f"{rank} (token {html.escape(shown(record.input_text))}, position {record.position})")

    def _ipython_display_(self):
        show(self.widget, [self.figure])
