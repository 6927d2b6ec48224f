"""Expert-load heatmap over a whole prompt: which share of the tokens each layer sent to each expert.

Several named loads (e.g. code and prose) sit one above the other on one colour scale, the colour bar
marking the uniform share 1/E (every expert equally busy); with exactly two loads a third panel shows
their difference on a diverging scale centred on zero, so a difference in routing between two kinds of
text shows as colour. Which way that difference points, which colour each side gets and what the colour
bar says about it all come from one place (SignKey). From 60 to 512 experts the columns stay readable:
tick labels thinned to the width, columns by id, busiest first or by the difference (figure.ExpertAxis),
hover and click naming the expert. Loads are trace_stats.load frames.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import ipywidgets as widgets
import numpy as np
import pandas as pd
from plotly.colors import diverging
from plotly.subplots import make_subplots

from .figure import ExpertAxis, LiveFigure, axis_pixels, go, ordered
from .static import live_mark, show

TITLE = "expert load: share of each layer's top-k selections that went to each expert"
GAP_PX = 70  # between panels: the expert ticks of one and the title of the next
FONT_PX = 10  # the expert ticks' font size
COLORBAR_PX = 150  # the right margin: room for the colour bars and their labels


@dataclass(frozen=True)
class SignKey:
    """`first` minus `second`: positive means `first` sends more of its selections to the expert.

    The difference panel's data (`of`), its colours (`colorscale`: positive at the top, red) and its colour
    bar's words (`colorbar`) are all built here, so the legend cannot contradict the data.
    """

    first: str
    second: str
    # plotly's RdBu runs red to blue; reversed, the scale's bottom (negative) is blue and its top (positive) red
    COLOURS = tuple(reversed(diverging.RdBu))

    @property
    def title(self) -> str:
        return f"{self.first} minus {self.second}"

    def of(self, grids: dict[str, pd.DataFrame]) -> pd.DataFrame:
        return grids[self.first].sub(grids[self.second], fill_value=0.0)

    def meaning(self, value: float) -> str:
        """What a difference of `value` says, in words."""
        if value == 0:
            return "both the same"
        return f"{self.first if value > 0 else self.second} uses it more"

    def colorscale(self) -> list[list]:
        stops = np.linspace(0, 1, len(self.COLOURS))
        return [[float(s), c] for s, c in zip(stops, self.COLOURS, strict=True)]

    def colorbar(self, reach: float) -> dict:
        """The colour bar of a scale from -reach to +reach: each end labelled with what it means."""
        return {"title": {"text": self.title}, "tickvals": [-reach, 0.0, reach],
                "ticktext": [f"{-reach:+.2g} {self.meaning(-1)}", "0 same", f"{reach:+.2g} {self.meaning(1)}"]}


def beside(fig, first: int, last: int) -> dict:
    """Colour bar placement spanning panels `first`..`last` (rows), so two bars keep the panels' gap between them."""
    top = fig.layout["yaxis" if first == 1 else f"yaxis{first}"].domain[1]
    bottom = fig.layout["yaxis" if last == 1 else f"yaxis{last}"].domain[0]
    return {"y": top, "yanchor": "top", "len": top - bottom, "tickfont": {"size": 11}}


def panel_height(panels: int, layers: int) -> int:
    """The figure's height in pixels: 22 a layer per panel, plus room for ticks and titles."""
    return 160 + panels * (GAP_PX + 22 * layers)


class ExpertLoadMap:
    """`ExpertLoadMap({"code": trace_stats.load(code_trace), "prose": trace_stats.load(prose_trace)})`.

    `order`: "id", "load" (busiest first over every panel) or, for two loads, "difference" (the first's
    experts left, the second's right). A clicked cell is kept in `picked` as (layer, expert).
    """

    def __init__(self, loads: dict[str, pd.DataFrame], title: str = TITLE, order: str = "id"):
        if not loads:
            raise ValueError("give at least one named load")
        self.names = list(loads)
        self.key = SignKey(*self.names) if len(loads) == 2 else None
        orders = [("expert id", "id"), ("busiest first", "load")]
        if self.key is not None:
            orders.append((f"by {self.key.title}", "difference"))
        if order not in dict(orders).values():
            raise ValueError(f"order must be one of {[v for _, v in orders]}, got {order!r}")
        titles = [*self.names, self.key.title] if self.key else self.names
        rows = len(titles)
        layers = max(load["layer"].nunique() for load in loads.values())
        fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=GAP_PX / panel_height(rows, layers),
                            subplot_titles=titles)
        # No cells until the loads are drawn: plotly cannot draw a cell on a category axis without categories
        for row, _ in enumerate(self.names, start=1):
            fig.add_trace(go.Heatmap(z=[], coloraxis="coloraxis",
                                     hovertemplate="layer %{y}<br>expert %{customdata}<br>share %{z:.3g}"
                                                   "<extra></extra>"),
                          row=row, col=1)
        if self.key:
            fig.add_trace(go.Heatmap(z=[], coloraxis="coloraxis2",
                                     hovertemplate=f"layer %{{y}}<br>expert %{{customdata}}<br>{self.key.title} "
                                                   "%{z:+.3g}<extra></extra>"),
                          row=rows, col=1)
        for row in range(1, rows + 1):
            fig.update_xaxes(tickfont={"size": FONT_PX}, showticklabels=True, row=row, col=1)
            fig.update_yaxes(title_text="MoE layer", autorange="reversed", type="category", row=row, col=1)
        fig.update_layout(title={"text": title, "x": 0}, margin={"l": 70, "r": COLORBAR_PX, "t": 90, "b": 50},
                          width=900, modebar={"orientation": "v"},
                          coloraxis={"colorscale": "Viridis", "colorbar": {"title": {"text": "share"},
                                                                           **beside(fig, 1, len(self.names))}})
        if self.key:
            fig.update_layout(coloraxis2={"colorscale": self.key.colorscale(), "colorbar": beside(fig, rows, rows)})
        self.figure = LiveFigure(fig)
        for trace in self.figure.data:
            trace.on_click(self._clicked)
        self.grids: dict[str, pd.DataFrame] = {}
        self.difference: pd.DataFrame | None = None
        self.axis: ExpertAxis | None = None
        self.picked: tuple[int, int] | None = None
        self.order = widgets.ToggleButtons(options=orders, value=order, description="experts",
                                           style={"button_width": "auto"})
        self.order.observe(self._draw, names="value")
        self.readout = widgets.HTML("<i>hover a cell for its expert; click it to note it here</i>")
        self.widget = widgets.VBox([self.order, self.figure, self.readout, live_mark()])
        self.update(loads)

    def update(self, loads: dict[str, pd.DataFrame]) -> None:
        if list(loads) != self.names:
            raise ValueError(f"loads must be named {self.names}, got {list(loads)}")
        grids = {name: load.pivot(index="layer", columns="expert", values="fraction") for name, load in loads.items()}
        n_experts = max(int(grid.columns.max()) + 1 for grid in grids.values())
        self.grids = {name: grid.reindex(columns=range(n_experts)).fillna(0.0) for name, grid in grids.items()}
        self.difference = self.key.of(self.grids) if self.key else None
        self._draw()

    def expert_axis(self) -> ExpertAxis:
        """The columns: by id, busiest first over every load, or by the summed difference (first's side left)."""
        n = next(iter(self.grids.values())).shape[1]
        weights = {"id": None, "load": sum(grid.to_numpy().sum(axis=0) for grid in self.grids.values())}
        if self.difference is not None:
            weights["difference"] = self.difference.to_numpy().sum(axis=0)
        return ExpertAxis(ordered(weights[self.order.value], n), axis_pixels(self.figure.layout), FONT_PX)

    def _draw(self, _change=None) -> None:
        axis = self.axis = self.expert_axis()
        n_experts = axis.n
        uniform = 1.0 / n_experts
        top = max(float(grid.to_numpy().max()) for grid in self.grids.values())
        near = 0.1 * top  # closer than this to the uniform mark, a tick's label would overlap it
        ticks = sorted({uniform, *(t for t in (float(f"{t:.2g}") for t in np.linspace(0, top, 5))
                                   if abs(t - uniform) > near)})
        panels = [*self.grids.values(), *([self.difference] if self.difference is not None else [])]
        with self.figure.batch_update():
            for trace, grid in zip(self.figure.data, panels, strict=True):
                trace.z = grid.to_numpy()[:, axis.ids]
                trace.y = [f"L{layer}" for layer in grid.index]
                trace.x = list(range(n_experts))
                trace.customdata = np.broadcast_to(axis.ids, (len(grid), n_experts)).tolist()
            self.figure.update_xaxes(range=axis.span(), **axis.ticks())
            self.figure.update_xaxes(title_text="expert id" + ("" if self.order.value == "id" else
                                                               f" ({self.order.label})"), row=len(panels), col=1)
            if self.key:
                reach = float(np.abs(self.difference.to_numpy()).max()) or 1.0
                self.figure.layout.coloraxis2.update(cmin=-reach, cmax=reach, colorbar=self.key.colorbar(reach))
            share = self.figure.layout.coloraxis
            share.cmin, share.cmax = 0, top
            share.colorbar.tickvals = ticks
            share.colorbar.ticktext = [f"uniform 1/{n_experts}" if t == uniform else f"{t:.2g}" for t in ticks]
            self.figure.layout.height = panel_height(len(panels), max(len(g) for g in self.grids.values()))

    def _clicked(self, _trace, points, _state) -> None:
        """A click on a cell: note its layer and expert (the real id) with every panel's value below."""
        if not points.xs or self.axis is None:
            return
        layer, expert = int(str(points.ys[0]).removeprefix("L")), self.axis.id_at(points.xs[0])
        self.picked = (layer, expert)
        parts = [f"{html.escape(name)} {grid.at[layer, expert]:.3g}" for name, grid in self.grids.items()
                 if layer in grid.index]
        if self.key is not None and layer in self.difference.index:
            value = float(self.difference.at[layer, expert])
            parts.append(f"{html.escape(self.key.title)} {value:+.3g} ({html.escape(self.key.meaning(value))})")
        self.readout.value = f"<b>layer {layer}, expert {expert}</b>: " + ", ".join(parts)

    def _ipython_display_(self):
        show(self.widget, [self.figure])
