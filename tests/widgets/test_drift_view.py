"""The routing-drift view on a real Drift: the shipped model against a copy whose last MoE layer's router has two
experts' rows swapped. Every layer before it computes bit for bit the same, so the map must be blank there and
coloured at the last layer exactly at the tokens that picked one of the two experts (not both); the legend's words
must say what the data says; a click must show that cell; the export bar must write the frames and the map. The
controls make their variants into the folder given and hand the result to the view."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
from plotly_events import click
from widget_inputs import DRIFT_TEXTS

from moebench.checkpoint.loader import SHIPPED_MODEL
from moebench.errors import MoebenchError
from moebench.inspect.drift import drift, teacher_force
from moebench.inspect.routing_files import Routing
from moebench.tools.drift import source_digest
from moebench.widgets import DriftControls, DriftView, ExportBar, ModelPicker
from moebench.widgets.drift import TOP1_FLIP


def test_the_map_is_coloured_exactly_where_the_router_was_changed(swapped):
    d, last, pair = swapped
    view = DriftView()
    view.show(d)
    z = np.asarray(view.figure.data[0].z)
    ids = d.routings["shipped"].ids[:, -1]
    one_of_them = np.isin(ids, pair).sum(-1) == 1
    assert one_of_them.any() and not one_of_them.all()  # the test bites both ways
    assert z.shape == (len(d.layers), len(d.tokens)) and list(view.figure.data[0].y) == [f"L{i}" for i in d.layers]
    assert (z[:-1] == 0).all()  # every layer before the swapped one: the same experts
    assert np.array_equal(z[-1] != 0, one_of_them)
    top1_moved = np.isin(ids[:, 0], pair)
    assert (z[-1][top1_moved] != 0).all()
    # the two prompts are two sequences: one dotted line where the second starts
    assert [s.x0 for s in view.figure.layout.shapes] == [(d.seq == 0).sum() - 0.5]
    assert "swapped" in view.figure.layout.title.text and "shipped" in view.figure.layout.title.text
    # the per-layer table counts the changed tokens at the last layer alone; the worst tokens listed are among them
    per_layer, worst = view.tables.value.split("moebench-drift-worst")
    # layer, tokens, (Jaccard), top-1 flips, set changed, near-ties, real changes
    rows = re.findall(r"<tr>\s*<td>(\d+)</td>\s*<td>(\d+)</td>\s*<td>[^<]*</td>\s*<td>(\d+)</td>\s*<td>(\d+)</td>"
                      r"\s*<td>(\d+)</td>\s*<td>(\d+)</td>", per_layer)
    changed = {int(layer): int(ties) + int(real) for layer, _, _, _, ties, real in rows}
    assert changed == {**{i: 0 for i in d.layers[:-1]}, last: int(one_of_them.sum())}
    listed = [int(i) for i in re.findall(r"<tr>\s*<td>(\d+)</td>", worst)]
    assert 0 < len(listed) <= 10 and one_of_them[listed].all() and "[" in worst


def _colour_at(scale, t: float) -> set[str]:
    """The colours a plotly colorscale gives at position t (0..1): those of the stops around it."""
    positions = [p for p, _ in scale]
    below = max(i for i, p in enumerate(positions) if p <= t)
    above = min(i for i, p in enumerate(positions) if p >= t)
    return {scale[below][1], scale[above][1]}


def test_the_legend_says_what_each_cell_holds(swapped):
    d, last, _ = swapped
    view = DriftView()
    view.show(d)
    heat = view.figure.data[0]
    words = dict(zip(heat.colorbar.tickvals, heat.colorbar.ticktext, strict=True))
    z = np.asarray(heat.z)
    f = d.frame()
    at = f[f["layer"] == last]
    real, top1, tie = (at[c].to_numpy(bool) for c in ("real", "top1_flip", "near_tie"))
    said = [words[v] for v in z[-1]]
    expected = np.where(real & top1, "top-1 flip", np.where(real, "top-k set changed, top-1 kept",
                                                             np.where(tie, "near-tie", "same experts")))
    assert [s.split(" (")[0] for s in said] == list(expected)
    assert {"top-1 flip", "top-k set changed, top-1 kept"} <= set(expected)  # both real kinds are on the map
    assert "router margin < 0.001" in words[[v for v, w in words.items() if w.startswith("near-tie")][0]]
    # each value is drawn in exactly one colour, and the values' colours differ
    colours = [_colour_at(heat.colorscale, (v - heat.zmin) / (heat.zmax - heat.zmin)) for v in heat.colorbar.tickvals]
    assert all(len(c) == 1 for c in colours) and len({c.pop() for c in colours}) == len(words)
    # the summary counts the cells by the same words
    for word in words.values():
        count = int(sum(w == word for w in [words[v] for v in z.ravel()]))
        assert re.search(rf"{re.escape(word.replace('<', '&lt;'))}</span> {count}\b", view.summary.value)


def test_a_click_shows_both_routings_and_the_next_token_change(swapped):
    d, last, pair = swapped
    view = DriftView()
    view.show(d)
    z = np.asarray(view.figure.data[0].z)
    index = int(np.flatnonzero(z[-1] == TOP1_FLIP)[0])
    click(view.figure, 0, index, f"L{last}")
    assert view.picked == (index, last)
    text = view.readout.value
    assert f"token {index} " in text and f"layer {last}</b>: top-1 flip" in text
    routing, _ = text.split("next token")
    rows = re.findall(r"<tr>\s*<th>#\d</th>\s*<td>(\d+)</td>\s*<td>[^<]*</td>\s*<td>[^<]*</td>\s*<td>(\d+)</td>",
                      routing)
    li = d.layers.index(last)
    assert [(int(e), int(o)) for e, o in rows] == list(zip(d.routings["shipped"].ids[index, li],
                                                             d.routings["swapped"].ids[index, li], strict=True))
    ref_top, var_top = d.routings["shipped"].ids[index, li, 0], d.routings["swapped"].ids[index, li, 0]
    assert sorted([ref_top, var_top]) == sorted(pair)  # the top-1 went to its swapped partner
    nxt = d.next_tokens("swapped", index)
    kl = float(d.by_token().query("variant == 'swapped'")["logits_kl"].iloc[index])
    assert f"KL {kl:.3g} nats" in text
    for token in nxt["token"]:
        assert f"<td>{token}</td>" in text
    # another layer of the same token: the readout follows
    view.select(index, d.layers[0])
    assert f"layer {d.layers[0]}</b>: same experts" in view.readout.value


def test_a_routing_file_without_logits_draws_its_flips_and_says_there_is_no_next_token_change(shipped):
    """A server's routing (ids only) with the top-2 order swapped at one token and layer: that cell is a top-1 flip
    (no probabilities: it cannot be called a near-tie), the next-token panel says why it is empty."""
    model, tokenizer = shipped
    prompts = [tokenizer.encode(DRIFT_TEXTS[0])]
    ids = teacher_force(model, prompts).ids.copy()
    ids[3, 1] = ids[3, 1][::-1]
    d = drift([(model, tokenizer), Routing(ids, tuple(sorted(model.moe_blocks())))], prompts, names=["m", "file"])
    view = DriftView()
    view.show(d)
    z = np.asarray(view.figure.data[0].z)
    assert np.flatnonzero(z.ravel()).tolist() == [1 * z.shape[1] + 3] and z[1, 3] == TOP1_FLIP
    assert view.figure.layout.annotations[1].text.startswith("no next-token KL")
    assert len(view.figure.data[1].x) == 0 and np.isnan(view.figure.data[2].y).all()
    view.select(3)
    assert view.picked == (3, d.layers[1]) and "routing at layer" in view.readout.value
    assert "next token" not in view.readout.value

def test_the_export_bar_writes_the_frames_and_the_map(swapped, tmp_path):
    d, _, _ = swapped
    view = DriftView()
    view.show(d)
    bar = ExportBar(view.frames, [view.figure], folder=str(tmp_path))
    written = bar.records("parquet")
    assert sorted(p.name for p in written) == ["by_expert.parquet", "by_layer.parquet", "by_token.parquet",
                                               "drift.parquet"]
    back = pd.read_parquet(tmp_path / "records" / "drift.parquet")
    pd.testing.assert_frame_equal(back[["layer", "jaccard", "real"]], d.frame()[["layer", "jaccard", "real"]])
    assert (tmp_path / "records" / "by_layer.csv") in bar.records("csv")
    (page,) = bar.pictures("html")
    assert "routing-drift-of-swapped" in page.name and "plotly" in page.read_text()[:5000].lower()
    with pytest.raises(MoebenchError, match="no drift to export yet"):
        DriftView().frames()


def test_the_controls_make_their_variants_where_told_and_feed_the_view(tmp_path, capsys):
    picker = ModelPicker([str(SHIPPED_MODEL)])
    for variants in (["9bit"], "8bit", []):
        with pytest.raises(MoebenchError, match="variants: a list of recipe names"):
            DriftControls(picker, variants, run_now=False)
    with pytest.raises(MoebenchError, match="tokens must be a whole number >= 1, got 0"):
        DriftControls(picker, ["8bit"], tokens=0, run_now=False)
    with pytest.raises(MoebenchError, match="chosen must be among"):
        DriftControls(picker, ["8bit"], chosen=["4bit"], run_now=False)
    controls = DriftControls(picker, ["8bit", "fallback"], chosen=["fallback"], source="text", text=DRIFT_TEXTS[0],
                             tokens=12, variants_dir=tmp_path)
    view = DriftView()
    controls.on_result(view.show)
    assert controls.result.names == ["tiny-qwen2-moe", "fallback"] and len(controls.result.tokens) == 12
    assert list(view.variant.options) == ["fallback"] and "Error" not in controls.status.value
    controls.boxes["fallback"].value, controls.boxes["8bit"].value = False, True
    controls.button.click()
    assert controls.result.names == ["tiny-qwen2-moe", "8bit"] and list(view.variant.options) == ["8bit"]
    assert (tmp_path / f"tiny-qwen2-moe-{source_digest(SHIPPED_MODEL)}-8bit" / "config.json").exists()
    # mlx-lm's progress lines went into the controls' log, folded under the status, not into the cell
    out, err = capsys.readouterr()
    assert "[INFO]" not in out + err and any("[8bit] [INFO] Quantiz" in line for line in controls.log), controls.log
    assert "<details>" in controls.status.value and "Quantized model" in controls.status.value
    assert controls.progress.value == controls.progress.max and controls.progress.bar_style == "success"
    controls.text.value = " "
    controls.button.click()  # an error reaches the status line, not a log
    assert "text: type a text to feed" in controls.status.value and controls.progress.bar_style == "danger"
