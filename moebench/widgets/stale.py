"""A view that measured one model while the picker now holds another says so, and offers to measure again.

Some views do not follow the model picker by themselves because measuring again takes long (a benchmark, routing
drift against variants that mlx-lm has to make): after another model is picked they keep showing the last
measurement, with one line over it naming the model it came from and the one picked, and the button that measures
the picked one. The line is hidden while the view shows the picked model.
"""

from __future__ import annotations

import html
from collections.abc import Callable

import ipywidgets as widgets


class StaleNote:
    """`note.show(shown, picked)` after another model is picked, `note.hide()` once the view shows it; the button
    calls `rerun` (the view's own run, queued on the notebook's thread by the view; settable until shown)."""

    def __init__(self, what: str, action: str, rerun: Callable[[], None] | None = None):
        self.what, self.action, self.rerun = what, action, rerun
        self.text = widgets.HTML()
        self.button = widgets.Button(description=action, icon="refresh", button_style="warning",
                                     layout=widgets.Layout(width="auto", flex="0 0 auto"))
        self.button.add_class("moebench-stale-rerun")
        self.button.on_click(lambda _: self.rerun())
        self.widget = widgets.HBox([self.text, self.button], layout=widgets.Layout(display="none"))
        self.widget.add_class("moebench-stale")

    @property
    def shown(self) -> bool:
        return self.widget.layout.display != "none"

    def show(self, shown: str, picked: str) -> None:
        if self.rerun is None:
            raise ValueError("StaleNote.show: set `rerun` first (what its button runs)")
        self.text.value = (f"<span style='color:#8a4b00'><b>{html.escape(self.what)} {html.escape(shown)}</b>; the "
                           f"picker now holds <b>{html.escape(picked)}</b>: press <b>{html.escape(self.action)}</b> "
                           "to measure it</span>")
        self.widget.layout.display = "flex"

    def hide(self) -> None:
        self.widget.layout.display = "none"
