"""Every figure a view draws, opened in a browser at any point of its updates, draws them all without a
JavaScript error (plotly.js in Chromium, the updates as the kernel sends them: the `plotly_page` fixture)."""

from __future__ import annotations

import pytest
from families import write_family
from plotly_replay import recording, replay_errors
from test_loadmap import load

import moebench
from moebench.checkpoint.loader import SHIPPED_MODEL
from moebench.inspect import trace_stats
from moebench.inspect.compare import compare_decode, compare_step
from moebench.inspect.record import Stepper
from moebench.widgets.controls import ModelPicker, PromptControls
from moebench.widgets.diff import DiffView
from moebench.widgets.drift import DriftView
from moebench.widgets.experts import ExpertView
from moebench.widgets.intervene import InterventionPanel
from moebench.widgets.loadmap import ExpertLoadMap
from moebench.widgets.mixing import MixingView
from moebench.widgets.router import RouterView
from moebench.widgets.tps import TokensPerSecondChart


def test_every_view_draws_its_first_state(plotly_page, monkeypatch):
    with recording(monkeypatch) as figures:
        for make in (RouterView, MixingView, DriftView, DiffView, TokensPerSecondChart, ExpertView):
            make()
        ExpertLoadMap({"a": load({0: {1: 0.5}}, 4), "b": load({0: {2: 0.5}}, 4)})
    assert len(figures) == 7
    assert replay_errors(plotly_page, figures) == []


def test_the_router_view_stepping_blanking_and_reordering(plotly_page, monkeypatch, trace):
    with recording(monkeypatch) as figures:
        view = RouterView()
        view.blank("nothing yet")
        view.scale_to(trace.generated)
        for record in trace.generated[:2]:
            view.show(record)
        view.order.value = "usage"
        view.blank("again nothing")
        view.show(trace.generated[-1])
    assert len(figures[0]["updates"]) >= 6
    assert replay_errors(plotly_page, figures) == []


def test_the_intervention_panel_as_notebook_05_drives_it(plotly_page, monkeypatch, tiny):
    """The baseline alone (the intervened view blank), then an ablation (its crosses), a forced set and a gate
    scale, and an earlier result picked again: CI once caught the intervened view opening on its first, empty
    state and plotly throwing at the next update."""
    with recording(monkeypatch) as figures:
        picker = ModelPicker([str(SHIPPED_MODEL)])
        picker._open["tiny"] = tiny
        picker.dropdown.options = [str(SHIPPED_MODEL), "tiny"]
        picker.dropdown.value = "tiny"
        panel = InterventionPanel(PromptControls(picker, "def add(a, b):", tokens=4, keep_logits=True))
        panel.ablate.value = [3]
        panel.run()
        panel.ablate.value, panel.force.value = [], [6, 7]
        panel.run()
        panel.force.value, panel.gate_scale.value = [], 0.25
        panel.run()
        panel.shown.value = 0
    assert len(figures) == 3 and all(figure["updates"] for figure in figures)
    assert replay_errors(plotly_page, figures) == []


def test_the_comparison_expert_speed_and_load_views_as_they_are_driven(plotly_page, monkeypatch, tiny, trace):
    model, tokenizer = tiny
    with recording(monkeypatch) as figures:
        diff = DiffView()
        diff.show_step(compare_step(model, trace.generated[1]))
        diff.show_decode(compare_decode(model, "hello", 3, tokenizer))
        experts = ExpertView(model, tokenizer, top=3)
        experts.show(trace.generated[1])
        experts.layer.value = sorted(trace.generated[1].layers)[-1]
        chart = TokensPerSecondChart(window=8, redraw_hz=0)
        for position in range(12):
            chart.add(position, 0.01 + position / 1000, recording=position % 3 == 0, fused=position < 6)
        chart.mark(6, "fused OFF")
        prose = Stepper(model, tokenizer, "The quick brown fox", record=True).run(1)
        loads = ExpertLoadMap({"code": trace_stats.load(trace), "prose": trace_stats.load(prose)})
        loads.order.value = "difference"
    assert len(figures) == 4 and all(figure["updates"] for figure in figures)
    assert replay_errors(plotly_page, figures) == []


def test_the_mixing_view_on_a_hybrid_and_the_drift_map(plotly_page, monkeypatch, hybrid_trace, swapped):
    with recording(monkeypatch) as figures:
        mixing = MixingView()
        for record in hybrid_trace.generated:
            mixing.show(record)
        view = DriftView()
        view.show(swapped[0])
        view.select(0, swapped[1])
    assert len(figures) == 2 and all(figure["updates"] for figure in figures)
    assert replay_errors(plotly_page, figures) == []


@pytest.fixture(scope="module")
def picked_later(tmp_path_factory) -> dict:
    """(model, trace) of a 2-layer Qwen3-MoE, of a tiny Qwen3.5 (linear, linear, linear, full) and of a tiny GLM-4.x:
    models a picker switches to after another."""
    root = tmp_path_factory.mktemp("picked-later")
    found = {}
    for preset in ("qwen3-tiny", "qwen3.5-moe-tiny", "glm4-moe-tiny"):
        model, tokenizer = moebench.load(write_family(root, preset))
        found[preset] = model, Stepper(model, tokenizer, "def add(a, b):", record=True).run(2)
    return found


def test_the_router_and_mixing_views_after_another_model_is_picked(plotly_page, monkeypatch, tiny, trace,
                                                                     hybrid_trace, picked_later):
    """Issue 56: after a switch to a model with fewer MoE layers (or other layer kinds), plotly threw on the update
    ("Cannot read properties of undefined (reading 'length')") and the chart stayed on the last model."""
    qwen3, fewer = picked_later["qwen3-tiny"]
    _, kinds = picked_later["qwen3.5-moe-tiny"]
    glm, biased = picked_later["glm4-moe-tiny"]
    with recording(monkeypatch) as figures:
        router = RouterView(model=tiny[0])
        router.show(trace.generated[1])  # 4 MoE layers, with a shared expert
        router.model = qwen3
        router.show(fewer.generated[1])  # 2, without
        router.model = glm
        router.show(biased.generated[1])  # 2 of 3 layers, 16 experts, its selection bias marked
        mixing = MixingView()
        mixing.show(hybrid_trace.generated[1])  # full, linear, linear, full
        mixing.show(kinds.generated[1])  # linear, linear, linear, full
    assert replay_errors(plotly_page, figures) == []
