"""Token-mixing view: which layers of a hybrid are linear attention and which full, and what their gates and states
did on one token.

A hybrid (Qwen3-Next, Qwen3.5-MoE) records each layer's kind and its token mixing's values (moebench.models.hooks'
`mixer` names). The view labels every recorded layer linear or full in a strip, and draws per layer (rows) and
head (columns): the norm of each value head's delta state after the token, the decay g it was multiplied by, the
write strength beta, and the output gate averaged over each head (silu(z) on a linear layer, sigmoid(gate) on a
full one). Decay and beta lie in (0, 1) and share that fixed scale; the state norms and the output gate are scaled
to the token shown. A model whose layers all attend records none of this: the view says so in one line.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np
from plotly.subplots import make_subplots

from ..inspect.record import mixer_text
from ..models import hooks
from .figure import LiveFigure, json_grid, layer_rows
from .static import live_mark, show
from .text import shown

# (what each panel draws, its title, its colour range: None scales it to the token)
PANELS = ((hooks.STATE_NORM, "state norm", None),
          (hooks.DECAY, "decay g", (0.0, 1.0)),
          (hooks.BETA, "beta", (0.0, 1.0)),
          (hooks.OUTPUT_GATE, "output gate", None))
KIND_COLOURS = {"linear_attention": "#c7e9c0", "full_attention": "#fdd0a2"}
NO_MIXER = ("This model's layers all use attention (no linear-attention layers): there is no token-mixing state to "
            "show.")
WAITING = "Decode a prompt to see each layer's token mixing."


def layer_kinds(record) -> dict[int, str]:
    """Layer -> 'linear_attention' or 'full_attention' for every recorded layer of a hybrid (empty otherwise)."""
    return {layer: r.mixer_kind for layer, r in sorted(record.layers.items()) if r.mixer_kind is not None}


def layer_label(layer: int, kind: str) -> str:
    return f"layer {layer} · {mixer_text(kind).split()[0]}"


def head_values(layer_record, name: str) -> np.ndarray | None:
    """One panel's values for one layer [heads] (the output gate averaged over each head), None where absent."""
    return layer_record.output_gate_means if name == hooks.OUTPUT_GATE else getattr(layer_record, name)


def panel_grid(record, layers: list[int], name: str) -> np.ndarray:
    """[layers, heads] of one panel, NaN where a layer has no such value or fewer heads."""
    rows = [head_values(record.layers[layer], name) for layer in layers]
    width = max((len(r) for r in rows if r is not None), default=0)
    grid = np.full((len(layers), width), np.nan)
    for i, row in enumerate(rows):
        if row is not None:
            grid[i, : len(row)] = row
    return grid


def strip_html(kinds: dict[int, str]) -> str:
    """The layer strip: one coloured label per recorded layer, saying linear or full."""
    cells = "".join(
        f"<span class='moebench-mixer-kind' data-layer='{layer}' data-kind='{kind}' style='display:inline-block;"
        f"padding:1px 6px;margin:1px;border-radius:3px;background:{KIND_COLOURS.get(kind, '#eee')}'>"
        f"{html.escape(layer_label(layer, kind))}</span>" for layer, kind in kinds.items())
    legend = ", ".join(f"<span style='background:{c};padding:0 4px'>{html.escape(mixer_text(k))}</span>"
                       for k, c in KIND_COLOURS.items())
    return f"<div style='font-size:12px'>token mixing per layer ({legend}): {cells}</div>"


class MixingView:
    """`view.show(record)` (a StepRecord): the layer strip and the per-head panels of a hybrid's token mixing."""

    def __init__(self):
        self.record = None
        self.kinds: dict[int, str] = {}
        self.strip = widgets.HTML()
        self.note = widgets.HTML(f"<i>{WAITING}</i>")
        fig = make_subplots(rows=1, cols=len(PANELS), subplot_titles=[p[1] for p in PANELS], horizontal_spacing=0.08)
        for col, (name, _, limits) in enumerate(PANELS, start=1):
            fig.add_heatmap(z=[], name=name, colorscale="Viridis", zmin=limits[0] if limits else None,
                            zmax=limits[1] if limits else None, row=1, col=col,
                            colorbar={"x": fig.layout[f"xaxis{col if col > 1 else ''}"].domain[1] + 0.005,
                                      "thickness": 8, "len": 0.9},
                            hovertemplate="%{y}, head %{x}: %{z:.4g}<extra>" + name + "</extra>")
        fig.update_layout(height=320, margin={"l": 130, "r": 30, "t": 100, "b": 40}, title={"x": 0},
                          modebar={"orientation": "v"})
        for col in range(2, len(PANELS) + 1):
            fig.update_yaxes(showticklabels=False, row=1, col=col)  # the first panel's rows: set in show()
        fig.update_xaxes(title_text="head", dtick=1)
        self.figure = LiveFigure(fig)
        self._axes(False, WAITING)
        # The figure stays in the widget tree once shown, folded away while there is nothing to draw: a plotly view
        # taken out of the tree keeps its handlers, and the next update then threw in the browser (a switch from a
        # hybrid to a model whose layers all attend).
        self.header = widgets.VBox([self.note])
        self.holder = widgets.Box([self.figure])
        self.widget = widgets.VBox([self.header, self.holder, live_mark()])
        self.widget.add_class("moebench-mixing-view")
        self._fold(True)

    def _fold(self, folded: bool) -> None:
        """Fold the figure away (no height, not drawn over, still laid out at its width) or open it."""
        self.holder.layout.visibility = "hidden" if folded else "visible"
        self.holder.layout.max_height = "0px" if folded else None
        self.holder.layout.overflow = "hidden" if folded else None

    def _axes(self, drawn: bool, title: str) -> None:
        """The panels' axes shown (a hybrid's step drawn) or hidden under `title` alone: the static picture a saved
        notebook keeps then says why there is no chart, instead of showing four empty panels."""
        with self.figure.batch_update():
            self.figure.update_xaxes(visible=drawn)
            self.figure.update_yaxes(visible=drawn)
            for annotation in self.figure.layout.annotations:  # the panels' titles
                annotation.visible = drawn
            self.figure.layout.title.text = title

    def show(self, record) -> None:
        """Draw one step record; a model without token-mixing records gets the one-line note instead."""
        self.record, self.kinds = record, layer_kinds(record)
        if not self.kinds:
            self.note.value = f"<i>{NO_MIXER}</i>"
            self.header.children = [self.note]
            self._fold(True)
            if self.figure.layout.title.text != NO_MIXER:
                with self.figure.batch_update():
                    for trace in self.figure.data:
                        trace.z, trace.y = [], []
                    self._axes(False, NO_MIXER)
            return
        self.strip.value = strip_html(self.kinds)
        layers = list(self.kinds)
        labels = [layer_label(layer, kind) for layer, kind in self.kinds.items()]
        with self.figure.batch_update():
            for trace, (name, _, _) in zip(self.figure.data, PANELS, strict=True):
                trace.z, trace.y = json_grid(panel_grid(record, layers, name)), labels
            layer_rows([self.figure.layout[f"yaxis{c if c > 1 else ''}"] for c in range(1, len(PANELS) + 1)], labels)
            self._axes(True, f"token {shown(record.input_text)} (position {record.position}): token mixing per layer "
                             "and head<br><sub>state norm: after the token; output gate: mean over the head</sub>")
        self.header.children = [self.strip]
        self._fold(False)

    def _ipython_display_(self):
        show(self.widget, [self.figure])
