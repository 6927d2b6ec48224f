"""LiveFigure: a plotly FigureWidget whose kernel-side state follows every update.

plotly's FigureWidget sends each update to the browser as a one-off message and keeps its synced state
(`_widget_data`, `_widget_layout`) as it was at construction, so a reloaded tab (which asks the kernel for
each widget's state) draws the first, empty figure. LiveFigure copies the figure into that state after
every update without sending it again (the open views applied the update already), and refreshes the
static picture of the figure (static.Snapshot) that a saved notebook keeps.
"""

from __future__ import annotations

import sys
from copy import deepcopy


def _import_plotly_widget():
    """plotly's FigureWidget imports nbformat, whose jsonschema imports the optional rfc3987_syntax, which
    builds a parser grammar for ~10 s on a small CPU. The widgets never validate IRIs: jsonschema is
    imported here without that checker (only when nothing imported jsonschema before)."""
    if "jsonschema" not in sys.modules and "rfc3987_syntax" not in sys.modules:
        sys.modules["rfc3987_syntax"] = None  # an import of it raises ImportError, which jsonschema expects
        try:
            import jsonschema  # noqa: F401
        finally:
            del sys.modules["rfc3987_syntax"]
    import plotly.graph_objects as go

    return go


go = _import_plotly_widget()
UPDATES = ("_py2js_addTraces", "_py2js_restyle", "_py2js_relayout", "_py2js_update", "_py2js_deleteTraces",
           "_py2js_moveTraces", "_py2js_removeLayoutProps", "_py2js_removeTraceProps")
STATE = frozenset({"_widget_data", "_widget_layout"})


class LiveFigure(go.FigureWidget):
    """A FigureWidget that a reloaded browser tab draws as it is now, with a static picture beside it."""

    def __init__(self, *args, **kwargs):
        self._quiet = False
        self._snapshot = None  # a static.Snapshot once the figure is displayed
        super().__init__(*args, **kwargs)
        self.observe(self._updated, names=list(UPDATES))

    def _updated(self, change) -> None:
        if change["new"] is not None:
            return  # plotly sets each message, then None once it is sent
        self._quiet = True
        try:
            self._widget_data = deepcopy(self._data)
            self._widget_layout = deepcopy(self._layout_obj._props)
        finally:
            self._quiet = False
        if self._snapshot is not None:
            self._snapshot.update()

    def _should_send_property(self, key, value):
        if self._quiet and key in STATE:
            return False
        return super()._should_send_property(key, value)
