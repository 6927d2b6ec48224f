"""What each notebook shows, read from the widgets it built (the notebooks themselves assert nothing)."""

import numpy as np
import pytest
from nbrun import run_notebook

import moebench
from moebench.widgets.static import PLOTLY_MIME


@pytest.fixture(scope="module")
def nb01():
    return run_notebook("01_decode_step_by_step")


def snapshots_follow(figure, outputs):
    """A displayed figure has a static copy (its own output) whose last picture is the figure as drawn now."""
    snapshot = figure._snapshot
    assert snapshot is not None and snapshot.handle is not None
    mine = [data for data, display_id, _ in outputs.published if display_id == snapshot.handle.display_id]
    assert mine and PLOTLY_MIME in mine[-1]
    assert mine[-1][PLOTLY_MIME]["layout"]["title"]["text"] == figure.layout.title.text
    # the kernel-side widget state is the figure now, not the empty one it was built as
    assert [len(t.get("x", []) or []) for t in figure._widget_data] == [len(t.x or []) for t in figure.data]


def test_01_router_boxes_are_the_recorded_top_k_on_every_step(nb01):
    router, stepper, controls = nb01["router"], nb01["stepper"], nb01["controls"]
    model = controls.picker.model
    k = model.args.num_experts_per_tok
    assert len(stepper.records) == controls.tokens.value
    for i, record in enumerate(stepper.records):
        stepper.go(i)
        assert sorted(router.marked) == sorted(model.moe_blocks())
        assert all(router.marked[layer] == list(record.layers[layer].topk_ids) for layer in router.marked)
        assert len(router.figure.data[1].x) == k * len(router.marked)
    scale = router.figure.data[0].zmax
    assert scale == pytest.approx(max(float(layer.router_probs.max()) for r in stepper.records
                                      for layer in r.layers.values()))  # one colour scale for every step
    snapshots_follow(router.figure, nb01["_outputs"])


def test_01_prefill_step_explains_its_fallback_and_glyphs_are_visible(nb01):
    entries = nb01["stepper"].strip.steps
    assert "prefill" in entries[0]["note"] and entries[1]["note"] == ""
    assert "\u00b7" in "".join(nb01["stepper"].strip.before + [e["input"] for e in entries])


def test_01_expert_view_follows_the_stepper_and_a_new_prompt_redraws_everything(nb01):
    experts, stepper, controls = nb01["experts"], nb01["stepper"], nb01["controls"]
    stepper.go(2)
    assert [r["expert"] for r in experts.rows[: len(stepper.current.layers[experts.layer.value].topk_ids)]] == \
        list(stepper.current.layers[experts.layer.value].topk_ids)
    controls.prompt.value, controls.tokens.value = "for i in range(3):", 5
    controls.button.click()
    assert len(stepper.records) == 5 and stepper.index == 0
    assert "for" in "".join(stepper.strip.before + [stepper.strip.steps[0]["input"]])
    assert "range" in nb01["router"].figure.layout.title.text or stepper.current is stepper.records[0]
    snapshots_follow(experts.figure, nb01["_outputs"])


def test_01_chat_messages_and_export(nb01, tmp_path):
    controls, export = nb01["controls"], nb01["_shown"][-1]
    controls.prompt.value = '[{"role": "user", "content": "hello"}]'
    controls.tokens.value = 3
    controls.button.click()
    assert "<|im_start|>" in controls.picker.tokenizer.decode(controls.trace.prompt_ids, skip_special_tokens=False)
    assert "ChatML" in controls.status.value  # the shipped model has no chat template: the warning is shown
    export.folder.value = str(tmp_path)
    assert {p.name for p in export.records("csv")} >= {"tokens.csv", "routing.csv"}
    assert [p.suffix for p in export.pictures("html")] == [".html", ".html"]


def test_02_load_maps_have_a_tick_per_expert_a_uniform_mark_and_a_difference_panel():
    ns = run_notebook("02_router_and_experts")
    load_map, model = ns["load_map"], ns["picker"].model
    e = model.args.num_experts
    for grid in load_map.grids.values():
        assert grid.shape[1] == e and np.allclose(grid.sum(axis=1), 1)
    for ax in (load_map.figure.layout.xaxis, load_map.figure.layout.xaxis3):  # every panel: ids, thinned to fit
        assert list(ax.ticktext) == [str(v) for v in ax.tickvals] and ax.tickvals[0] == 0
    assert f"uniform 1/{e}" in load_map.figure.layout.coloraxis.colorbar.ticktext
    diff = np.asarray(load_map.figure.data[2].z)
    assert np.allclose(diff, load_map.grids["code"].to_numpy() - load_map.grids["prose"].to_numpy())
    table = ns["routing_table"]()
    assert all("(bits)" in c for c in table.columns) and (table.iloc[:, 0] > 0).all()
    # the stepper steps either text
    stepper, which = ns["stepper"], ns["which"]
    assert len(stepper.records) == len(ns["texts"]["code"].trace.prefill)
    which.value = "prose"
    assert len(stepper.records) == len(ns["texts"]["prose"].trace.prefill)
    assert set(ns["experts"].top_tokens["expert"]) == {int(i) for i in
                                                       stepper.current.layers[ns["experts"].layer.value].topk_ids}
    export = ns["export"]  # the export bar at the end: the stepped text's records, in a folder named after it
    assert export.folder.value.endswith("02/prose") and len(export.figures) == 3


def test_03_toggle_label_follows_the_switch_and_the_views_name_the_dtype():
    ns = run_notebook("03_fused_vs_fallback")
    live = ns["live"]
    live.toggle.set(False)
    assert "fallback (gather_qmm)" in live.toggle.label.value and "switched off" in live.toggle.label.value
    live.toggle.set(True)
    assert f"fused {moebench.available_backend()} kernel" in live.toggle.label.value
    for view, dtype in ((ns["float_view"], "float32"), (ns["bf16_view"], "bfloat16")):
        assert dtype in view.view.figure.layout.title.text
        ticks = view.view.figure.layout.yaxis.tickvals
        assert len(ticks) >= 3
        assert "Compared in" in view.view.summary.value and "Both decodes took" in view.view.summary.value
    routed = ns["bf16_view"].frame.query("part == 'routed'").groupby("pair")["nrms"].median()
    assert routed["fused~truth"] <= routed["fallback~truth"]
    # the numbers the prose points to: medians per dtype, pair and part, read from the same frames
    medians, frame = ns["medians"].medians, ns["float_view"].frame
    for part in ("routed", "expert"):
        rows = frame[(frame["part"] == part) & (frame["pair"] == "fused~truth")]
        assert medians.loc[("float32", "fused~truth"), part] == rows["nrms"].median()
    assert list(medians.columns[:2]) == ["routed", "expert"] and medians["unit roundoff"].max() == 2.0 ** -8
    picker = ns["float_view"].picker
    picker.value = picker.options[0][1]  # another token: its comparison replaces the last
    assert ns["float_view"].frame is not None and len(picker.options) == ns["controls"].tokens.value - 1


def test_04_chart_arms_marks_and_benchmark():
    ns = run_notebook("04_live_tokens_per_second")
    live, chart, bench = ns["live"], ns["chart"], ns["bench"]
    n = ns["N"]
    records = ns["records"]  # the timed live decode: ended by its time or its token cap, not by the test
    assert 0 < len(records) <= 500 and not live.running and not live.stepper.done
    assert chart.points_received == live.decoded == len(records) + 3 * n + 2 * 8  # each flip while idle decodes 8
    assert chart.rates(recording=False, fused=True)[:n] and len(chart.rates(recording=True, fused=False)) >= n
    labels = [a.text for a in chart.figure.layout.annotations]
    assert labels[:3] == ["recording ON", "fused OFF", "fused ON"]
    ys = {(a.x, a.y) for a in chart.figure.layout.annotations}
    assert len(ys) == len(labels)  # no two labels at one place
    assert live.stepper.trace.text and "text so far" in live.text.value
    table = bench.runs
    assert set(table["arm"]) == {"fused on, clean", "fused on, recording", "fused off, clean", "fused off, recording"}
    assert table["warmup"].sum() == 4 and len(table) == 16
    assert "warm-up round(s) dropped" in bench.table.value and "median tok/s" in bench.table.value


def test_05_panel_measures_the_effect_and_clearing_restores_the_baseline():
    ns = run_notebook("05_interventions")
    panel, controls = ns["panel"], ns["controls"]
    assert "mean KL" in panel.results[1].summary and "cleared" in panel.status.value
    # after Run All the panel shows what its cells did: the three decodes listed, the last one drawn
    assert [r.label.split(" (mean")[0] for r in panel.results] == [
        f"1: ablate {ns['favourite']} on every MoE layer",
        "2: force " + ", ".join(map(str, range(ns["n_experts"] - ns["K"], ns["n_experts"]))) + " on every MoE layer",
        "3: shared gate x0.25 on every MoE layer"]
    assert panel.shown.value == 2 and len(panel.figure.data[0].x) == len(controls.trace.generated)
    assert "moebench-token-diff" in panel.diff.value and panel.after.marked  # the intervened routing is drawn
    export = ns["_shown"][-1]
    assert export.trace() is panel.results[2].intervened and len(export.figures) == 3
    assert ns["again"].token_ids == controls.trace.token_ids and ns["again"] is not controls.trace
    assert not moebench.inspect.interventions.active_interventions(ns["picker"].model)
    # a control changes its view: top-1 routing, then the panel's routing view shows one box per layer
    panel.gate_scale.value, panel.top_k.value = 1.0, 1
    panel.run()
    assert "mean KL" in panel.status.value and panel.measured["kl"].shape == (len(controls.trace.generated),)
    assert all(len(ids) == 1 for ids in panel.after.marked.values())
    assert "moebench-token-diff" in panel.diff.value
    panel.top_k.value, panel.layer.value = panel.default_k, panel.layer.options[1][1]
    panel.ablate.value = [0, 1]
    panel.run()
    assert panel.after.figure.data[3].x  # crosses on the ablated experts


def test_05_clear_puts_every_control_back_to_no_intervention():
    ns = run_notebook("05_interventions")
    panel = ns["panel"]
    assert panel.intervention() == moebench.Intervention() and panel.layer.label == "every MoE layer"
