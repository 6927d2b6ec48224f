"""Every notebook, run on the shipped model, then another model picked in its picker: each view shows the new model's
records (never a step of one model compared on the other), or says plainly it shows the last model and offers to
measure the new one (issue 56: notebook 03 compared a tiny Qwen3.5 with a step of the shipped model, experts e61 and
e45 on an 8-expert model, then failed on a NaN)."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from families import FAMILIES, write_family
from nbrun import run_notebook

from moebench.checkpoint.loader import SHIPPED_MODEL
from moebench.inspect.interventions import active_interventions


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {name: str(write_family(root, FAMILIES[name])) for name in ("Qwen3.5", "gpt-oss")}


def run_then_pick(notebook: str, folders: dict[str, str], picked: str, monkeypatch) -> dict:
    """Run the notebook with the shipped model first in its picker (the default), then pick `picked`."""
    monkeypatch.setenv("MOEBENCH_MODEL", os.pathsep.join([str(SHIPPED_MODEL), *folders.values()]))
    ns = run_notebook(notebook)
    picker = ns["picker"]
    assert picker.model.args.num_experts == 64  # the shipped model ran first
    ns["shipped"] = picker.model
    picker.dropdown.value = folders[picked]
    assert picker.model.args.num_experts == 8 and picker.model is not ns["shipped"]
    return ns


def moe_layers(model) -> int:
    return len(model.moe_blocks())


def test_01_every_view_follows(folders, monkeypatch):
    ns = run_then_pick("01_decode_step_by_step", folders, "Qwen3.5", monkeypatch)
    model, controls, stepper, router = ns["picker"].model, ns["controls"], ns["stepper"], ns["router"]
    assert controls.model is model and stepper.records == controls.trace.generated
    assert router.model is model and np.shape(router.figure.data[0].z) == (moe_layers(model), 8)
    assert ns["mixing"].kinds and ns["experts"].record is stepper.current


def test_02_the_load_map_table_and_stepper_compare_the_new_model_only(folders, monkeypatch):
    ns = run_then_pick("02_router_and_experts", folders, "gpt-oss", monkeypatch)
    model, texts = ns["picker"].model, ns["texts"]
    assert all(c.model is model for c in texts.values())
    assert all(grid.shape == (moe_layers(model), 8) for grid in ns["load_map"].grids.values())
    assert ns["table"].value.split("<tbody>")[1].count("<tr>") == moe_layers(model)  # a row a MoE layer
    assert ns["stepper"].records == texts[ns["which"].value].trace.prefill
    assert ns["router"].model is model and ns["experts"].model is model
    assert np.shape(ns["router"].figure.data[0].z) == (moe_layers(model), 8)


def test_03_compares_the_new_model_on_its_own_steps(folders, monkeypatch):
    ns = run_then_pick("03_fused_vs_fallback", folders, "Qwen3.5", monkeypatch)
    model, controls = ns["picker"].model, ns["controls"]
    for view in (ns["float_view"], ns["bf16_view"]):
        assert view.source is model and all(any(s is g for g in controls.trace.generated) for s in view.steps.values())
        experts = view.frame[view.frame["part"] == "expert"]["expert"]
        assert len(experts) and experts.max() < 8 and not view.frame["nrms"].isna().any()
        assert "Error" not in view.view.summary.value
        assert model.load_info.source.name in view.view.figure.layout.title.text
        view.picker.value = view.picker.options[0][1]  # another token of the new decode: compared on the new model
        assert view.frame is not None and "Error" not in view.view.summary.value
    assert ns["bf16_view"].model.dtype == mx.bfloat16
    medians = ns["medians"]
    assert model.load_info.source.name in medians.widget.value
    assert set(medians.medians.index.get_level_values("activations")) == {"float32", "bfloat16"}
    live = ns["live"]
    assert live.stepper.model is model and model.load_info.source.name in live.text.value
    assert len(live.stepper.trace.generated) == 2  # the prompt's last position, then the one token that shows the path


def test_04_the_live_panel_follows_and_the_benchmark_says_it_is_the_last_model(folders, monkeypatch):
    ns = run_then_pick("04_live_tokens_per_second", folders, "gpt-oss", monkeypatch)
    model, live, bench = ns["picker"].model, ns["live"], ns["bench"]
    assert live.stepper.model is model and not live.running and live.chart.trace(False).x in ((), None)
    assert bench.stale.shown and bench.model is ns["shipped"]
    text = bench.stale.text.value
    assert "tiny-qwen2-moe" in text and "gpt-oss-tiny" in text and "run benchmark" in text
    assert "tiny-qwen2-moe" in bench.figure.layout.title.text  # the numbers shown name the model they measured
    bench.rounds.value = 1
    bench.stale.button.click()
    assert not bench.stale.shown and bench.model is model and "gpt-oss-tiny" in bench.figure.layout.title.text


def test_05_the_panel_starts_over_on_the_new_model(folders, monkeypatch):
    ns = run_then_pick("05_interventions", folders, "Qwen3.5", monkeypatch)
    model, panel = ns["picker"].model, ns["panel"]
    assert panel.model is model and panel.results == [] and panel.baseline is ns["controls"].trace
    assert np.shape(panel.before.figure.data[0].z) == (moe_layers(model), 8) and panel.has_shared_expert
    assert not active_interventions(ns["shipped"]) and not active_interventions(model)
    ns["picker"].dropdown.value = folders["gpt-oss"]
    assert panel.model is ns["picker"].model and not panel.has_shared_expert and panel.gate_scale.disabled
    panel.ablate.value = [1]
    panel.run()
    assert len(panel.results) == 1 and np.shape(panel.after.figure.data[0].z)[1] == 8


def test_06_the_drift_view_says_it_is_the_last_model_and_offers_compare(folders, monkeypatch):
    ns = run_then_pick("06_routing_drift", folders, "Qwen3.5", monkeypatch)
    view, controls = ns["view"], ns["controls"]
    assert view.note.shown and controls.model is ns["shipped"] and view.result is controls.result
    text = view.note.text.value
    assert "tiny-qwen2-moe" in text and "qwen3.5-moe-tiny" in text and view.note.button.description == "compare"
    assert "another model is picked" in controls.status.value
