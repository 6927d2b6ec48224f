"""Every state a LiveFigure passes through, drawn by plotly.js in Chromium as a notebook's view would draw it.

A view of a figure may open at any point of the figure's updates (JupyterLab renders an output when it gets to
it, and the kernel may have sent some updates by then): it draws the state it is given, then applies each
later update as it comes. `recording` keeps, for every LiveFigure made inside it, the first state and each
update message as the kernel sends it (each checked to be JSON the kernel can send); `replay_errors` draws every
figure from every point of its log, applies the rest, and returns what plotly threw.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import plotly
from plotly.basedatatypes import Undefined
from plotly.serializers import custom_serializers

from moebench.widgets.figure import UPDATES, LiveFigure

PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"

# Runs in the page: for each figure and each start k, the state after k updates (applied to a scratch plot) is
# drawn afresh, as a view opening then would draw it, and the updates after k are applied to it as plotly's widget
# applies them. "_undefined_" is how the kernel says "this trace keeps its value" (plotly's widget reads it so).
REPLAY_JS = """async (figures) => {
    const undef = (v) => Array.isArray(v) ? v.map(undef)
        : (v && typeof v === 'object') ? Object.fromEntries(Object.entries(v).map(([k, x]) => [k, undef(x)]))
        : (v === '_undefined_' ? undefined : v);
    const copy = (v) => JSON.parse(JSON.stringify(v));
    const apply = async (el, [name, m]) => {
        if (name === '_py2js_update') await Plotly.update(el, m.style_data, m.layout_data, m.style_traces);
        else if (name === '_py2js_restyle') await Plotly.restyle(el, m.restyle_data, m.restyle_traces);
        else if (name === '_py2js_relayout') await Plotly.relayout(el, m.relayout_data);
        else if (name === '_py2js_addTraces') await Plotly.addTraces(el, m.trace_data);
        else if (name === '_py2js_deleteTraces') await Plotly.deleteTraces(el, m.delete_inds);
        else throw new Error('no replay for ' + name);
    };
    const errors = [];
    for (const figure of undef(figures)) {
        for (let k = 0; k <= figure.updates.length; k++) {
            const scratch = document.createElement('div');
            const view = document.createElement('div');
            document.body.append(scratch, view);
            const where = `${figure.name}, opened after ${k} of ${figure.updates.length} updates`;
            try {
                const layout = copy(figure.layout);
                layout.height ??= 360;  // as plotly's widget does for a layout without one
                await Plotly.newPlot(scratch, copy(figure.data), layout);
                for (const update of figure.updates.slice(0, k)) await apply(scratch, update);
                await Plotly.newPlot(view, copy(scratch.data), copy(scratch.layout));
            } catch (e) { errors.push(`${where}: drawing it: ${e}`); }
            for (const [i, update] of figure.updates.entries()) {
                if (i < k) continue;
                try { await apply(view, update); }
                catch (e) { errors.push(`${where}: update ${i} (${update[0]}): ${e}`); }
            }
            Plotly.purge(scratch); Plotly.purge(view); scratch.remove(); view.remove();
        }
    }
    return errors;
}"""


def _plain(value):
    """What the kernel's message says, as JSON: arrays as lists, plotly's 'unchanged' as its marker."""
    if value is Undefined:
        return "_undefined_"
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot send {type(value).__name__} to the page")


def as_json(value):
    return json.loads(json.dumps(value, default=_plain))


def sendable(name: str, value) -> None:
    """Fails unless the kernel can send `value` as JSON, as plotly's widget serializes it (numpy arrays as binary
    buffers, lists as JSON, which has no NaN or infinity: jupyter_client would warn "Message serialization failed")."""
    def binary(v):
        if isinstance(v, memoryview):
            return "<buffer>"
        raise TypeError(f"cannot send {type(v).__name__}")

    try:
        json.dumps(custom_serializers["to_json"](value, None), allow_nan=False, default=binary)
    except ValueError as e:
        raise AssertionError(f"{name} is not JSON compliant ({e}): {str(value)[:300]}") from e


@contextmanager
def recording(monkeypatch):
    """Yields a list that gets, for every LiveFigure made inside the block, its first state and every update
    message the kernel sends it afterwards."""
    figures: list[dict] = []
    made = LiveFigure.__init__

    def init(figure, *args, **kwargs):
        made(figure, *args, **kwargs)
        sendable("the first state", [figure._widget_data, figure._widget_layout])
        entry = {"name": f"figure {len(figures)}", "data": as_json(figure._widget_data),
                 "layout": as_json(figure._widget_layout), "updates": []}
        figures.append(entry)

        def sent(change):
            if change["new"] is not None:
                sendable(change["name"], change["new"])
                entry["updates"].append([change["name"], as_json(change["new"])])

        figure.observe(sent, names=list(UPDATES))

    with monkeypatch.context() as patch:
        patch.setattr(LiveFigure, "__init__", init)
        yield figures


def replay_errors(page, figures: list[dict]) -> list[str]:
    return page.evaluate(REPLAY_JS, figures)
