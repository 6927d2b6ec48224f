"""Expert-load heatmap over a whole prompt: which share of the tokens each layer sent to each expert.

Several named loads (e.g. code and prose) sit one above the other on one colour scale with a tick per
expert (full width, so 60 experts stay legible), the colour bar marking the uniform share 1/E (every
expert equally busy); with exactly two loads a third panel shows their difference on a diverging scale
centred on zero, so a difference in routing between two kinds of text shows as colour. Loads are
trace_stats.load frames.
"""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np
import pandas as pd
from plotly.subplots import make_subplots

from .figure import LiveFigure, go
from .static import live_mark, show

TITLE = "expert load: share of each layer's top-k selections that went to each expert"
GAP_PX = 70  # between panels: the expert ticks of one and the title of the next


def panel_height(panels: int, layers: int) -> int:
    """The figure's height in pixels: 22 a layer per panel, plus room for ticks and titles."""
    return 160 + panels * (GAP_PX + 22 * layers)


class ExpertLoadMap:
    """`ExpertLoadMap({"code": trace_stats.load(code_trace), "prose": trace_stats.load(prose_trace)})`."""

    def __init__(self, loads: dict[str, pd.DataFrame], title: str = TITLE):
        if not loads:
            raise ValueError("give at least one named load")
        self.names = list(loads)
        self.difference = len(loads) == 2
        titles = [*self.names, f"{self.names[0]} minus {self.names[1]}"] if self.difference else self.names
        rows = len(titles)
        layers = max(load["layer"].nunique() for load in loads.values())
        fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=GAP_PX / panel_height(rows, layers),
                            subplot_titles=titles)
        for row, _ in enumerate(self.names, start=1):
            fig.add_trace(go.Heatmap(z=[[0.0]], coloraxis="coloraxis",
                                     hovertemplate="layer %{y}<br>expert %{x}<br>share %{z:.3f}<extra></extra>"),
                          row=row, col=1)
        if self.difference:
            fig.add_trace(go.Heatmap(z=[[0.0]], coloraxis="coloraxis2",
                                     hovertemplate="layer %{y}<br>expert %{x}<br>difference %{z:+.3f}<extra></extra>"),
                          row=rows, col=1)
        for row in range(1, rows + 1):
            fig.update_xaxes(dtick=1, tickfont={"size": 9}, showticklabels=True, row=row, col=1)
            fig.update_yaxes(title_text="MoE layer", autorange="reversed", type="category", row=row, col=1)
        fig.update_xaxes(title_text="expert id", row=rows, col=1)
        shares = (rows - 1) / rows if self.difference else 1.0
        fig.update_layout(title={"text": title, "x": 0}, margin={"l": 70, "r": 20, "t": 90, "b": 50}, width=900,
                          coloraxis={"colorscale": "Viridis", "colorbar": {"title": {"text": "share"}, "len": shares,
                                                                           "y": 1, "yanchor": "top"}},
                          coloraxis2={"colorscale": "RdBu", "colorbar": {"title": {"text": "difference"},
                                                                         "len": 1 / rows, "y": 0, "yanchor": "bottom"}},
                          modebar={"orientation": "v"})
        self.figure = LiveFigure(fig)
        self.grids: dict[str, pd.DataFrame] = {}
        self.widget = widgets.VBox([self.figure, live_mark()])
        self.update(loads)

    def update(self, loads: dict[str, pd.DataFrame]) -> None:
        if list(loads) != self.names:
            raise ValueError(f"loads must be named {self.names}, got {list(loads)}")
        self.grids = {name: load.pivot(index="layer", columns="expert", values="fraction").fillna(0.0)
                      for name, load in loads.items()}
        n_experts = max(grid.shape[1] for grid in self.grids.values())
        uniform = 1.0 / n_experts
        top = max(float(grid.to_numpy().max()) for grid in self.grids.values())
        ticks = sorted({0.0, uniform, *np.linspace(0, top, 5)[1:].round(2)})
        with self.figure.batch_update():
            for trace, grid in zip(self.figure.data, self.grids.values(), strict=False):
                trace.z = grid.to_numpy()
                trace.y = [f"L{layer}" for layer in grid.index]
                trace.x = list(grid.columns)
            if self.difference:
                a, b = self.grids.values()
                diff = a.sub(b, fill_value=0.0)
                self.figure.data[-1].z, self.figure.data[-1].x = diff.to_numpy(), list(diff.columns)
                self.figure.data[-1].y = [f"L{layer}" for layer in diff.index]
                reach = float(np.abs(diff.to_numpy()).max()) or 1.0
                self.figure.layout.coloraxis2.cmin, self.figure.layout.coloraxis2.cmax = -reach, reach
            axis = self.figure.layout.coloraxis
            axis.cmin, axis.cmax = 0, top
            axis.colorbar.tickvals = ticks
            axis.colorbar.ticktext = [f"uniform 1/{n_experts}" if t == uniform else f"{t:.2f}" for t in ticks]
            self.figure.layout.height = panel_height(len(self.figure.data), max(len(g) for g in self.grids.values()))

    def _ipython_display_(self):
        show(self.widget, [self.figure])
