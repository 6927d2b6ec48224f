"""Linear and Embedding built from checkpoint tensors, float or quantized, and their shape checks."""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from moebench.checkpoint.config import Quantization, QuantSpec
from moebench.checkpoint.files import TensorStore
from moebench.checkpoint.quant import QuantizedParts
from moebench.errors import CheckpointError
from moebench.models.layers import Embedding, Linear, RowStack, load_linear, stack_rows

KEY = mx.random.key(7)


def store_of(tmp_path: Path, tensors: dict[str, mx.array]) -> TensorStore:
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors)
    return TensorStore(tmp_path)


def dequantized(q, s, b, gs=64, bits=4):
    return mx.dequantize(q, s, b, group_size=gs, bits=bits)


def test_float_linear_with_bias():
    w, b, x = mx.random.normal((6, 4), key=KEY), mx.arange(6, dtype=mx.float32), mx.random.normal((3, 4))
    assert np.allclose(np.array(Linear(w, b)(x)), np.array(x) @ np.array(w).T + np.arange(6), atol=1e-5)
    assert Linear(w).quantized_parts() is None


@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 32), (6, 128), (3, 64)])
def test_quantized_linear_matches_its_dequantized_matrix(tmp_path, bits, gs):
    w = mx.random.normal((16, 128), key=KEY)
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    store = store_of(tmp_path, {"m.weight": q, "m.scales": s, "m.biases": b})
    lin = load_linear(store, "m", 16, 128, mx.float32, Quantization(QuantSpec(gs, 4)))
    assert lin.quant == (gs, bits, "affine") and lin.quantized_parts().bits == bits
    x = mx.random.normal((5, 128), key=mx.random.key(1))
    ref = np.array(x) @ np.array(dequantized(q, s, b, gs, bits)).T
    assert np.abs(np.array(lin(x)) - ref).max() < 1e-4


def test_quantized_embedding_rows_and_tied_projection(tmp_path):
    table = mx.random.normal((32, 64), key=KEY)
    q, s, b = mx.quantize(table, group_size=32, bits=8)
    store = store_of(tmp_path, {"e.weight": q, "e.scales": s, "e.biases": b})
    embed = Embedding(load_linear(store, "e", 32, 64, mx.float32, Quantization(QuantSpec(32, 8))))
    ids = mx.array([[3, 0, 31]])
    full = np.array(dequantized(q, s, b, 32, 8))
    rows = embed(ids)
    assert rows.dtype == mx.float32 and np.allclose(np.array(rows)[0], full[[3, 0, 31]], atol=1e-6)
    h = mx.random.normal((2, 64), key=mx.random.key(2))
    assert np.abs(np.array(embed.as_linear(h)) - np.array(h) @ full.T).max() < 1e-4


def test_float_embedding_casts_to_the_activation_dtype(tmp_path):
    store = store_of(tmp_path, {"e.weight": mx.ones((4, 8), dtype=mx.float16)})
    embed = Embedding(load_linear(store, "e", 4, 8, mx.float32, None))
    assert embed(mx.array([1])).dtype == mx.float32


def test_load_linear_checks(tmp_path):
    w = mx.zeros((6, 4))
    q, s, b = mx.quantize(mx.zeros((6, 64)), group_size=64, bits=4)
    cases = [
        ({"m.weight": w}, dict(out_features=6, in_features=5), r"m.weight has shape \(6, 4\), expected \(6, 5\)"),
        ({"m.weight": w, "m.bias": mx.zeros((5,))}, dict(bias=True), r"m.bias has shape \(5,\), expected \(6,\)"),
        ({"m.weight": w}, dict(bias=True), "missing tensor 'm.bias'"),
        ({"m.weight": w, "m.biases": w}, {}, "m.biases present without scales"),
        ({"m.weight": w.astype(mx.uint32)}, {}, "without scales"),
        ({"m.weight": q, "m.scales": s, "m.biases": b}, dict(in_features=64, quantization=None),
         "config.json has no quantization"),
        ({"m.weight": q, "m.scales": s, "m.biases": b},
         dict(in_features=64, quantization=Quantization(QuantSpec(64, 4), {"m": False})), "no quantization for it"),
        ({"m.weight": q, "m.scales": s, "m.biases": b}, dict(in_features=128), r"expected \(6, 128\)"),
    ]
    for i, (tensors, kwargs, message) in enumerate(cases):
        folder = tmp_path / str(i)
        folder.mkdir()
        args = dict(out_features=6, in_features=4, dtype=mx.float32, quantization=Quantization(QuantSpec(64, 4)))
        args.update(kwargs)
        with pytest.raises(CheckpointError, match=message) as err:
            load_linear(store_of(folder, tensors), "m", **args)
        assert str(folder) in str(err.value)


def _quantized_linear(out_f: int, in_f: int, bits: int = 4, bias: bool = False, seed: int = 0) -> Linear:
    w = mx.random.normal((out_f, in_f), key=mx.random.key(seed))
    q, s, b = mx.quantize(w, group_size=64, bits=bits)
    return Linear(q, mx.arange(out_f, dtype=mx.float32) if bias else None,
                  QuantizedParts(q, s, b, 64, bits, "affine"))


def test_row_stack_is_one_matmul_equal_to_the_separate_ones():
    parts = [_quantized_linear(n, 128, bias=True, seed=n) for n in (32, 16, 16)]
    stacked = RowStack(*parts).get()
    x = mx.random.normal((1, 3, 128), key=KEY)
    want = np.concatenate([np.array(p(x)) for p in parts], axis=-1)
    assert stacked.weight.shape[0] == 64 and np.array_equal(np.array(stacked(x)), want)


def test_row_stack_declines_linears_stored_differently():
    assert stack_rows(_quantized_linear(32, 128), _quantized_linear(16, 128, bits=8)) is None
    assert stack_rows(_quantized_linear(32, 128, bias=True), _quantized_linear(16, 128)) is None
    assert stack_rows(Linear(mx.zeros((4, 128))), _quantized_linear(16, 128)) is None
    assert RowStack(Linear(mx.zeros((4, 128))), _quantized_linear(16, 128)).get() is None


def test_row_stack_follows_replaced_weights_and_shares_storage():
    a, b = _quantized_linear(32, 128, seed=1), _quantized_linear(16, 128, seed=2)
    stack = RowStack(a, b)
    first = stack.get()
    assert stack.get() is first  # nothing replaced: the same stacked Linear, no rebuild
    stack.share_storage()
    assert stack.get() is first  # the views it points a and b at do not count as replaced
    x = mx.random.normal((1, 128), key=KEY)
    before = np.array(a(x))
    a.weight = _quantized_linear(32, 128, seed=3).weight  # a trained / reloaded weight
    rebuilt = stack.get()
    assert rebuilt is not first and not np.array_equal(np.array(rebuilt(x))[:, :32], before)


def test_sharing_storage_frees_the_separate_copies():
    a, b = _quantized_linear(1024, 1024, seed=4), _quantized_linear(1024, 1024, seed=5)
    stack = RowStack(a, b)
    mx.eval(stack.get().parameters())
    x = mx.random.normal((1, 1024), key=KEY)
    want = np.array(stack.get()(x))
    gc.collect()
    before = mx.get_active_memory()
    stack.share_storage()
    gc.collect()
    freed = before - mx.get_active_memory()
    separate = sum(v.nbytes for m in (a, b) for v in (m.weight, m.scales, m.biases))
    assert freed >= 0.9 * separate, f"freed {freed} bytes, the separate arrays held {separate}"
    assert np.array_equal(np.concatenate([np.array(a(x)), np.array(b(x))], axis=-1), want)
