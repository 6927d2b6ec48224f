"""Browser events as plotly's FigureWidget receives them from JupyterLab, for the views' unit tests."""

from __future__ import annotations


def click(figure, trace: int, x, y) -> None:
    """A click on the point at (x, y) of trace number `trace`, as the browser reports it to the kernel."""
    figure._js2py_pointsCallback = {
        "event_type": "plotly_click", "device_state": None, "selector": None,
        "points": {"xs": [x], "ys": [y], "point_indexes": [0], "trace_indexes": [trace]},
    }
