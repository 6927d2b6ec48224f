"""Expert-load heatmap over a whole prompt: which share of the tokens each layer sent to each expert.

Several named loads (e.g. code and prose) sit side by side on one colour scale, so a difference in
routing between two kinds of text shows as a difference in colour. Loads are trace_stats.load frames.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots


class ExpertLoadMap:
    """`ExpertLoadMap({"code": trace_stats.load(code_trace), "prose": trace_stats.load(prose_trace)})`."""

    def __init__(self, loads: dict[str, pd.DataFrame], title: str = "expert load: share of each layer's top-k "
                 "selections that went to each expert"):
        if not loads:
            raise ValueError("give at least one named load")
        self.names = list(loads)
        fig = make_subplots(rows=1, cols=len(loads), shared_yaxes=True, horizontal_spacing=0.04,
                            subplot_titles=self.names)
        for col, _ in enumerate(self.names, start=1):
            fig.add_trace(go.Heatmap(z=[[0.0]], coloraxis="coloraxis",
                                     hovertemplate="layer %{y}<br>expert %{x}<br>share %{z:.3f}<extra></extra>"),
                          row=1, col=col)
            fig.update_xaxes(title_text="expert id", row=1, col=col)
        fig.update_yaxes(title_text="MoE layer", autorange="reversed", type="category", row=1, col=1)
        fig.update_layout(title=title, coloraxis={"colorscale": "Viridis", "colorbar": {"title": {"text": "share"}}},
                          margin={"l": 70, "r": 20, "t": 90, "b": 50})
        self.figure = go.FigureWidget(fig)
        self.grids: dict[str, pd.DataFrame] = {}
        self.update(loads)

    def update(self, loads: dict[str, pd.DataFrame]) -> None:
        if list(loads) != self.names:
            raise ValueError(f"loads must be named {self.names}, got {list(loads)}")
        self.grids = {name: load.pivot(index="layer", columns="expert", values="fraction").fillna(0.0)
                      for name, load in loads.items()}
        top = max(float(grid.to_numpy().max()) for grid in self.grids.values())
        with self.figure.batch_update():
            for trace, grid in zip(self.figure.data, self.grids.values(), strict=True):
                trace.z = grid.to_numpy()
                trace.y = [f"L{layer}" for layer in grid.index]
                trace.x = list(grid.columns)
            self.figure.layout.coloraxis.cmin = 0
            self.figure.layout.coloraxis.cmax = top
            self.figure.layout.height = 180 + 30 * max(len(grid) for grid in self.grids.values())

    def _ipython_display_(self):
        from IPython.display import display

        display(self.figure)
