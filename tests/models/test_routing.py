"""route(): float32 softmax over all experts (or sigmoid scores chosen with a selection bias in groups), top-k
selection, renormalization and scaling, and what interventions do to it."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from moebench.errors import MoebenchError
from moebench.models.declare import SIGMOID_GROUPED, MoeSpec
from moebench.models.routing import Intervention, InterventionError, route

E, K = 8, 2


@pytest.fixture
def logits() -> mx.array:
    return mx.random.normal((5, E), key=mx.random.key(0)).astype(mx.bfloat16)


def as_np(*arrays):
    return [np.array(a) for a in arrays]


def softmax_spec(k: int = K, norm: bool = False) -> MoeSpec:
    return MoeSpec(E, k, renormalize=norm)


def test_plain_routing_picks_the_top_k_probabilities(logits):
    probs, ids, scores = as_np(*route(logits, softmax_spec(K, False)))
    expected = np.exp(np.array(logits.astype(mx.float32)))
    expected /= expected.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(probs, expected, rtol=1e-6)
    assert probs.dtype == np.float32 and ids.dtype == np.uint32 and ids.shape == (5, K)
    for row in range(5):
        assert set(ids[row]) == set(np.argsort(-probs[row], kind="stable")[:K])
    assert np.array_equal(scores, np.take_along_axis(probs, ids.astype(np.int64), axis=-1))


def test_norm_topk_prob_renormalizes_the_selected_scores(logits):
    _, _, scores = as_np(*route(logits, softmax_spec(K, True)))
    np.testing.assert_allclose(scores.sum(axis=-1), 1.0, rtol=1e-6)


def test_default_intervention_changes_nothing_bitwise(logits):
    plain = as_np(*route(logits, softmax_spec(K, False)))
    neutral = as_np(*route(logits, softmax_spec(K, False), Intervention()))
    assert all(np.array_equal(a, b) for a, b in zip(plain, neutral, strict=True))


def test_forced_experts_keep_the_given_order_and_renormalize_when_the_family_does(logits):
    probs, ids, scores = as_np(*route(logits, softmax_spec(K, True), Intervention(force_experts=[6, 1, 2])))
    assert (ids == np.array([6, 1, 2])).all()
    expected = probs[:, [6, 1, 2]]
    np.testing.assert_allclose(scores, expected / expected.sum(axis=-1, keepdims=True), rtol=1e-6)


def test_ablation_with_and_without_renormalization(logits):
    base, _, _ = as_np(*route(logits, softmax_spec(K, False)))
    probs, ids, scores = as_np(*route(logits, softmax_spec(E - 1, False), Intervention(ablate=(4,))))
    assert np.array_equal(probs, base) and not (ids == 4).any()  # every other expert, original probabilities
    renormalized = Intervention(ablate=(4,), renormalize_ablation=True)
    probs, ids, scores = as_np(*route(logits, softmax_spec(K, False), renormalized))
    assert (probs[:, 4] == 0).all() and not (ids == 4).any()
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=1e-6)


def test_top_k_override(logits):
    _, ids, scores = as_np(*route(logits, softmax_spec(K, False), Intervention(top_k=5)))
    assert ids.shape == (5, 5) and scores.shape == (5, 5)


def test_interventions_compare_by_value_and_lists_become_tuples():
    a, b = Intervention(force_experts=[1, 2], ablate=[3]), Intervention(force_experts=(1, 2), ablate=(3,))
    assert a == b and hash(a) == hash(b) and a.ablate == (3,)


@pytest.mark.parametrize("fields, message", [
    (dict(force_experts=(E,)), "valid ids"),
    (dict(ablate=(True,)), "not an integer"),  # types are checked when the intervention is made
    (dict(ablate=3), "must list expert ids"),
    (dict(top_k=2.0), "top_k must be an integer"),
    (dict(shared_expert="no"), "True or False"),
    (dict(force_experts=()), "at least one"),
    (dict(force_experts=(1, 1)), "twice"),
    (dict(force_experts=(1, 2), ablate=(2,)), "ablated"),
    (dict(force_experts=(1,), top_k=1), "not both"),
    (dict(top_k=0), "top_k"),
    (dict(ablate=tuple(range(E - 1)), top_k=2), "top_k"),
    (dict(ablate=tuple(range(E))), "every one of the"),
    (dict(shared_gate_scale=math.nan), "finite"),
    (dict(ablate=tuple(range(E - 1))), "fewer than the layer's top-2"),
])
def test_validation_names_the_problem(fields, message):
    with pytest.raises(InterventionError, match=message) as info:
        Intervention(**fields).validate(E, K)
    assert isinstance(info.value, MoebenchError) and isinstance(info.value, ValueError)


def grouped_reference(logits: np.ndarray, bias: np.ndarray, k: int, n_group: int, topk_group: int, norm: bool,
                      scale: float) -> tuple[np.ndarray, np.ndarray]:
    """transformers' DeepseekV3 / Glm4Moe routing, token by token in float64: (chosen ids as sets, their weights)."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    ids, weights = [], []
    for row in scores:
        choice = (row + bias).reshape(n_group, -1)
        group_rank = np.sort(choice, axis=-1)[:, -2:].sum(axis=-1)
        keep = np.argsort(-group_rank, kind="stable")[:topk_group]
        masked = np.full_like(choice, -np.inf)
        masked[keep] = choice[keep]
        top = np.argsort(-masked.reshape(-1), kind="stable")[:k]
        w = row[top] / (row[top].sum() if norm else 1.0) * scale
        ids.append(top)
        weights.append(dict(zip(top.tolist(), w.tolist(), strict=True)))
    return ids, weights


@pytest.mark.parametrize("n_group, topk_group, norm, scale", [(1, 1, True, 1.0), (4, 2, True, 2.5),
                                                              (4, 1, False, 1.0), (2, 2, True, 1.8)])
def test_sigmoid_grouped_routing_matches_transformers(n_group, topk_group, norm, scale):
    logits = mx.random.normal((6, 16), key=mx.random.key(1))
    bias = mx.random.normal((16,), key=mx.random.key(2)) * 0.5  # large enough to change choices
    spec = MoeSpec(16, 2, SIGMOID_GROUPED, renormalize=norm, selection_bias=True, n_group=n_group,
                   topk_group=topk_group, routed_scaling=scale)
    probs, ids, scores = as_np(*route(logits, spec, selection_bias=bias))
    want_ids, want_weights = grouped_reference(np.array(logits), np.array(bias), 2, n_group, topk_group, norm, scale)
    np.testing.assert_allclose(probs, 1 / (1 + np.exp(-np.array(logits, np.float64))), rtol=1e-6)
    for row in range(6):
        assert set(ids[row].tolist()) == set(want_ids[row].tolist())
        for i, w in zip(ids[row].tolist(), scores[row].tolist(), strict=True):
            assert w == pytest.approx(want_weights[row][i], rel=1e-5)


def test_the_selection_bias_chooses_but_does_not_weigh():
    logits = mx.array([[0.0, 0.1, 0.2, 0.3]])
    spec = MoeSpec(4, 1, SIGMOID_GROUPED, selection_bias=True)
    _, ids, scores = as_np(*route(logits, spec, selection_bias=mx.array([5.0, 0.0, 0.0, 0.0])))
    assert ids.tolist() == [[0]] and scores[0, 0] == pytest.approx(0.5)  # sigmoid(0), not sigmoid(0) + 5
    _, ids, _ = as_np(*route(logits, spec))
    assert ids.tolist() == [[3]]


def test_sigmoid_routing_honours_interventions():
    logits = mx.random.normal((3, 16), key=mx.random.key(3))
    spec = MoeSpec(16, 4, SIGMOID_GROUPED, renormalize=True, n_group=4, topk_group=2, routed_scaling=2.0)
    probs, ids, scores = as_np(*route(logits, spec))
    top = ids[0, np.argmax(scores[0])]
    probs2, ids2, scores2 = as_np(*route(logits, spec, Intervention(ablate=(int(top),), renormalize_ablation=True)))
    assert np.array_equal(probs, probs2) and not (ids2[0] == top).any()
    np.testing.assert_allclose(scores2.sum(axis=-1), 2.0, rtol=1e-6)  # renormalised, then scaled
    _, ids3, scores3 = as_np(*route(logits, spec, Intervention(force_experts=[0, 15])))
    assert (ids3 == [0, 15]).all()
    np.testing.assert_allclose(scores3, probs[:, [0, 15]] / probs[:, [0, 15]].sum(-1, keepdims=True) * 2, rtol=1e-6)


@pytest.mark.parametrize("fields, message", [
    (dict(n_group=3), "divide"), (dict(n_group=4, topk_group=5, scoring=SIGMOID_GROUPED), "keep"),
    (dict(n_group=4, topk_group=2), "only with"), (dict(n_group=16, scoring=SIGMOID_GROUPED), "two best"),
    (dict(n_group=8, topk_group=1, top_k=4, scoring=SIGMOID_GROUPED), "fewer experts than top-4"),
])
def test_grouped_declarations_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        MoeSpec(**{"num_experts": 16, "top_k": 2, **fields})
