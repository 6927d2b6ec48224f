import numpy as np

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
    heat, boxes, shared, ablated = view.figure.data
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
