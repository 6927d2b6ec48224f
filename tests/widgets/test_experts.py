import numpy as np

from moebench.inspect.record import Stepper
from moebench.widgets.experts import ExpertView, contributions


def test_contributions_are_score_times_output_plus_the_gated_shared_expert(trace):
    layer = trace.generated[0].layers[0]
    rows = contributions(layer)
    assert [r["expert"] for r in rows] == [*map(int, layer.topk_ids), None]
    for row, score, out in zip(rows, layer.topk_scores, layer.expert_out, strict=False):
        assert np.isclose(row["contribution_norm"], score * np.linalg.norm(out))
    assert np.isclose(rows[-1]["contribution_norm"], layer.shared_gate * np.linalg.norm(layer.shared_out))


def test_without_a_shared_expert_only_routed_rows(tiny_no_shared):
    model, tokenizer = tiny_no_shared
    layer = Stepper(model, tokenizer, "hi", record=True).run(1).generated[0].layers[0]
    assert [r["expert"] for r in contributions(layer)] == list(map(int, layer.topk_ids))


def test_view_follows_layer_choice_and_lists_top_tokens_of_the_chosen_experts(tiny, trace):
    model, tokenizer = tiny
    view = ExpertView(model, tokenizer, top=3)
    record = trace.generated[1]
    view.show(record)
    assert list(view.layer.options) == sorted(record.layers)
    view.layer.value = 2
    assert set(view.top_tokens["expert"]) == set(map(int, record.layers[2].topk_ids))
    assert (view.top_tokens.groupby("expert").size() == 3).all()
    raw, added = view.figure.data
    assert list(raw.x) == [r["name"] for r in view.rows] and "layer 2" in view.figure.layout.title.text
    assert np.allclose(added.y, [r["contribution_norm"] for r in view.rows])
    assert "pushes up most" in view.tokens.value


def test_without_a_model_there_is_no_token_table(trace):
    view = ExpertView()
    view.show(trace.generated[0])
    assert view.tokens.value == "" and view.top_tokens is None
