import pytest

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
