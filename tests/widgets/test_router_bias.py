"""The router's bias shown apart from its logits (issue 36): a tiny gpt-oss saved by transformers at gpt-oss-20b's
routing shape (32 experts, top-4), decoded and recorded; the router view given the model draws each picked expert's
logit as x.W + bias. The parts shown sum to the recorded logits, the bias shown is the checkpoint's weight, x.W is
the MoE block's input through the router's matrix; a model without a router bias is drawn as before; the layout
reads well at 32 and 128 experts top-4. A selection-biased router's (GLM-4.x, issue 55): what its bias alone put in
and kept out of the top-k, marked."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from plotly_events import click
from widget_inputs import biased_step

import moebench
from moebench.inspect.record import Stepper
from moebench.widgets.router import BASE_TRACES, SPLIT_TITLE, RouterView, logit_text

pytest.importorskip("torch", reason="the gpt-oss folder is written by transformers (dev dependency torch)")

EXPERTS, TOP_K = 32, 4
GPT_OSS = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=32, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
               sliding_window=4, rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False,
               eos_token_id=None)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(folder, model, a recorded step) of a tiny gpt-oss with random weights and router biases."""
    from byte_tokenizer import write_byte_tokenizer
    from models.hf_reference import save_hf_checkpoint
    from transformers import GptOssConfig, GptOssForCausalLM

    folder = save_hf_checkpoint(tmp_path_factory.mktemp("gpt-oss") / "ckpt", GptOssConfig, GptOssForCausalLM,
                                GPT_OSS, seed=3)
    write_byte_tokenizer(folder)
    model, tokenizer = moebench.load(folder)
    record = Stepper(model, tokenizer, "def add(a, b):", record=True).run(2).generated[1]
    return folder, model, record


def bars(view) -> tuple:
    heat, boxes, shared, ablated, bias_in, bias_out, xw, bias = view.figure.data
    return xw, bias


def test_the_parts_shown_sum_to_the_recorded_logits_and_the_bias_is_the_weight(gpt_oss):
    from safetensors.numpy import load_file

    folder, model, record = gpt_oss
    weights = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
    view = RouterView(model=model)
    view.show(record)
    layers = sorted(record.layers)
    assert sorted(view.biases) == layers
    xw, bias = bars(view)
    assert list(xw.y) == list(bias.y) == [f"L{layer}" for layer in layers for _ in range(TOP_K)]
    for row, layer in enumerate(layers):
        ids = view.marked[layer]
        shown = slice(row * TOP_K, (row + 1) * TOP_K)
        logits = record.layers[layer].router_logits
        weight = weights[f"model.layers.{layer}.mlp.router.bias"]
        assert [c[0] for c in xw.customdata[shown]] == ids == list(record.layers[layer].topk_ids)
        np.testing.assert_array_equal(bias.x[shown], weight[ids])  # the bias shown is the checkpoint's weight
        np.testing.assert_array_equal(bias.base[shown], xw.x[shown])  # the bias starts where x.W ends
        np.testing.assert_allclose(np.add(xw.x[shown], bias.x[shown]), logits[ids], rtol=1e-12, atol=0)
        # x.W is what the router's matrix makes of the MoE block's input (its norm of the recorded residual)
        block = model.moe_blocks()[layer]
        x = model.layers[layer].post_attention_layernorm(mx.array(record.layers[layer].resid_mid))
        np.testing.assert_allclose(xw.x[shown], np.array(block.gate.matmul(x))[ids], atol=1e-5)
        heat = view.figure.data[0]
        for column, e in enumerate(view.axis.ids[:3]):  # every cell's hover says how its logit is made
            assert heat.customdata[row][column][1].endswith(logit_text(logits[e] - weight[e], logits[e], weight[e]))
    assert SPLIT_TITLE in [a.text for a in view.figure.layout.annotations]
    assert xw.hovertemplate == bias.hovertemplate and "= x·W" in xw.hovertemplate


def test_a_click_names_the_logits_parts(gpt_oss):
    _, model, record = gpt_oss
    view = RouterView(model=model)
    view.show(record)
    expert = view.marked[1][0]
    click(view.figure, 0, int(view.axis.position[expert]), "L1")
    logit = record.layers[1].router_logits[expert]
    assert view.picked == (1, expert) and "picked #1" in view.readout.value
    assert f"logit {logit:.3f} = x·W {logit - view.biases[1][expert]:.3f} + bias {view.biases[1][expert]:.3f}" \
        in view.readout.value


def drawn(view) -> dict:
    """What a figure draws: its plotly JSON less the traces' random ids and the title (which names the model)."""
    figure = view.figure.to_plotly_json()
    return {"layout": {k: v for k, v in figure["layout"].items() if k != "title"},
            "data": [{k: v for k, v in trace.items() if k != "uid"} for trace in figure["data"]]}


def test_a_model_without_a_router_bias_is_drawn_as_before_and_a_switch_back_restores_it(gpt_oss, tiny, trace):
    _, oss_model, oss_record = gpt_oss
    qwen, _ = tiny
    before = RouterView()
    before.show(trace.generated[1])
    view = RouterView(model=qwen)
    assert view.biases == {}
    view.show(trace.generated[1])
    assert drawn(view) == drawn(before) and f" on {qwen.load_info.source.name}: " in view.figure.layout.title.text
    view.model = oss_model
    view.show(oss_record)
    assert view.figure.layout.width > before.figure.layout.width and len(view.figure.data) == BASE_TRACES + 2
    view.model = qwen
    view.show(trace.generated[1])
    assert drawn(view) == drawn(before)


def test_a_bias_of_another_size_is_named(gpt_oss):
    _, model, record = gpt_oss
    view = RouterView(model=model)
    view.biases = {layer: np.zeros(EXPERTS + 1) for layer in record.layers}
    with pytest.raises(ValueError, match=rf"router bias of MoE layer 0 has {EXPERTS + 1} experts but the record "
                                         rf"has {EXPERTS}: set view.model"):
        view.show(record)


@pytest.mark.parametrize("n, layers", [(32, 24), (128, 36)])  # gpt-oss-20b's and -120b's routing shapes
def test_32_and_128_experts_top4_read_well_beside_the_logit_panel(n, layers):
    record, biases = biased_step(n, layers, TOP_K, seed=n)
    view = RouterView()
    view.biases = biases
    view.show(record)
    heat, boxes, shared, ablated, _bias_in, _bias_out, xw, bias = view.figure.data
    axis = view.figure.layout.xaxis
    assert axis.domain[1] < view.figure.layout.xaxis2.domain[0] < view.figure.layout.xaxis2.domain[1] \
        < view.figure.layout.xaxis3.domain[0]  # three panels side by side, none overlapping
    assert view.axis.step * view.axis.column_px >= len(str(n - 1)) * 0.62 * 10 + 6  # labels cannot overlap
    assert list(axis.ticktext) == [str(v) for v in range(0, n, view.axis.step)]
    half = boxes.marker.size / 2 / view.axis.column_px  # the boxes on the first and last expert stay inside
    assert axis.range[0] <= -half and axis.range[1] >= n - 1 + half
    assert len(boxes.x) == len(xw.x) == TOP_K * layers
    assert boxes.mode == ("markers+text" if view.axis.column_px >= 18 else "markers")
    # the four bars of a row stay inside it, one after the other, rank #1 first
    offsets, widths = np.asarray(xw.offset[:TOP_K]), np.asarray(xw.width[:TOP_K])
    assert offsets[0] >= -0.5 and offsets[-1] + widths[-1] <= 0.5 and np.all(np.diff(offsets) >= widths[:-1])
    np.testing.assert_allclose(np.add(xw.x, bias.x), [record.layers[layer].router_logits[e]
                                                      for layer in range(layers) for e in view.marked[layer]])


def test_a_selection_biased_router_marks_what_its_bias_put_in_and_kept_out(tmp_path):
    """GLM's grouped sigmoid router: the view marks each pick its selection bias alone made (an orange box) and each
    expert the bias kept out of the top-k (an orange ring), as the record's selection_bias_effect says, and the
    hover says so; at least one of the steps shows one of each."""
    from moebench.tools.presets import write_random

    folder = write_random(tmp_path / "glm", "glm4-moe-tiny", bits=4, group_size=64, dtype="float32", progress=False)
    model, tokenizer = moebench.load(folder)
    view = RouterView(model=model)
    shown = {"in": 0, "out": 0}
    for step in Stepper(model, tokenizer, "def add(a, b):", record=True).run(6).generated:
        view.show(step)
        bias_in, bias_out = view.figure.data[4:6]
        want_in = [(int(view.axis.position[e]), f"L{layer}") for layer in sorted(step.layers)
                   for e in step.layers[layer].selection_bias_effect()[0]]
        want_out = [(int(view.axis.position[e]), f"L{layer}") for layer in sorted(step.layers)
                    for e in step.layers[layer].selection_bias_effect()[1]]
        assert list(zip(bias_in.x, bias_in.y, strict=True)) == want_in
        assert list(zip(bias_out.x, bias_out.y, strict=True)) == want_out
        assert bias_in.showlegend == bool(want_in) and bias_out.showlegend == bool(want_out)
        hovers = [c[1] for row in view.figure.data[0].customdata for c in row]
        assert sum("selection bias alone" in h for h in hovers) == len(want_in)
        shown["in"] += len(want_in)
        shown["out"] += len(want_out)
    assert shown["in"] > 0 and shown["out"] > 0
