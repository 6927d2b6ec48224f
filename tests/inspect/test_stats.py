import math

import mlx.core as mx
import numpy as np
import pytest

from moebench.inspect import stats


def test_counts_and_fractions_flatten_leading_axes_and_accept_mlx():
    ids = np.array([[[0, 1], [1, 2]], [[1, 3], [0, 1]]])  # [B=2, L=2, K=2]
    counts = stats.expert_counts(ids, 5)
    assert counts.tolist() == [2, 4, 1, 1, 0]
    assert stats.expert_counts(mx.array(ids.reshape(-1, 2).astype(np.uint32)), 5).tolist() == counts.tolist()
    assert stats.expert_fractions(ids, 5) == pytest.approx([0.25, 0.5, 0.125, 0.125, 0.0])


def test_ids_out_of_range_or_not_integer_are_rejected():
    with pytest.raises(ValueError, match="outside 0..3"):
        stats.expert_counts(np.array([[0, 4]]), 4)
    with pytest.raises(ValueError, match="integer"):
        stats.expert_counts(np.array([[0.0, 1.0]]), 4)


def test_entropy_of_uniform_and_point_mass():
    assert stats.entropy(np.ones(16)) == pytest.approx(4.0)
    assert stats.normalized_entropy(np.ones(16)) == pytest.approx(1.0)
    assert stats.entropy([0, 0, 5, 0]) == pytest.approx(0.0)
    assert stats.entropy([1, 1], base=math.e) == pytest.approx(math.log(2))
    with pytest.raises(ValueError):
        stats.entropy([0, 0])


def test_router_entropy_is_mean_over_tokens():
    probs = np.array([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]])
    assert stats.router_entropy(probs) == pytest.approx(1.0)  # (2 bits + 0 bits) / 2
    assert stats.router_entropy(mx.array(probs[None].astype(np.float32))) == pytest.approx(1.0, abs=1e-6)


def test_load_cv():
    assert stats.load_cv([5, 5, 5, 5]) == 0.0
    assert stats.load_cv([0, 0, 0, 8]) == pytest.approx(math.sqrt(3))
    with pytest.raises(ValueError):
        stats.load_cv([0, 0])


def test_coactivation_counts_pairs_and_diagonal():
    ids = np.array([[0, 1], [1, 2], [0, 1], [2, 2]])
    c = stats.coactivation(ids, 3)
    assert c.tolist() == [[2, 2, 0], [2, 3, 1], [0, 1, 2]]
    assert (c == c.T).all()


def test_js_divergence_bounds_and_symmetry():
    p, q = np.array([1.0, 0, 0, 0]), np.array([0, 0, 3.0, 1.0])
    assert stats.js_divergence(p, p) == pytest.approx(0.0)
    assert stats.js_divergence(p, q) == pytest.approx(1.0)  # disjoint supports: the maximum, 1 bit
    r = np.array([0.5, 0.3, 0.2, 0.0])
    assert stats.js_divergence(r, q) == pytest.approx(stats.js_divergence(q, r))
    assert 0 < stats.js_divergence(r, q) < 1
    with pytest.raises(ValueError, match="length"):
        stats.js_divergence([1, 1], [1, 1, 1])
