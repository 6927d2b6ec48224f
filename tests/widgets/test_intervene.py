"""The intervention panel keeps what it ran: every intervened decode of the baseline stays listed and shown."""

import pytest

import moebench
from moebench.checkpoint.loader import SHIPPED_MODEL
from moebench.widgets.controls import ModelPicker, PromptControls
from moebench.widgets.intervene import InterventionPanel, describe


@pytest.fixture
def panel(tiny):
    picker = ModelPicker([str(SHIPPED_MODEL)])
    picker._open["tiny"] = tiny
    picker.dropdown.options = [str(SHIPPED_MODEL), "tiny"]
    picker.dropdown.value = "tiny"
    return InterventionPanel(PromptControls(picker, "def add(a, b):", tokens=4, keep_logits=True))


def test_each_run_is_listed_and_shown_and_clearing_keeps_them(panel):
    draws, draw = [], panel._draw
    panel._draw = lambda: (draws.append(panel.shown.value), draw())
    panel.ablate.value = [0]
    panel.run()
    panel.ablate.value, panel.gate_scale.value = [], 0.5
    panel.run()
    assert [r.label.split(" (")[0] for r in panel.results] == ["1: ablate 0 on every MoE layer",
                                                              "2: shared gate x0.5 on every MoE layer"]
    assert draws == [0, 1]  # each run shows its own result once
    assert panel.measured is panel.results[1].measured and panel.status.value.startswith("Intervention(")
    panel.clear()
    assert panel.intervention() == moebench.Intervention() and "2 result(s)" in panel.status.value
    assert panel.intervened is panel.results[1].intervened and panel.diff.value  # still shown after clearing
    panel.shown.value = 0  # an earlier result, one pick away
    assert "moebench-token-diff" in panel.diff.value and panel.measured is panel.results[0].measured
    assert not moebench.inspect.interventions.active_interventions(panel.controls.picker.model)


def test_a_new_baseline_starts_the_list_over(panel):
    panel.top_k.value = 1
    panel.run()
    panel.controls.decode()
    assert panel.results == [] and panel.intervened is None and panel.shown.options == ()


def test_a_result_is_named_by_what_it_changes():
    assert describe(moebench.Intervention(force_experts=(6, 7), top_k=None), "layer 2") == "force 6, 7 on layer 2"
    assert describe(moebench.Intervention(), "every MoE layer") == "no change on every MoE layer"


def test_the_hint_names_the_expert_range(panel):
    assert "expert ids 0-7" in panel.hint.value and "Enter" in panel.hint.value
    assert all("Enter" in box.placeholder for box in (panel.force, panel.ablate))


def test_shared_expert_controls_are_off_for_a_model_without_one(panel):
    """gpt-oss (like Qwen3-MoE and OLMoE) has no shared expert: its switch and gate scale are disabled and say so;
    the 32 experts top-4 of gpt-oss-20b's routing reach the expert range and the top-k slider."""
    from moebench.checkpoint.config import model_args
    from moebench.models import family
    from moebench.tools.presets import get_preset

    assert not panel.shared.disabled and not panel.gate_scale.disabled
    config = {**get_preset("gpt-oss-tiny").config, "num_local_experts": 32, "num_experts_per_tok": 4}
    panel._configure(family("gpt_oss").model(model_args(config)))
    assert panel.shared.disabled and panel.gate_scale.disabled
    assert panel.shared.description == "no shared expert in this model"
    assert "expert ids 0-31" in panel.hint.value and (panel.top_k.max, panel.top_k.value) == (32, 4)


def test_a_run_with_no_intervention_set_is_refused_not_charted(panel):
    """The default controls would decode the baseline again: the status says so, and no result (rounding noise
    measured as an 'effect') is listed or drawn."""
    panel.apply.click()
    assert "no intervention is set" in panel.status.value and "InterventionError" in panel.status.value
    assert panel.results == [] and panel.shown.options == () and list(panel.figure.data[0].x) == []


def test_a_model_without_a_shared_expert_refuses_a_shared_expert_change(tiny, tiny_no_shared, panel):
    """Set from code (the disabled controls cannot be clicked), a gate scale on a model without a shared expert is
    refused by name; picking such a model puts a scale set on the last one back to 1."""
    panel.gate_scale.value = 0.25
    panel.run()  # the tiny model has a shared expert: a real intervention
    assert [r.label.split(" (")[0] for r in panel.results] == ["1: shared gate x0.25 on every MoE layer"]
    picker = panel.controls.picker
    picker._open["no-shared"] = tiny_no_shared
    picker.dropdown.options = [*picker.dropdown.options, "no-shared"]
    picker.dropdown.value = "no-shared"
    assert panel.model is tiny_no_shared[0] and not panel.has_shared_expert
    assert (panel.shared.value, panel.gate_scale.value, panel.gate_scale.disabled) == (True, 1.0, True)
    panel.gate_scale.value = 0.25
    panel.apply.click()
    assert "this model has no shared expert" in panel.status.value and panel.results == []
    panel.clear()
    panel.ablate.value = [1]
    panel.run()
    assert [r.label.split(" (")[0] for r in panel.results] == ["1: ablate 1 on every MoE layer"]
