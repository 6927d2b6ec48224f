"""route(): float32 softmax over all experts, top-k selection, renormalization, and what interventions do to it."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from moebench.errors import MoebenchError
from moebench.models.routing import Intervention, InterventionError, route

E, K = 8, 2


@pytest.fixture
def logits() -> mx.array:
    return mx.random.normal((5, E), key=mx.random.key(0)).astype(mx.bfloat16)


def as_np(*arrays):
    return [np.array(a) for a in arrays]


def test_plain_routing_picks_the_top_k_probabilities(logits):
    probs, ids, scores = as_np(*route(logits, K, norm_topk_prob=False))
    expected = np.exp(np.array(logits.astype(mx.float32)))
    expected /= expected.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(probs, expected, rtol=1e-6)
    assert probs.dtype == np.float32 and ids.dtype == np.uint32 and ids.shape == (5, K)
    for row in range(5):
        assert set(ids[row]) == set(np.argsort(-probs[row], kind="stable")[:K])
    assert np.array_equal(scores, np.take_along_axis(probs, ids.astype(np.int64), axis=-1))


def test_norm_topk_prob_renormalizes_the_selected_scores(logits):
    _, _, scores = as_np(*route(logits, K, norm_topk_prob=True))
    np.testing.assert_allclose(scores.sum(axis=-1), 1.0, rtol=1e-6)


def test_default_intervention_changes_nothing_bitwise(logits):
    plain = as_np(*route(logits, K, False))
    neutral = as_np(*route(logits, K, False, Intervention()))
    assert all(np.array_equal(a, b) for a, b in zip(plain, neutral, strict=True))


def test_forced_experts_keep_the_given_order_and_renormalize_when_the_family_does(logits):
    probs, ids, scores = as_np(*route(logits, K, True, Intervention(force_experts=[6, 1, 2])))
    assert (ids == np.array([6, 1, 2])).all()
    expected = probs[:, [6, 1, 2]]
    np.testing.assert_allclose(scores, expected / expected.sum(axis=-1, keepdims=True), rtol=1e-6)


def test_ablation_with_and_without_renormalization(logits):
    base, _, _ = as_np(*route(logits, K, False))
    probs, ids, scores = as_np(*route(logits, E - 1, False, Intervention(ablate=(4,))))
    assert np.array_equal(probs, base) and not (ids == 4).any()  # every other expert, original probabilities
    probs, ids, scores = as_np(*route(logits, K, False, Intervention(ablate=(4,), renormalize_ablation=True)))
    assert (probs[:, 4] == 0).all() and not (ids == 4).any()
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=1e-6)


def test_top_k_override(logits):
    _, ids, scores = as_np(*route(logits, K, False, Intervention(top_k=5)))
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
