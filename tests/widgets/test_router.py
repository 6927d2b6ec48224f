from types import SimpleNamespace

import numpy as np
import pytest
from plotly_events import click

from moebench import Intervention
from moebench.inspect.interventions import intervene
from moebench.inspect.record import Stepper
from moebench.widgets.router import NO_SHARED, SHARED_OFF, RouterView


def test_marks_the_recorded_top_k_of_every_moe_layer(tiny, trace):
    model, _ = tiny
    view = RouterView()
    record = trace.generated[1]
    view.show(record)
    layers = sorted(model.moe_blocks())
    k = model.args.num_experts_per_tok
    assert sorted(view.marked) == layers
    for layer in layers:
        assert view.marked[layer] == list(record.layers[layer].topk_ids)
    heat, boxes, shared, ablated, _bias_in, _bias_out = view.figure.data
    np.testing.assert_array_equal(np.asarray(heat.z), np.stack([record.layers[i].router_probs for i in layers]))
    assert len(boxes.x) == k * len(layers) and list(boxes.text[:k]) == [f"#{r + 1}" for r in range(k)]
    assert [row[0] for row in shared.z] == [record.layers[i].shared_gate for i in layers]
    assert f"{k} experts picked" in view.figure.layout.title.text
    assert len(ablated.x) == 0 and not ablated.showlegend


def test_ablated_experts_are_crossed_out_and_never_boxed(tiny):
    model, tokenizer = tiny
    with intervene(model, {1: Intervention(ablate=(0, 3))}):
        record = Stepper(model, tokenizer, "hello", record=True).run(1).generated[0]
    view = RouterView()
    view.show(record)
    ablated = view.figure.data[3]
    assert list(ablated.x) == [0, 3] and list(ablated.y) == ["L1", "L1"] and ablated.showlegend
    assert not {0, 3} & set(view.marked[1])


def test_says_plainly_when_there_is_no_shared_expert(tiny_no_shared):
    model, tokenizer = tiny_no_shared
    view = RouterView()
    view.show(Stepper(model, tokenizer, "hello", record=True).run(1).generated[0])
    assert [a.text for a in view.figure.layout.annotations][-1] == NO_SHARED


def test_a_switched_off_shared_expert_is_named_as_an_intervention(tiny):
    model, tokenizer = tiny
    with intervene(model, Intervention(shared_expert=False)):
        record = Stepper(model, tokenizer, "hello", record=True).run(1).generated[0]
    view = RouterView()
    view.show(record)
    assert [a.text for a in view.figure.layout.annotations][-1] == SHARED_OFF


def test_an_unrecorded_step_shows_no_routing(tiny):
    model, tokenizer = tiny
    view = RouterView()
    view.show(Stepper(model, tokenizer, "hello", record=False).run(1).generated[0])
    assert view.marked == {} and len(view.figure.data[1].x) == 0
    assert "not recorded" in view.figure.layout.title.text


def routed(n: int, layers: int, picked: dict[int, list[int]], position: int = 0):
    """A recorded step as the view reads it: `picked[layer]` the top-k, probabilities peaked on them."""
    rows = {}
    for layer in range(layers):
        probs = np.full(n, 0.1 / n)
        probs[picked[layer]] = np.linspace(0.5, 0.3, len(picked[layer]))
        rows[layer] = SimpleNamespace(router_probs=probs / probs.sum(), topk_ids=np.array(picked[layer]),
                                      shared_gate=0.5, selection_bias_effect=lambda: None)
    return SimpleNamespace(layers=rows, interventions={}, position=position, input_text="x")


@pytest.mark.parametrize("n", [60, 64, 128, 256, 512])
def test_many_experts_get_thinned_ticks_boxes_that_fit_and_ids_on_hover(n):
    view = RouterView()
    view.show(routed(n, 3, {0: [0, n - 1], 1: [1, 2], 2: [n // 2, 0]}))
    heat, boxes, *_ = view.figure.data
    axis = view.figure.layout.xaxis
    assert view.axis.step * view.axis.column_px >= len(str(n - 1)) * 0.6 * 10  # labels cannot overlap
    assert list(axis.ticktext) == [str(v) for v in axis.tickvals] == [str(v) for v in range(0, n, view.axis.step)]
    half = boxes.marker.size / 2 / view.axis.column_px  # the boxes on expert 0 and n-1 stay inside the range
    assert axis.range[0] <= -half and axis.range[1] >= n - 1 + half
    assert boxes.mode == ("markers+text" if view.axis.column_px >= 18 else "markers")
    assert [c[0] for c in heat.customdata[0]] == list(range(n)) and heat.customdata[0][n - 1][1] == "<br>picked #2"
    assert "%{customdata[0]}" in heat.hovertemplate


def test_most_picked_first_moves_columns_but_every_label_hover_and_click_names_the_real_expert():
    records = [routed(16, 2, {0: [7, 3], 1: [7, 5]}), routed(16, 2, {0: [7, 5], 1: [9, 7]})]
    view = RouterView(order="usage")
    view.scale_to(records)
    view.show(records[0])
    heat, boxes, *_ = view.figure.data
    assert list(view.axis.ids[:3]) == [7, 5, 3]  # picked 4, 2 and 1 times; ties by id
    assert list(view.figure.layout.xaxis.ticktext[:3]) == ["7", "5", "3"]
    assert [c[0] for c in heat.customdata[0][:3]] == [7, 5, 3]
    np.testing.assert_array_equal(np.asarray(heat.z)[:, 0], [r.router_probs[7] for r in records[0].layers.values()])
    assert list(boxes.x) == [0, 2, 0, 1] and view.marked == {0: [7, 3], 1: [7, 5]}
    click(view.figure, 0, 1, "L1")
    assert view.picked == (1, 5) and "expert 5</b>" in view.readout.value and "picked #2" in view.readout.value
    view.order.value = "id"
    assert list(view.figure.layout.xaxis.ticktext[:2]) == ["0", "1"] and list(boxes.x) == [7, 3, 7, 5]
    click(view.figure, 0, 1, "L1")
    assert view.picked == (1, 1) and "not picked" in view.readout.value


def test_an_unknown_order_is_refused_by_name():
    with pytest.raises(ValueError, match="order must be one of"):
        RouterView(order="load")
