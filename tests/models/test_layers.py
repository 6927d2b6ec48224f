"""Linear, Embedding and RMSNorm filled from checkpoint tensors (checkpoint.weights), float or quantized, and
the shape checks of the one validation ladder."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from moebench.checkpoint.files import TensorStore
from moebench.checkpoint.weights import load_norm, load_weight
from moebench.errors import CheckpointError
from moebench.models.args import Quantization, QuantSpec
from moebench.models.layers import Embedding, Linear, RMSNorm

KEY = mx.random.key(7)


def store_of(tmp_path: Path, tensors: dict[str, mx.array]) -> TensorStore:
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors)
    return TensorStore(tmp_path)


def dequantized(q, s, b, gs=64, bits=4):
    return mx.dequantize(q, s, b, group_size=gs, bits=bits)


def test_float_linear_with_bias():
    w, b, x = mx.random.normal((6, 4), key=KEY), mx.arange(6, dtype=mx.float32), mx.random.normal((3, 4))
    lin = Linear(4, 6, bias=True)
    assert lin.shape == (6, 4) and lin.bias.shape == (6,)  # placeholders of the right shapes
    lin.set_weight(w, bias=b)
    assert np.allclose(np.array(lin(x)), np.array(x) @ np.array(w).T + np.arange(6), atol=1e-5)
    assert np.allclose(np.array(lin.matmul(x)), np.array(x) @ np.array(w).T, atol=1e-5)  # without the bias
    assert lin.quantized_parts() is None and lin.quant is None


@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 32), (6, 128), (3, 64)])
def test_quantized_linear_matches_its_dequantized_matrix(tmp_path, bits, gs):
    w = mx.random.normal((16, 128), key=KEY)
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    store = store_of(tmp_path, {"m.weight": q, "m.scales": s, "m.biases": b})
    lin = Linear(128, 16)
    load_weight(store, "m", lin, mx.float32, Quantization(QuantSpec(gs, 4)))
    assert lin.quant == (gs, bits, "affine") and lin.quantized_parts().bits == bits
    assert lin.shape == (16, 128)  # the float shape, whatever the packing
    x = mx.random.normal((5, 128), key=mx.random.key(1))
    ref = np.array(x) @ np.array(dequantized(q, s, b, gs, bits)).T
    assert np.abs(np.array(lin(x)) - ref).max() < 1e-4


def test_set_weight_replaces_quantized_parts_with_a_float_weight(tmp_path):
    q, s, b = mx.quantize(mx.random.normal((16, 128), key=KEY), group_size=64, bits=4)
    lin = Linear(128, 16)
    load_weight(store_of(tmp_path, {"m.weight": q, "m.scales": s, "m.biases": b}), "m", lin, mx.float32,
                Quantization(QuantSpec(64, 4)))
    lin.set_weight(mx.ones((16, 128)))
    assert "scales" not in lin and "biases" not in lin and lin.quant is None
    assert np.array_equal(np.array(lin(mx.ones((1, 128)))), np.full((1, 16), 128.0))


def test_quantized_embedding_rows_and_tied_projection(tmp_path):
    table = mx.random.normal((32, 64), key=KEY)
    q, s, b = mx.quantize(table, group_size=32, bits=8)
    store = store_of(tmp_path, {"e.weight": q, "e.scales": s, "e.biases": b})
    embed = Embedding(32, 64)
    load_weight(store, "e", embed, mx.float32, Quantization(QuantSpec(32, 8)))
    ids = mx.array([[3, 0, 31]])
    full = np.array(dequantized(q, s, b, 32, 8))
    rows = embed(ids)
    assert rows.dtype == mx.float32 and np.allclose(np.array(rows)[0], full[[3, 0, 31]], atol=1e-6)
    h = mx.random.normal((2, 64), key=mx.random.key(2))
    assert np.abs(np.array(embed.as_linear(h)) - np.array(h) @ full.T).max() < 1e-4


def test_float_embedding_casts_to_the_activation_dtype(tmp_path):
    store = store_of(tmp_path, {"e.weight": mx.ones((4, 8), dtype=mx.float16)})
    embed = Embedding(4, 8)
    load_weight(store, "e", embed, mx.float32, None)
    assert embed(mx.array([1])).dtype == mx.float32


def test_norm_is_checked_and_cast(tmp_path):
    norm = RMSNorm(8, 1e-6)
    load_norm(store_of(tmp_path, {"n.weight": mx.full((8,), 2.0, dtype=mx.float16)}), "n", norm, mx.float32)
    assert norm.weight.dtype == mx.float32
    x = mx.random.normal((3, 8), key=KEY)
    expected = 2 * np.array(x) / np.sqrt((np.array(x) ** 2).mean(axis=-1, keepdims=True) + 1e-6)
    assert np.allclose(np.array(norm(x)), expected, atol=1e-5)
    for i, (w, message) in enumerate([(mx.ones((9,)), r"n.weight has shape \(9,\), expected \(8,\)"),
                                      (mx.ones((8,), dtype=mx.int32), "n.weight is .*int32, expected floating")]):
        folder = tmp_path / str(i)
        folder.mkdir()
        with pytest.raises(CheckpointError, match=message) as err:
            load_norm(store_of(folder, {"n.weight": w}), "n", RMSNorm(8, 1e-6), mx.float32)
        assert str(folder) in str(err.value)


def test_load_weight_checks(tmp_path):
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
        args = dict(out_features=6, in_features=4, bias=False, quantization=Quantization(QuantSpec(64, 4)))
        args.update(kwargs)
        module = Linear(args["in_features"], args["out_features"], args["bias"])
        with pytest.raises(CheckpointError, match=message) as err:
            load_weight(store_of(folder, tensors), "m", module, mx.float32, args["quantization"])
        assert str(folder) in str(err.value)
