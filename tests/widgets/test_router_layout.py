"""The router view as drawn by plotly.js in Chromium, measured (issue 56: gpt-oss's logit panel was cut off on the
right, its colour bar a sliver beside two MoE layers, its legend over the axis title; an 8-expert model's top-k boxes
were small in their cells): at 8 to 128 experts, with and without a router bias, every part lies inside the figure,
the figure fits a notebook's width, the colour bar is long enough for its labels, the legend meets no axis title or
tick label, and each top-k box outlines its cell."""

from __future__ import annotations

import pytest
from widget_inputs import biased_step

from moebench.widgets.router import BOX_MIN_PX, RouterView

NOTEBOOK_WIDTH_PX = 1050  # a JupyterLab output area at a 1280 px wide window, the file browser closed

DRAW_JS = """async (figure) => {
    const el = document.createElement('div');
    document.body.replaceChildren(el);
    await Plotly.newPlot(el, figure.data, figure.layout);
    const box = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
    const all = (selector) => [...el.querySelectorAll(selector)].map(box);
    const heat = el.querySelector('.draglayer .xy .nsewdrag');
    return {
        figure: box(el.querySelector('.main-svg')), heat: box(heat),
        parts: [...all('.colorbar'), ...all('.legend'), ...all('.g-xtitle, .g-x2title, .g-x3title, .g-ytitle'),
                ...all('.annotation'), ...all('.xaxislayer-above text'), ...all('.gtitle')],
        colorbar: all('.colorbar .cbfills'), colorbar_ticks: el.querySelectorAll('.colorbar .cbaxis text').length,
        legend: all('.legend .bg'), titles: all('.g-xtitle, .g-x2title, .g-x3title, .xaxislayer-above text'),
        boxes: all('.subplot.xy .scatterlayer .trace:first-child .points path'),
    };
}"""


def inside(part, outer, slack=0.5) -> bool:
    return (outer[0] - slack <= part[0] and outer[1] - slack <= part[1] and part[2] <= outer[2] + slack
            and part[3] <= outer[3] + slack)


def overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@pytest.mark.parametrize("n, layers, top_k, bias", [(8, 2, 2, True), (8, 2, 2, False), (8, 4, 2, False),
                                                    (32, 24, 4, True), (64, 4, 4, False), (128, 36, 4, True)],
                         ids=["gpt-oss-tiny", "8-experts-2-layers", "qwen3.5-tiny", "gpt-oss-20b", "shipped",
                              "gpt-oss-120b"])
def test_every_part_is_inside_the_figure_readable_and_apart(plotly_page, n, layers, top_k, bias):
    record, biases = biased_step(n, layers, top_k, seed=n + layers)
    view = RouterView()
    view.biases = biases if bias else {}
    view.show(record)
    drawn = plotly_page.evaluate(DRAW_JS, view.figure.to_plotly_json())
    figure = drawn["figure"]
    assert figure[2] - figure[0] <= NOTEBOOK_WIDTH_PX, figure
    assert all(inside(part, figure) for part in drawn["parts"]), drawn
    (bar,) = drawn["colorbar"]
    assert bar[3] - bar[1] >= 100 and drawn["colorbar_ticks"] >= 3, drawn
    assert not [(legend, title) for legend in drawn["legend"] for title in drawn["titles"] if overlap(legend, title)]
    assert bool(drawn["legend"]) == bias  # the bars' legend, where the logit panel is drawn
    heat = drawn["heat"]
    column, row = (heat[2] - heat[0]) / n, (heat[3] - heat[1]) / layers
    assert len(drawn["boxes"]) == top_k * layers
    side = min(column, row)
    for left, top, right, bottom in drawn["boxes"]:  # each box fills most of its cell and stays in it (or, in cells
        assert right - left >= min(0.75 * side, BOX_MIN_PX), (right - left, column, row)  # too narrow, keeps its least
        assert max(right - left, bottom - top) <= max(side, BOX_MIN_PX) + 0.5, (right - left, column, row)  # size)
