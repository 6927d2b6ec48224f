import numpy as np
import pandas as pd
import pytest
from plotly_events import click

from moebench.inspect import trace_stats
from moebench.inspect.record import Stepper
from moebench.widgets.loadmap import ExpertLoadMap


def test_side_by_side_loads_share_one_scale(tiny, trace):
    model, tokenizer = tiny
    prose = Stepper(model, tokenizer, "The quick brown fox jumps", record=True).run(1)
    load_map = ExpertLoadMap({"code": trace_stats.load(trace), "prose": trace_stats.load(prose)})
    layers = sorted(model.moe_blocks())
    for grid in load_map.grids.values():
        assert list(grid.index) == layers and grid.shape[1] == model.args.num_experts
        assert ((grid.sum(axis=1) - 1).abs() < 1e-9).all()
    top = max(g.to_numpy().max() for g in load_map.grids.values())
    assert load_map.figure.layout.coloraxis.cmax == top
    assert [a.text for a in load_map.figure.layout.annotations] == ["code", "prose", "code minus prose"]
    reach = abs(load_map.figure.data[2].z).max()
    assert load_map.figure.layout.coloraxis2.cmin == -reach and load_map.figure.layout.coloraxis2.cmax == reach
    with pytest.raises(ValueError, match="named"):
        load_map.update({"prose": trace_stats.load(prose)})


def load(shares: dict[int, dict[int, float]], n: int) -> pd.DataFrame:
    """A trace_stats.load frame: `shares[layer][expert]`, every other expert 0."""
    return pd.DataFrame([{"layer": layer, "expert": e, "count": 0, "fraction": shares[layer].get(e, 0.0)}
                         for layer in shares for e in range(n)])


def rgb(colour: str) -> tuple[int, ...]:
    return tuple(int(v) for v in colour.removeprefix("rgb(").removesuffix(")").split(","))


def test_the_difference_panel_sign_colours_and_words_agree():
    """Code sends everything to expert 5 and prose to expert 2: expert 5's cell is positive, drawn in the scale's
    top colour (red), and the colour bar's top label says that code uses it more; expert 2 the other way."""
    code, prose = load({0: {5: 1.0}, 1: {5: 0.5, 2: 0.5}}, 8), load({0: {2: 1.0}, 1: {2: 1.0}}, 8)
    load_map = ExpertLoadMap({"code": code, "prose": prose})
    diff = np.asarray(load_map.figure.data[2].z)
    assert diff[0, 5] == 1.0 and diff[0, 2] == -1.0
    axis = load_map.figure.layout.coloraxis2
    scale = axis.colorscale
    assert (axis.cmin, axis.cmax) == (-1.0, 1.0)
    top, bottom = rgb(scale[-1][1]), rgb(scale[0][1])
    assert top[0] > 2 * top[2] and bottom[2] > 2 * bottom[0]  # +1 is drawn red, -1 blue
    ticks = dict(zip(axis.colorbar.tickvals, axis.colorbar.ticktext, strict=True))
    assert ticks[1.0].endswith("code uses it more") and ticks[-1.0].endswith("prose uses it more")
    assert axis.colorbar.title.text == "code minus prose" == load_map.key.title
    assert load_map.key.meaning(diff[0, 5]) == "code uses it more"
    # the other way round, the words follow the data
    swapped = ExpertLoadMap({"prose": prose, "code": code})
    assert np.asarray(swapped.figure.data[2].z)[0, 5] == -1.0
    ticks = dict(zip(swapped.figure.layout.coloraxis2.colorbar.tickvals,
                     swapped.figure.layout.coloraxis2.colorbar.ticktext, strict=True))
    assert ticks[-1.0].endswith("code uses it more")


def test_ordering_by_the_difference_keeps_ids_in_ticks_hover_and_clicks():
    code, prose = load({0: {5: 0.75, 1: 0.25}}, 8), load({0: {2: 0.75, 1: 0.25}}, 8)
    load_map = ExpertLoadMap({"code": code, "prose": prose}, order="difference")
    ids = list(load_map.axis.ids)
    assert ids[0] == 5 and ids[-1] == 2  # code's expert left, prose's right
    assert list(load_map.figure.layout.xaxis3.ticktext) == [str(e) for e in ids]
    assert load_map.figure.data[0].customdata[0] == ids and np.asarray(load_map.figure.data[0].z)[0, 0] == 0.75
    assert "code minus prose" in load_map.figure.layout.xaxis3.title.text
    click(load_map.figure, 2, len(ids) - 1, "L0")
    assert load_map.picked == (0, 2)
    assert "expert 2</b>" in load_map.readout.value and "-0.75 (prose uses it more)" in load_map.readout.value
    load_map.order.value = "load"
    assert list(load_map.axis.ids[:3]) == [2, 5, 1]  # 0.75 each (ties by id), then 0.25 + 0.25
    with pytest.raises(ValueError, match="order must be one of"):
        ExpertLoadMap({"code": code}, order="difference")  # one load has no difference


@pytest.mark.parametrize("n", [60, 128, 512])
def test_every_panel_labels_experts_thinned_to_the_width(n):
    shares = {layer: {e: 1 / n for e in range(n)} for layer in range(2)}
    load_map = ExpertLoadMap({"code": load(shares, n), "prose": load(shares, n)})
    for name in ("xaxis", "xaxis2", "xaxis3"):
        axis = load_map.figure.layout[name]
        assert list(axis.tickvals) == list(range(0, n, load_map.axis.step)) and axis.range == (-0.5, n - 0.5)
    assert load_map.axis.step * load_map.axis.column_px >= len(str(n - 1)) * 0.6 * 10
    assert f"uniform 1/{n}" in load_map.figure.layout.coloraxis.colorbar.ticktext
