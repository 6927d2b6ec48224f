import re

import numpy as np
from byte_tokenizer import write_byte_tokenizer
from nbrun import run_notebook
from widget_inputs import HYBRID_LAYER_TYPES

from moebench.tools.presets import get_preset
from moebench.tools.writer import write_random_checkpoint
from moebench.widgets import MixingView, TokenStepper
from moebench.widgets.mixing import NO_MIXER


def strip_kinds(view: MixingView) -> dict[int, str]:
    """What the strip's labels say, layer by layer (their data attributes and their text)."""
    found = re.findall(r"data-layer='(\d+)' data-kind='(\w+)'[^>]*>layer \1 · (\w+)<", view.strip.value)
    assert all(kind.startswith(word) for _, kind, word in found)
    return {int(layer): kind for layer, kind, _ in found}


def test_the_strip_says_linear_for_exactly_the_linear_layers(hybrid_trace):
    view = MixingView()
    view.show(hybrid_trace.generated[1])
    assert strip_kinds(view) == dict(enumerate(HYBRID_LAYER_TYPES)) and view.figure.layout.xaxis.visible
    assert view.header.children == (view.strip,) and view.holder.children == (view.figure,)
    assert view.holder.layout.visibility == "visible" and view.holder.layout.max_height is None
    for trace in view.figure.data:
        assert list(trace.y) == [f"layer {i} · {kind.split('_')[0]}" for i, kind in enumerate(HYBRID_LAYER_TYPES)]


def test_the_panels_draw_the_recorded_values_and_leave_full_layers_blank_where_they_have_none(hybrid_trace):
    view = MixingView()
    record = hybrid_trace.generated[2]
    view.show(record)
    panels = {trace.name: np.array(trace.z, dtype=float) for trace in view.figure.data}
    for layer, kind in enumerate(HYBRID_LAYER_TYPES):
        r = record.layers[layer]
        assert np.allclose(panels["output_gate"][layer], r.output_gate_means)
        for name in ("decay", "beta", "state_norm"):
            if kind == "linear_attention":
                assert np.allclose(panels[name][layer], getattr(r, name))
            else:
                assert np.isnan(panels[name][layer]).all()
    assert f"(position {record.position})" in view.figure.layout.title.text


def test_the_view_follows_the_stepper(hybrid_trace):
    view = MixingView()
    stepper = TokenStepper(hybrid_trace, on_step=view.show)
    stepper.go(2)
    assert view.record is hybrid_trace.generated[2]
    assert np.allclose(np.array(view.figure.data[1].z, dtype=float)[1], hybrid_trace.generated[2].layers[1].decay)


def test_a_model_without_linear_layers_shows_one_line_and_no_chart(trace, hybrid_trace):
    view = MixingView()
    folded = ("hidden", "0px")
    assert "Decode a prompt" in view.note.value and (view.holder.layout.visibility, view.holder.layout.max_height) \
        == folded
    view.show(hybrid_trace.generated[0])  # then a model of one kind picked in the same notebook
    view.show(trace.generated[0])
    assert view.kinds == {} and "no linear-attention layers" in view.note.value
    # the figure folded away, never taken out of the tree (a plotly view taken out threw at the next update)
    assert view.header.children == (view.note,) and view.holder.children == (view.figure,)
    assert (view.holder.layout.visibility, view.holder.layout.max_height) == folded
    # its static picture (what a saved notebook shows) says the same, with no empty panels
    assert view.figure.layout.title.text == NO_MIXER and not view.figure.layout.xaxis.visible
    assert not any(a.visible for a in view.figure.layout.annotations) and not view.figure.data[0].z


def test_notebook_01_labels_the_layers_of_a_hybrid_picked_in_its_model_picker(tmp_path, monkeypatch):
    config = {**get_preset("qwen3.5-moe-tiny").config, "torch_dtype": "float32"}
    folder = write_random_checkpoint(tmp_path / "ckpt", config, seed=9, bits=4, layout="stacked")
    write_byte_tokenizer(folder)
    monkeypatch.setenv("MOEBENCH_MODEL", str(folder))
    ns = run_notebook("01_decode_step_by_step")
    mixing, stepper, model = ns["mixing"], ns["stepper"], ns["controls"].picker.model
    assert model.args.model_type == "qwen3_5_moe" and mixing.record is stepper.current
    assert strip_kinds(mixing) == {i: layer.layer_type for i, layer in enumerate(model.layers)}
    stepper.go(len(stepper.records) - 1)
    assert mixing.record is stepper.records[-1] and mixing.figure._snapshot.handle is not None
