"""Expert view: what each selected expert contributed to one token at one MoE layer.

For each of the top-k experts: its router score, the size of its own output, and the size of what it
added to the residual stream (score x output). The shared expert's gated contribution is drawn beside
them for scale. Given the model, each expert's output is also read through the final norm and the
unembedding (trace_stats.expert_logit_lens on this one record): which tokens does it push up?
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np

from ..inspect.record import Trace
from ..inspect.trace_stats import expert_logit_lens
from .figure import LiveFigure, go
from .static import live_mark, show
from .text import shown, visible


def contributions(layer) -> list[dict]:
    """Per selected expert (by score): id, score, |output|, |score * output|; then the shared expert if any."""
    rows = []
    for rank, (eid, score, out) in enumerate(zip(layer.topk_ids, layer.topk_scores, layer.expert_out, strict=True)):
        norm = float(np.linalg.norm(out))
        rows.append({"name": f"expert {int(eid)} (#{rank + 1})", "expert": int(eid), "score": float(score),
                     "output_norm": norm, "contribution_norm": abs(float(score)) * norm})
    if layer.shared_gate is not None:
        norm = float(np.linalg.norm(layer.shared_out))
        rows.append({"name": "shared expert", "expert": None, "score": float(layer.shared_gate), "output_norm": norm,
                     "contribution_norm": float(layer.shared_gate) * norm})
    return rows


class ExpertView:
    """`view.show(record)`; a dropdown picks the MoE layer. With `model`, a table of each expert's top tokens."""

    def __init__(self, model=None, tokenizer=None, top: int = 5):
        self.model, self.tokenizer, self.top = model, tokenizer, top
        self.top_tokens = None
        self.record = None
        self.rows: list[dict] = []
        self.layer = widgets.Dropdown(description="MoE layer", options=[], layout=widgets.Layout(width="200px"))
        self.layer.observe(lambda _: self._draw(), names="value")
        self.figure = LiveFigure(layout=go.Layout(
            barmode="group", height=340, margin={"l": 60, "r": 40, "t": 70, "b": 90}, title={"x": 0},
            yaxis={"title": "vector length (L2 norm)"}, legend={"orientation": "h", "y": -0.3},
            modebar={"orientation": "v"},
        ))
        self.figure.add_bar(name="expert output |y_e|", marker_color="#9ecae1")
        self.figure.add_bar(name="added to the residual |score x y_e|", marker_color="#08519c")
        self.tokens = widgets.HTML()
        self.widget = widgets.VBox([self.layer, self.figure, self.tokens, live_mark()])
        self.widget.add_class("moebench-expert-view")

    def show(self, record) -> None:
        self.record = record
        layers = sorted(record.layers)
        if list(self.layer.options) != layers:
            self.layer.options = layers
        if self.layer.value is None and layers:
            self.layer.value = layers[0]
        self._draw()

    def _draw(self) -> None:
        if self.record is None or self.layer.value is None:
            return
        layer = self.record.layers[self.layer.value]
        self.rows = contributions(layer)
        names = [r["name"] for r in self.rows]
        with self.figure.batch_update():
            raw, added = self.figure.data
            raw.x, raw.y = names, [r["output_norm"] for r in self.rows]
            added.x, added.y = names, [r["contribution_norm"] for r in self.rows]
            added.text = [f"{'gate' if r['expert'] is None else 'score'} {r['score']:.3f}" for r in self.rows]
            self.figure.layout.title.text = (f"token {shown(self.record.input_text)} (position "
                                             f"{self.record.position}), layer {self.layer.value}: what each chosen "
                                             "expert added")
        self.tokens.value = self._token_table() if self.model is not None else ""

    def _token_table(self) -> str:
        one = Trace(prompt_ids=[], steps=[self.record])
        lens = expert_logit_lens(self.model, one, self.tokenizer, top=self.top)
        self.top_tokens = lens[lens["layer"] == self.layer.value]
        cells = []
        for row in self.rows[: len(self.record.layers[self.layer.value].topk_ids)]:
            mine = self.top_tokens[self.top_tokens["expert"] == row["expert"]].sort_values("rank")
            pushed = ", ".join(f"<code>{html.escape(visible(t))}</code> ({v:+.2f})"
                               for t, v in zip(mine["text"], mine["logit"], strict=True))
            cells.append(f"<tr><td><b>{html.escape(row['name'])}</b></td><td>{pushed}</td></tr>")
        return ("<div style='font-size:13px'>tokens each chosen expert's output pushes up most (its output through "
                "the final norm and the unembedding; logit in brackets):<table>" + "".join(cells) + "</table></div>")

    def _ipython_display_(self):
        show(self.widget, [self.figure])
