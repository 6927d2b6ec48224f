import json

import numpy as np
import pytest

from moebench.widgets.figure import CHAR_PX, NICE_STEPS, TICK_GAP_PX, ExpertAxis, LiveFigure, ordered, tick_step
from moebench.widgets.static import HIDE_CSS, LIVE_CLASS, PLOTLY_MIME, Snapshot


def test_the_synced_state_follows_updates_so_a_reloaded_tab_draws_the_figure_as_it_is():
    figure = LiveFigure(data=[{"type": "bar", "x": [], "y": []}])
    with figure.batch_update():
        figure.data[0].x, figure.data[0].y = ["a", "b"], [1, 2]
        figure.layout.title.text = "now"
    assert list(figure._widget_data[0]["x"]) == ["a", "b"] and figure._widget_layout["title"]["text"] == "now"


def test_a_snapshot_is_the_figure_as_plotly_json():
    figure = LiveFigure(data=[{"type": "heatmap", "z": [[1.0, 2.0]]}], layout={"title": {"text": "t"}})
    bundle = Snapshot(figure).bundle()
    json.dumps(bundle)  # plain JSON, numpy arrays encoded
    assert bundle[PLOTLY_MIME]["layout"]["title"]["text"] == "t" and "t" in bundle["text/plain"]
    assert f".{LIVE_CLASS}" in HIDE_CSS and ".jp-RenderedPlotly" in HIDE_CSS


@pytest.mark.parametrize("n", [8, 60, 64, 128, 256, 512])
def test_expert_ticks_are_as_dense_as_the_width_allows_and_never_overlap(n):
    pixels, font = 600.0, 10
    axis = ExpertAxis(np.arange(n), pixels, font)
    ticks = axis.ticks()
    widest = len(str(n - 1)) * CHAR_PX * font
    spacing = axis.step * pixels / n
    assert spacing >= widest + TICK_GAP_PX  # room for the widest label between two ticks
    assert all(s * pixels / n < widest + TICK_GAP_PX for s in NICE_STEPS if s < axis.step)  # and no sparser
    assert ticks["tickvals"][0] == 0 and ticks["ticktext"] == [str(v) for v in ticks["tickvals"]]
    assert len(ticks["tickvals"]) == len(range(0, n, axis.step))
    assert tick_step(n, 10 * pixels, font) <= axis.step  # a wider axis labels at least as densely


def test_a_sorted_axis_keeps_the_real_ids_in_labels_and_clicks():
    weights = np.array([1.0, 5.0, 0.0, 5.0, 3.0])
    axis = ExpertAxis(ordered(weights, 5), pixels=500, font_px=10)
    assert list(axis.ids) == [1, 3, 4, 0, 2]  # heaviest first, ties by id
    assert axis.ticks()["ticktext"] == ["1", "3", "4", "0", "2"]
    assert [axis.id_at(x) for x in (0, 1.2, 4)] == [1, 3, 2] and axis.position[2] == 4
    assert list(ordered(None, 3)) == [0, 1, 2]


def test_the_span_leaves_room_for_a_mark_on_the_first_and_last_expert():
    axis = ExpertAxis(np.arange(512), pixels=512, font_px=10)  # one pixel a column
    low, high = axis.span(mark_px=9)
    assert (0 - low) * axis.column_px >= 4.5 and (high - 511) * axis.column_px >= 4.5
    assert ExpertAxis(np.arange(8), 800, 10).span(mark_px=20) == [-0.5, 7.5]  # marks fit their columns


def test_anywidget_imports_the_small_front_end_and_plotlys_bundle_travels_beside_it():
    """anywidget gives a model's module 2 s to load: the module it imports is moebench's few lines, which load
    plotly's bundle (the figure's own _plotly_esm, synced) once per page, outside that window."""
    import plotly.graph_objects as go

    from moebench.widgets.figure import FRONT_END, plotly_bundle

    fig = LiveFigure()
    state = fig.get_state()
    assert state["_esm"] == FRONT_END and len(FRONT_END) < 4_000
    assert state["_plotly_esm"] == plotly_bundle() == str(go.FigureWidget._esm) and len(plotly_bundle()) > 1_000_000
