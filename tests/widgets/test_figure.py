import json

from moebench.widgets.figure import LiveFigure
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
