"""Interventions change exactly what they name, for the rest of a decode, and clearing restores the baseline."""

from __future__ import annotations

import re

import numpy as np
import pytest

import moebench
from moebench.inspect.interventions import active_interventions, clear_interventions, intervene, set_interventions
from moebench.inspect.record import Stepper
from moebench.models.routing import Intervention, InterventionError

PROMPT = [9, 120, 33, 7, 250, 61]


@pytest.fixture(scope="module")
def tiny(quantized_checkpoint):
    model, _ = moebench.load(quantized_checkpoint)
    return model


@pytest.fixture(scope="module")
def baseline(tiny):
    return Stepper(tiny, None, PROMPT, record=True, keep_logits=True).run(5)


@pytest.fixture(autouse=True)
def clean(tiny):
    clear_interventions(tiny)
    yield
    clear_interventions(tiny)


def run_with(model, interventions):
    with intervene(model, interventions):
        return Stepper(model, None, PROMPT, record=True, keep_logits=True).run(5)


def last_layer(model) -> int:
    return max(model.moe_blocks())


def prompt_pairs(baseline, trace, layer):
    """(baseline, intervened) records of `layer` at every prompt position: the intervened layer is the
    last one, so in prefill its input is untouched and only its own change shows."""
    return [(b.layers[layer], t.layers[layer]) for b, t in zip(baseline.prefill, trace.prefill, strict=True)]


def test_force_experts_uses_exactly_those_with_their_router_probabilities(tiny, baseline):
    layer = last_layer(tiny)
    trace = run_with(tiny, {layer: Intervention(force_experts=(3, 0, 5))})
    for b, t in prompt_pairs(baseline, trace, layer):
        assert np.array_equal(t.router_logits, b.router_logits)
        assert sorted(t.topk_ids) == [0, 3, 5] and t.expert_out.shape[0] == 3
        assert np.array_equal(t.topk_scores, b.router_probs[t.topk_ids])
    assert all(sorted(s.layers[layer].topk_ids) == [0, 3, 5] for s in trace.steps)


@pytest.mark.parametrize("renormalize", [False, True])
def test_ablation_removes_the_expert_and_states_its_renormalization(tiny, baseline, renormalize):
    layer = last_layer(tiny)
    victim = int(baseline.prefill[0].layers[layer].topk_ids[0])  # the favourite at position 0
    trace = run_with(tiny, {layer: Intervention(ablate=(victim,), renormalize_ablation=renormalize)})
    k = tiny.args.num_experts_per_tok
    for b, t in prompt_pairs(baseline, trace, layer):
        assert victim not in t.topk_ids
        kept = np.delete(np.arange(len(b.router_probs)), victim)
        expected_probs = b.router_probs.copy()
        if renormalize:
            expected_probs[kept] = b.router_probs[kept] / b.router_probs[kept].sum()
            expected_probs[victim] = 0
            np.testing.assert_allclose(t.router_probs, expected_probs, rtol=1e-5, atol=1e-7)
        else:
            assert np.array_equal(t.router_probs, b.router_probs)
        assert set(t.topk_ids) == set(kept[np.argsort(-expected_probs[kept], kind="stable")[:k]])
        np.testing.assert_allclose(t.topk_scores, expected_probs[t.topk_ids], rtol=1e-5)
    assert all(victim not in s.layers[layer].topk_ids for s in trace.steps)


def test_top_k_changes_the_number_of_experts(tiny, baseline):
    layer = last_layer(tiny)
    trace = run_with(tiny, {layer: Intervention(top_k=5)})
    for b, t in prompt_pairs(baseline, trace, layer):
        assert t.expert_out.shape[0] == 5
        assert set(t.topk_ids) == set(np.argsort(-b.router_probs, kind="stable")[:5])
    assert {len(s.layers[layer].topk_ids) for s in trace.steps} == {5}
    others = {len(r.topk_ids) for s in trace.steps for i, r in s.layers.items() if i != layer}
    assert others == {tiny.args.num_experts_per_tok}


def test_shared_expert_off_and_gate_scale(tiny, baseline):
    layer = last_layer(tiny)
    off = run_with(tiny, {layer: Intervention(shared_expert=False)})
    for b, t in prompt_pairs(baseline, off, layer):
        assert t.shared_out is None and t.shared_gate is None
        assert np.array_equal(t.block_out, t.routed_out) and np.array_equal(t.routed_out, b.routed_out)
    scaled = run_with(tiny, {layer: Intervention(shared_gate_scale=0.25)})
    for b, t in prompt_pairs(baseline, scaled, layer):
        assert t.shared_gate == pytest.approx(b.shared_gate * 0.25, rel=1e-6)
        assert np.array_equal(t.shared_out, b.shared_out)
    assert not np.array_equal(scaled.steps[-1].logits, baseline.steps[-1].logits)


def test_clearing_restores_the_baseline_bitwise(tiny, baseline):
    set_interventions(tiny, Intervention(top_k=1, shared_gate_scale=3.0))  # every MoE layer
    changed = Stepper(tiny, None, PROMPT, keep_logits=True).run(5)
    assert not np.array_equal(changed.steps[-1].logits, baseline.steps[-1].logits)
    clear_interventions(tiny)
    again = Stepper(tiny, None, PROMPT, keep_logits=True).run(5)
    assert again.token_ids == baseline.token_ids
    assert all(np.array_equal(a.logits, b.logits) for a, b in zip(again.steps, baseline.steps, strict=True))


def test_intervene_restores_the_previous_interventions(tiny):
    first = {0: Intervention(top_k=1)}
    set_interventions(tiny, first)
    with intervene(tiny, {0: Intervention(ablate=(1,)), 1: Intervention(shared_expert=False)}):
        assert active_interventions(tiny)[1] == Intervention(shared_expert=False)
    assert active_interventions(tiny) == first


def test_bad_interventions_are_rejected_before_any_is_set(tiny):
    n = tiny.args.num_experts
    with pytest.raises(InterventionError, match="not a MoE layer"):
        set_interventions(tiny, {0: Intervention(top_k=1), 99: Intervention(top_k=1)})
    assert active_interventions(tiny) == {}
    with pytest.raises(InterventionError, match="valid ids"):
        set_interventions(tiny, Intervention(force_experts=(n,)))
    with pytest.raises(InterventionError, match="top_k"):
        set_interventions(tiny, Intervention(top_k=n + 1))
    with pytest.raises(InterventionError, match="top_k"):
        set_interventions(tiny, {0: Intervention(ablate=(0,), top_k=n)})
    with pytest.raises(InterventionError, match="expected a moebench.Intervention"):
        set_interventions(tiny, {0: "top_k=1"})
    with pytest.raises(InterventionError, match="not a MoE layer"):
        clear_interventions(tiny, [99])


@pytest.mark.parametrize("interventions, words", [
    ([Intervention(top_k=1)], "a mapping {layer: Intervention}, got list"), (None, "got NoneType"),
    ((Intervention(top_k=1),), "got tuple"), ({True: Intervention(top_k=1)}, "layer True is not a MoE layer"),
    ({"0": Intervention(top_k=1)}, "layer '0' is not a MoE layer"), ({-1: Intervention(top_k=1)}, "layer -1"),
    ({1.0: Intervention(top_k=1)}, "layer 1.0"), ({np.int64(1): None}, "expected a moebench.Intervention"),
])
def test_interventions_given_in_another_shape_are_named(tiny, interventions, words):
    with pytest.raises(InterventionError, match=re.escape(words)):
        set_interventions(tiny, interventions)
    with pytest.raises(InterventionError, match=re.escape(words)), intervene(tiny, interventions):
        pass
    assert active_interventions(tiny) == {}


def test_numpy_layer_indices_are_layers(tiny):
    set_interventions(tiny, {np.int64(1): Intervention(top_k=1)})
    assert list(active_interventions(tiny)) == [1] and type(next(iter(active_interventions(tiny)))) is int
    clear_interventions(tiny, [np.int64(1)])
    assert active_interventions(tiny) == {}


@pytest.mark.parametrize("layers, words", [(5, "layers must be a list"), ("01", "layers must be a list"),
                                           ({0: 1}, "layers must be a list"), ([True], "layer True"),
                                           ([0, 99], "layer 99"), ([None], "layer None")])
def test_clearing_names_what_is_not_a_list_of_moe_layers(tiny, layers, words):
    set_interventions(tiny, {0: Intervention(top_k=1)})
    with pytest.raises(InterventionError, match=re.escape(words)):
        clear_interventions(tiny, layers)
    assert list(active_interventions(tiny)) == [0]  # all checked before any is cleared


@pytest.mark.parametrize("intervention", [Intervention(force_experts=(1, 2)), Intervention(ablate=(0, 3), top_k=1),
                                          Intervention(shared_expert=False), Intervention(shared_gate_scale=0.5)],
                         ids=["force", "ablate-topk", "shared-off", "gate-scale"])
def test_every_decode_path_takes_every_intervention(tiny, intervention):
    """generate (eager and compiled) and a Stepper (recording or not), with the fused kernels on and off: one
    set of tokens for each switch position, and the forced experts are what the records show."""
    with intervene(tiny, {1: intervention}):
        tokens = {}
        for fused in (True, False):
            with moebench.fused_moe(fused, tiny):
                for compiled in (False, True):
                    result = moebench.generate(tiny, PROMPT, 6, compiled=compiled)
                    tokens[fused, "generate", compiled] = result.token_ids
                for record in (False, True):
                    trace = Stepper(tiny, None, PROMPT, record=record, max_tokens=6).run(6)
                    tokens[fused, "stepper", record] = trace.token_ids
                    if record and intervention.force_experts is not None:
                        assert all(set(s.layers[1].topk_ids) == {1, 2} for s in trace.steps)
        for fused in (True, False):
            assert len({tuple(t) for (f, *_), t in tokens.items() if f == fused}) == 1, tokens
    moe_counts = moebench.dispatch(tiny)["moe"][1]
    assert moe_counts["fused"] and any("intervention is set" in n for n in moe_counts["notes"])
