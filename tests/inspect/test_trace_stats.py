"""Routing statistics over a recorded decode: load, entropy, imbalance, co-activation, expert logit lens."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import moebench
from moebench.errors import MoebenchError
from moebench.inspect.interventions import intervene
from moebench.inspect.record import Stepper
from moebench.inspect.trace_stats import coactivation, expert_logit_lens, load, summary, usage_divergence

PROMPT = [30, 31, 32, 200, 201, 202, 9]


@pytest.fixture(scope="module")
def tiny(quantized_checkpoint):
    return moebench.load(quantized_checkpoint)


@pytest.fixture(scope="module")
def forced(tiny):
    """Layer 1 forced to experts (2, 5): its load and co-activation are known exactly."""
    model, tok = tiny
    with intervene(model, {1: moebench.Intervention(force_experts=(2, 5))}):
        return Stepper(model, tok, PROMPT, record=True).run(6)


def test_load_counts_every_selection(forced):
    table = load(forced)
    tokens = len(forced.steps)
    k = len(forced.steps[0].layers[0].topk_ids)
    layer0 = table[table["layer"] == 0]
    expected = np.bincount(np.concatenate([s.layers[0].topk_ids for s in forced.steps]), minlength=len(layer0))
    assert layer0["count"].tolist() == expected.tolist() and layer0["count"].sum() == tokens * k
    assert layer0["fraction"].sum() == pytest.approx(1.0)
    layer1 = table[table["layer"] == 1].set_index("expert")["count"]
    assert layer1[2] == layer1[5] == tokens and layer1.sum() == 2 * tokens
    assert load(forced, phase="prefill")["count"].sum() == 2 * len(PROMPT) * k


def test_summary_and_coactivation_of_a_forced_layer(forced):
    table = summary(forced).set_index("layer")
    n = len(forced.steps[0].layers[1].router_probs)
    assert table.loc[1, "load_entropy"] == pytest.approx(1.0)  # bits: two experts, equally loaded
    assert table.loc[1, "load_cv"] == pytest.approx(math.sqrt(n / 2 - 1))  # two of n experts, equally loaded
    assert table.loc[1, "max_entropy"] == pytest.approx(math.log2(n))
    assert ((table["router_entropy"] > 0) & (table["router_entropy"] <= math.log2(n))).all()
    assert (table["tokens"] == len(forced.steps)).all()
    matrix = coactivation(forced, 1)
    assert matrix[2, 5] == matrix[5, 2] == matrix[2, 2] == len(forced.steps) and matrix.sum() == 4 * len(forced.steps)
    free = coactivation(forced, 0)
    assert np.array_equal(free, free.T)
    assert np.diag(free).tolist() == load(forced).query("layer == 0")["count"].tolist()


def test_usage_divergence_between_traces(tiny, forced):
    model, _ = tiny
    plain = Stepper(model, None, PROMPT, record=True).run(6)
    prompt_only = usage_divergence(forced, plain, phase="prefill").set_index("layer")["js_divergence"]
    assert prompt_only[0] == 0  # on the prompt, layer 0 is upstream of the intervention: identical routing
    assert 0 < prompt_only[1] <= 1
    assert usage_divergence(forced, forced)["js_divergence"].tolist() == [0.0, 0.0]


def test_expert_logit_lens_projects_the_mean_expert_output(tiny, forced):
    model, tok = tiny
    table = expert_logit_lens(model, forced, tok, top=3)
    lens = table[(table["layer"] == 1) & (table["expert"] == 2)].sort_values("rank")
    assert lens["selections"].tolist() == [len(forced.steps)] * 3
    mean = np.mean([s.layers[1].expert_out[list(s.layers[1].topk_ids).index(2)] for s in forced.steps], axis=0)
    logits = np.array(model.unembed(model.model.norm(mx.array(mean)[None]))[0])
    assert lens["token_id"].tolist() == np.argsort(-logits, kind="stable")[:3].tolist()
    np.testing.assert_allclose(lens["logit"], np.sort(logits)[::-1][:3], rtol=1e-5)
    assert lens["text"].tolist() == [tok.decode([t]) for t in lens["token_id"]]
    selected = load(forced).query("count > 0")
    assert len(table) == 3 * len(selected)


def test_statistics_need_recorded_layers(tiny):
    model, _ = tiny
    plain = Stepper(model, None, PROMPT).run(2)
    with pytest.raises(MoebenchError, match="record=True"):
        summary(plain)
    with pytest.raises(MoebenchError, match="phase"):
        load(plain, phase="decoding")
