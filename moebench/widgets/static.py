"""Static pictures beside live views, so a saved notebook still shows each chart's last state.

A widget view needs its kernel: reopened after the kernel stopped, JupyterLab shows "Error displaying
widget: model not found". So every live figure also gets an output of its own, a plotly figure as JSON
(`application/vnd.plotly.v1+json`, drawn by the jupyterlab-plotly renderer that plotly installs, with no
kernel), updated in place (display_id) whenever the figure changes. While the live view renders, the
`live_mark` inside it hides those copies with one stylesheet, so a running notebook shows each chart once
(a plain HTML widget: no JavaScript module to load).

Reopened without a kernel, JupyterLab writes "Error displaying widget: model not found" in place of every widget
view: the output keeps that text alone. A plain HTML output beside each view, a stylesheet that needs no kernel,
hides such outputs (and itself), so a saved notebook shows its static pictures and none of those errors. JupyterLab
applies it in a trusted notebook (one the user ran and saved); an untrusted one has its styles removed.
"""

from __future__ import annotations

import json

import ipywidgets as widgets
from IPython.display import display

from .subshell import keep_on_subshell

PLOTLY_MIME = "application/vnd.plotly.v1+json"
LIVE_CLASS = "moebench-live"
# In an output area that holds a rendered live view, hide the outputs after it that jupyterlab-plotly drew.
# Not display:none: the renderer redraws on every update and needs a laid-out width to draw into.
HIDE_CSS = (f".jp-OutputArea-child:has(.{LIVE_CLASS}) ~ .jp-OutputArea-child:has(.jp-RenderedPlotly) "
            "{ max-height: 0; overflow: hidden; visibility: hidden; margin: 0; padding: 0; }")


ORPHAN_CLASS = "moebench-orphan-widgets"
# A widget output whose view never came: JupyterLab marks the output itself jupyter-widgets (a rendered view is a
# child of it) and writes the error in it. Hidden only while no live view is drawn in the page (no kernel holds the
# widgets): with a kernel, a view that failed is shown. (No :has() inside another: Chromium drops such a rule.)
ORPHAN_CSS = (f"body:not(:has(.{LIVE_CLASS})) .jp-OutputArea-child:has(> .jp-OutputArea-output.jupyter-widgets), "
              f".jp-OutputArea-child:has(.{ORPHAN_CLASS}) {{ display: none; }}")


def orphan_style() -> dict:
    """The HTML output that hides widget outputs left without their views (and itself): see the module's doc."""
    return {"text/html": f"<style class='{ORPHAN_CLASS}'>{ORPHAN_CSS}</style>",
            "text/plain": "<style: hides the widget views a reopened notebook cannot show>"}


def live_mark() -> widgets.HTML:
    """An invisible widget whose stylesheet, once a live view renders it, hides that view's static copies."""
    mark = widgets.HTML(f"<style>{HIDE_CSS}</style>", layout=widgets.Layout(display="none"))
    mark.add_class(LIVE_CLASS)
    return mark


class Snapshot:
    """One figure's static picture, as its own output; `update()` redraws it in place."""

    def __init__(self, figure):
        self.figure = figure
        self.handle = None
        figure._snapshot = self

    def bundle(self) -> dict:
        fig = json.loads(self.figure.to_json())  # plotly's encoder: numpy arrays become lists
        return {PLOTLY_MIME: {"data": fig["data"], "layout": fig["layout"], "config": {"displaylogo": False}},
                "text/plain": f"<static picture: {self.title()}>"}

    def title(self) -> str:
        title = self.figure.layout.title.text
        return title or "plotly figure"

    def display(self) -> None:
        self.handle = display(self.bundle(), raw=True, display_id=True)

    def update(self) -> None:
        if self.handle is not None:
            self.handle.update(self.bundle(), raw=True)


def show(widget, figures=()) -> None:
    """Display a live view, then a static picture of each of its figures (each figure: a LiveFigure), after the
    stylesheet that hides the view once no kernel can show it."""
    keep_on_subshell(widget)
    display(orphan_style(), raw=True)
    display(widget)
    for figure in figures:
        snapshot = figure._snapshot or Snapshot(figure)
        snapshot.display()
