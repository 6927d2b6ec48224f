"""The KV cache: growth, contents, and cached decoding equal to one full forward pass."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import moebench
from moebench.decode.cache import (
    GROW_STEP,
    KVCache,
    StaticCache,
    StaticLayerCache,
    StaticLinearState,
    StepPosition,
    make_cache,
)
from moebench.decode.state import LinearAttentionState


def test_update_returns_everything_seen_so_far():
    cache = KVCache()
    assert cache.state == () and cache.offset == 0
    chunks = [mx.random.normal((2, 3, n, 4), key=mx.random.key(n)) for n in (5, 1, GROW_STEP, 1)]
    for i, chunk in enumerate(chunks):
        keys, values = cache.update_and_fetch(chunk, chunk * 2)
        seen = mx.concatenate(chunks[: i + 1], axis=2)
        assert np.array_equal(np.array(keys), np.array(seen))
        assert np.array_equal(np.array(values), np.array(seen * 2))
    assert cache.offset == 5 + 1 + GROW_STEP + 1
    assert cache.keys.shape[2] >= cache.offset


def test_single_token_steps_rarely_reallocate():
    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 2, 7, 4)), mx.zeros((1, 2, 7, 4)))
    capacities = set()
    for _ in range(2 * GROW_STEP):
        cache.update_and_fetch(mx.ones((1, 2, 1, 4)), mx.ones((1, 2, 1, 4)))
        capacities.add(cache.keys.shape[2])
    assert len(capacities) <= 3  # at most one reallocation per GROW_STEP tokens


def test_values_may_have_their_own_head_dim():
    cache = KVCache()
    keys, values = cache.update_and_fetch(mx.zeros((1, 2, 3, 8)), mx.ones((1, 2, 3, 16)))
    assert keys.shape == (1, 2, 3, 8) and values.shape == (1, 2, 3, 16)


@pytest.fixture(scope="module")
def model(quantized_checkpoint):
    with moebench.fused_moe(False):
        yield moebench.load(quantized_checkpoint)[0]


TOKENS = [3, 141, 59, 26, 5, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28]


@pytest.mark.parametrize("chunks", [(18,), (1,) * 18, (10, 1, 1, 6), (4, 7, 7)])
def test_cached_chunks_equal_one_forward_pass(model, chunks):
    full = np.array(model(mx.array([TOKENS])))[0]
    cache = make_cache(len(model.layers))
    pieces, start = [], 0
    for n in chunks:
        pieces.append(np.array(model(mx.array([TOKENS[start : start + n]]), cache))[0])
        start += n
    assert cache[0].offset == len(TOKENS)
    assert np.abs(np.concatenate(pieces) - full).max() < 1e-4


def test_batched_decode_with_cache(model):
    batch = mx.array([TOKENS[:8], TOKENS[8:16]])
    cache = make_cache(len(model.layers))
    model(batch, cache)
    step = np.array(model(mx.array([[7], [9]]), cache))[:, -1]
    for row, (prompt, nxt) in enumerate(((TOKENS[:8], 7), (TOKENS[8:16], 9))):
        alone = np.array(model(mx.array([prompt + [nxt]])))[0, -1]
        assert np.abs(step[row] - alone).max() < 1e-4


def _static(layers: int = 3, capacity: int = 8) -> StaticCache:
    return StaticCache.empty(layers, 2, capacity, 4, mx.float32)


def test_static_cache_writes_every_layer_at_its_position_on_commit():
    cache = _static()
    for position, n in ((0, 3), (3, 1), (4, 2)):
        cache.position = StepPosition.at(mx.array(position, dtype=mx.int32), cache.capacity)
        before = np.array(cache.keys)
        for layer in cache.layers():
            layer.write(mx.full((1, 2, n, 4), 10.0 * layer.layer + position), mx.full((1, 2, n, 4), -1.0))
        assert np.array_equal(np.array(cache.keys), before)  # nothing written before the commit
        cache.commit()
    keys, values = np.array(cache.keys), np.array(cache.values)
    for layer in range(3):
        assert keys[layer, :, :, 0].tolist() == [[10.0 * layer] * 3 + [10.0 * layer + 3] + [10.0 * layer + 4] * 2
                                                 + [0.0] * 2] * 2
    assert (values[:, :, :6] == -1).all() and (values[:, :, 6:] == 0).all()


def test_static_layer_fetch_sees_its_own_new_positions_only():
    cache = _static()
    cache.position = StepPosition.at(mx.array(2, dtype=mx.int32), cache.capacity)
    layers = cache.layers()
    keys, values = layers[1].update_and_fetch(mx.ones((1, 2, 1, 4)), mx.full((1, 2, 1, 4), 2.0))
    assert keys.shape == (1, 2, 8, 4)
    assert np.array(keys)[0, :, :, 0].tolist() == [[0, 0, 1, 0, 0, 0, 0, 0]] * 2
    assert (np.array(values)[0, :, 2] == 2).all()
    assert layers[1].decode_buffers(2, 4, mx.float32)[3] == 1


def test_static_cache_refuses_a_missing_or_repeated_write():
    cache = _static()
    layers = cache.layers()
    new = mx.zeros((1, 2, 1, 4))
    layers[0].write(new, new)
    with pytest.raises(RuntimeError, match="layer 0 wrote its keys and values twice"):
        layers[0].write(new, new)
    with pytest.raises(RuntimeError, match=r"layers \[1, 2\] wrote no keys"):
        cache.commit()
    with pytest.raises(ValueError, match="9 new positions exceed the cache capacity 8"):
        layers[1].write(mx.zeros((1, 2, 9, 4)), mx.zeros((1, 2, 9, 4)))
    before = np.array(cache.keys)
    for layer in cache.layers():  # the failed forward's write is dropped, not written twice
        layer.write(mx.ones((1, 2, 1, 4)), mx.ones((1, 2, 1, 4)))
    cache.commit()
    assert np.array(cache.keys)[:, :, 0].sum() == 3 * 2 * 4 and before.sum() == 0


def test_in_place_writes_leave_the_buffers_and_one_forward_writes_one_way():
    cache = _static()
    new = mx.zeros((1, 2, 1, 4))
    layers = cache.layers()
    assert layers[0].static and not KVCache().static  # a plan's kernels write in place only into a static cache
    keys = np.array(cache.keys)
    for layer in layers:
        layer.written_in_place(mx.ones((1, 2, 1, 4)), mx.ones((1, 2, 1, 4)))
    cache.commit()
    assert np.array_equal(np.array(cache.keys), keys)  # the kernels stored them: no update is added
    layers = cache.layers()
    layers[0].written_in_place(new, new)
    with pytest.raises(RuntimeError, match="layer 0 wrote its keys and values twice"):
        layers[0].write(new, new)
    for layer in layers[1:]:
        layer.write(new, new)
    with pytest.raises(RuntimeError, match=r"layers \[0\] wrote their keys and values in place and the others"):
        cache.commit()


def _hybrid(keep: int = 2) -> StaticCache:
    """Layers 0 and 2 linear attention, 1 and 3 attending (blocks 0 and 1 of the buffers)."""
    states = [LinearAttentionState(keep), LinearAttentionState(keep)]
    return StaticCache.empty(2, 2, 8, 4, mx.float32, (None, 0, None, 1), states)


def _write_all(layers: list, value: float, n: int = 1) -> None:
    for layer in layers:
        if isinstance(layer, StaticLinearState):
            layer.write(mx.full((1, 3, 5), value + layer.layer), mx.full((1, 2, 4, 4), -value), n)
        else:
            layer.write(mx.full((1, 2, n, 4), value + layer.layer), mx.full((1, 2, n, 4), value))


def test_a_hybrid_static_cache_holds_blocks_for_attending_layers_and_states_for_the_others():
    """Each layer gets the view its token mixing takes; a linear layer's view reads its states as before the
    forward, and the commit writes them (kept for a rewind) with the attending layers' keys and values."""
    cache = _hybrid()
    layers = cache.layers()
    assert [type(c) for c in layers] == [StaticLinearState, StaticLayerCache] * 2
    assert all(c.static for c in layers) and [c.block for c in layers[1::2]] == [0, 1]
    assert layers[3].decode_buffers(2, 4, mx.float32)[3] == 1 and cache.keys.shape == (2, 2, 8, 4)
    assert layers[0].conv is None and layers[0].delta is None  # the empty state: the layer starts from zeros
    _write_all(layers, 10.0, n=3)
    assert cache.states[0].conv is None  # nothing written before the commit
    cache.commit()
    assert [s.offset for s in cache.states] == [3, 3]
    assert np.array(cache.states[1].conv).max() == 12.0 and np.array(cache.states[0].delta).min() == -10.0
    assert np.array(cache.keys)[:, 0, :3, 0].tolist() == [[11.0] * 3, [13.0] * 3]
    conv = cache.states[0].conv
    cache.position = StepPosition.at(mx.array(3, dtype=mx.int32), cache.capacity)
    layers = cache.layers()
    assert layers[0].conv is conv
    _write_all(layers, 20.0)
    cache.commit()
    cache.states[0].rewind_to(3)
    assert cache.states[0].conv is conv


def test_a_hybrid_static_cache_names_the_layer_that_wrote_twice_or_not_at_all():
    cache = _hybrid()
    layers = cache.layers()
    state = (mx.zeros((1, 3, 5)), mx.zeros((1, 2, 4, 4)), 1)
    layers[2].write(*state)
    with pytest.raises(RuntimeError, match="layer 2 wrote its recurrent state twice"):
        layers[2].write(*state)
    new = mx.zeros((1, 2, 1, 4))
    layers[3].write(new, new)
    with pytest.raises(RuntimeError, match=r"layers \[1\] wrote no keys and values"):
        cache.commit()
    layers[1].write(new, new)
    with pytest.raises(RuntimeError, match=r"layers \[0\] wrote no recurrent state"):
        cache.commit()
    assert [s.offset for s in cache.states] == [0, 0]  # a failed commit wrote no state
    _write_all(cache.layers(), 1.0)  # a new forward: what the failed one handed over is dropped
    cache.commit()
    assert [s.offset for s in cache.states] == [1, 1]
    with pytest.raises(ValueError, match="name 2 blocks and 1 states"):
        StaticCache.empty(2, 2, 8, 4, mx.float32, (None, 0, 1), [])
