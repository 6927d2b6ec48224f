"""Export buttons: a view's records to parquet or CSV (the frames of moebench.inspect.export, one file per
record type, or the named frames a view hands over; in CSV the vectors' lists are JSON text), its figures to HTML
or PNG.

HTML carries plotly.js inside the file, so it opens anywhere without a network. PNG goes through plotly's
kaleido engine, which needs the `kaleido` package and a Chrome or Chromium; without them the button says
so instead of failing.
"""

from __future__ import annotations

import html
import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path

import ipywidgets as widgets

from ..errors import MoebenchError
from ..inspect.export import save_frames, to_frames
from .mainthread import Owner
from .static import show
from .text import error_html


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "figure"


class ExportBar:
    """`ExportBar(lambda: trace, figures, folder)`: buttons that write into `folder` and list what they wrote; the
    callable may instead return named frames ({name: DataFrame}), each written as one file."""

    def __init__(self, trace: Callable[[], object] | None, figures: list, folder: str = "moebench-export"):
        self.trace, self.figures = trace, list(figures)
        self.owner = Owner(on_error=self._failed)
        self.folder = widgets.Text(value=folder, description="folder", layout=widgets.Layout(width="320px"))
        self.written: list[Path] = []
        buttons = []
        if trace is not None:
            buttons += [self._button("records: parquet", lambda: self.records("parquet")),
                        self._button("records: CSV", lambda: self.records("csv"))]
        buttons.append(self._button("figures: HTML", lambda: self.pictures("html")))
        png = self._button("figures: PNG", lambda: self.pictures("png"))
        if importlib.util.find_spec("kaleido") is None:
            png.disabled, png.tooltip = True, "PNG export needs the kaleido package (pip install kaleido)"
        buttons.append(png)
        self.status = widgets.HTML()
        self.status.add_class("moebench-export-status")
        self.widget = widgets.VBox([widgets.HBox([self.folder, *buttons]), self.status])
        self.widget.add_class("moebench-export")

    def _button(self, text: str, action: Callable[[], None]) -> widgets.Button:
        button = widgets.Button(description=text, icon="download", layout=widgets.Layout(width="150px"))
        button.on_click(lambda _: self.owner.submit(action))
        return button

    def records(self, fmt: str) -> list[Path]:
        """The current trace's frames (or the named frames given), one file per record type, as parquet or CSV."""
        if fmt not in ("parquet", "csv"):
            raise MoebenchError(f"ExportBar.records: format {fmt!r} is not 'parquet' or 'csv'")
        folder = Path(self.folder.value) / "records"
        records = self.trace()
        frames = records if isinstance(records, dict) else to_frames(records)
        if fmt == "parquet":
            return self._done(save_frames(frames, folder, "parquet"))
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, frame in frames.items():
            lists = [c for c in frame.columns if frame[c].map(lambda v: isinstance(v, list)).any()]
            path = folder / f"{name}.csv"
            frame.assign(**{c: frame[c].map(json.dumps) for c in lists}).to_csv(path, index=False)
            paths.append(path)
        return self._done(paths)

    def pictures(self, fmt: str) -> list[Path]:
        """Every figure as it is drawn now."""
        folder = Path(self.folder.value)
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for i, figure in enumerate(self.figures):
            path = folder / f"{i:02d}-{slug(figure.layout.title.text or 'figure')}.{fmt}"
            if fmt == "html":
                figure.write_html(path, include_plotlyjs=True)
            else:
                figure.write_image(path)
            paths.append(path)
        return self._done(paths)

    def _done(self, paths: list[Path]) -> list[Path]:
        self.written = paths
        self.status.value = "wrote " + ", ".join(f"<code>{html.escape(str(p))}</code>" for p in paths)
        return paths

    def _failed(self, error: BaseException) -> None:
        self.status.value = error_html(error)

    def _ipython_display_(self):
        show(self.widget)
