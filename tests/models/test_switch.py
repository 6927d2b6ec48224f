"""The shared expert layer: SwitchGLU against a per-expert dense loop, and how the checkpoint loader fills it
(stack_experts, then load_weight on each stacked projection)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from moebench.checkpoint.files import TensorStore
from moebench.checkpoint.quant import make_parts
from moebench.checkpoint.weights import load_weight, stack_experts
from moebench.errors import CheckpointError
from moebench.models import switch
from moebench.models.args import Quantization, QuantSpec
from moebench.models.switch import SwitchGLU, SwitchLinear, weighted_sum

E, D, F, K = 6, 128, 64, 2
ROOT = "model.layers.0.mlp"
PARTS = ("weight", "scales", "biases")


def random_experts(seed: int = 0) -> dict[str, mx.array]:
    """Float per-projection stacks [E, out, in]."""
    keys = mx.random.split(mx.random.key(seed), 3)
    shapes = {"gate_proj": (E, F, D), "up_proj": (E, F, D), "down_proj": (E, D, F)}
    return {p: mx.random.normal(shapes[p], key=k) / shapes[p][-1] ** 0.5 for (p, k) in zip(shapes, keys, strict=True)}


def dense_reference(stacks: dict[str, np.ndarray], x: np.ndarray, inds: np.ndarray) -> np.ndarray:
    """Each (token, slot) through its expert with numpy: [N, K, D]."""
    out = np.zeros((*inds.shape, D), np.float32)
    for n, row in enumerate(inds):
        for k, e in enumerate(row):
            g, u = stacks["gate_proj"][e] @ x[n], stacks["up_proj"][e] @ x[n]
            out[n, k] = stacks["down_proj"][e] @ (g / (1 + np.exp(-g)) * u)
    return out


def float_glu(stacks: dict[str, mx.array]) -> SwitchGLU:
    glu = SwitchGLU(D, F, E)
    for p in switch.PROJECTIONS:
        getattr(glu, p).set_weight(stacks[p])
    return glu


def routing(n: int, seed: int = 1) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.uint32))


@pytest.mark.parametrize("n", [1, 5, 40])  # 40 tokens x 2 slots = 80 >= 64: the sorted (prefill) path
def test_float_switch_glu_matches_dense(n):
    stacks = random_experts()
    glu = float_glu(stacks)
    x, inds = mx.random.normal((n, D), key=mx.random.key(n)), routing(n)
    got = glu(x, inds)
    assert got.shape == (n, K, D)
    expected = dense_reference({p: np.array(v) for p, v in stacks.items()}, np.array(x), np.array(inds))
    assert np.abs(np.array(got) - expected).max() < 1e-5


@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 32), (6, 32)])
def test_quantized_switch_glu_sorted_and_unsorted_paths_agree(monkeypatch, bits, gs):
    stacks = random_experts(bits)
    quantized = {p: mx.quantize(w, group_size=gs, bits=bits) for p, w in stacks.items()}
    glu = SwitchGLU.from_parts(*(make_parts(p, *quantized[p], QuantSpec(gs, bits)) for p in switch.PROJECTIONS))
    x, inds = mx.random.normal((40, D), key=mx.random.key(3)), routing(40)
    expected = dense_reference(
        {p: np.array(mx.dequantize(*q, group_size=gs, bits=bits)) for p, q in quantized.items()},
        np.array(x), np.array(inds))
    sorted_out = np.array(glu(x, inds))
    monkeypatch.setattr(switch, "SORT_THRESHOLD", 10**9)
    unsorted_out = np.array(glu(x, inds))
    assert np.abs(sorted_out - expected).max() < 1e-4
    assert np.abs(unsorted_out - expected).max() < 1e-4
    assert np.abs(sorted_out - unsorted_out).max() < 1e-5
    parts = glu.down_proj.quantized_parts()
    assert (parts.bits, parts.group_size, parts.mode, parts.in_features, parts.out_features) == (bits, gs, "affine",
                                                                                                 F, D)
    assert glu.num_experts == E


def test_weighted_sum():
    y = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(2, 3, 4)
    scores = mx.array([[1.0, 0.0, 0.5], [0.0, 2.0, 0.0]])
    expected = np.einsum("nkd,nk->nd", np.array(y), np.array(scores))
    assert np.array_equal(np.array(weighted_sum(y, scores)), expected)
    assert weighted_sum(y.astype(mx.float16), scores).dtype == mx.float16


def write(tmp_path, tensors):
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors)
    return TensorStore(tmp_path)


def per_expert_tensors(stacks, quantize=None):
    out = {}
    for p, w in stacks.items():
        for e in range(E):
            parts = {"weight": w[e]} if quantize is None else dict(zip(PARTS, quantize(p, w[e]), strict=True))
            out.update({f"{ROOT}.experts.{e}.{p}.{s}": v for s, v in parts.items()})
    return out


def load(store, quantization=None):
    """What the loader does for a model's experts: stack them when stored one by one, then fill each projection."""
    glu = SwitchGLU(D, F, E)
    stack_experts(store, f"{ROOT}.switch_mlp", E)
    for p in switch.PROJECTIONS:
        load_weight(store, f"{ROOT}.switch_mlp.{p}", getattr(glu, p), mx.float32, quantization)
    return glu


def test_per_expert_and_stacked_load_identically(tmp_path):
    stacks = random_experts()
    def quantize(p, w):
        return mx.quantize(w, group_size=32, bits=8 if p == "down_proj" else 4)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    per_expert = load(write(tmp_path / "a", per_expert_tensors(stacks, quantize)), Quantization(QuantSpec(32, 4)))
    stacked_tensors = {}
    for p, w in stacks.items():
        parts = zip(PARTS, quantize(p, w), strict=True)
        stacked_tensors.update({f"{ROOT}.switch_mlp.{p}.{s}": v for s, v in parts})
    stacked = load(write(tmp_path / "b", stacked_tensors), Quantization(QuantSpec(32, 4)))
    for p in switch.PROJECTIONS:
        a, b = getattr(per_expert, p).quantized_parts(), getattr(stacked, p).quantized_parts()
        assert a.bits == b.bits == (8 if p == "down_proj" else 4)
        for part in PARTS:
            assert np.array_equal(np.array(getattr(a, part)), np.array(getattr(b, part)))


def test_float_per_expert_stack(tmp_path):
    stacks = random_experts()
    store = write(tmp_path, per_expert_tensors(stacks))
    glu = load(store)
    store.check_all_used()
    for p in switch.PROJECTIONS:
        assert getattr(glu, p).quantized_parts() is None
        assert np.array_equal(np.array(getattr(glu, p).weight), np.array(stacks[p]))


def test_stacking_takes_the_tensors_out_of_the_store(tmp_path):
    store = write(tmp_path, per_expert_tensors(random_experts()))
    load(store)
    assert list(store.names()) == []


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.pop(f"{ROOT}.experts.0.up_proj.weight"), f"missing tensor {ROOT}.experts.0.up_proj.weight"),
        (lambda t: t.update({f"{ROOT}.experts.6.up_proj.weight": t[f"{ROOT}.experts.0.up_proj.weight"]}),
         f"unexpected tensor {ROOT}.experts.6.up_proj.weight"),
        (lambda t: t.update({f"{ROOT}.experts.0.up_proj.bias": mx.zeros((F,))}),
         f"unexpected expert tensor {ROOT}.experts.0.up_proj.bias"),
        (lambda t: t.update({f"{ROOT}.experts.4.up_proj.weight": mx.zeros((F, D + 1))}), "ragged expert"),
        (lambda t: t.update({f"{ROOT}.experts.4.down_proj.weight": mx.zeros((D, F), mx.int32)}), "ragged expert"),
        (lambda t: [t.update({f"{ROOT}.experts.{e}.down_proj.weight": mx.zeros((D, F + 2))}) for e in range(E)],
         r"expected \(6, 128, 64\)"),
        (lambda t: [t.update({f"{ROOT}.experts.{e}.up_proj.biases": mx.zeros((F, 1))}) for e in range(E)],
         "biases present without scales"),
    ],
)
def test_per_expert_errors_name_the_tensor(tmp_path, edit, message):
    tensors = per_expert_tensors(random_experts())
    edit(tensors)
    with pytest.raises(CheckpointError, match=message):
        load(write(tmp_path, tensors))


def test_full_block_uses_silu_gating():
    # one expert, one token: the layer is exactly down(silu(gate x) * up x)
    stacks = random_experts()
    glu = float_glu(stacks)
    x = mx.random.normal((1, D), key=mx.random.key(9))
    e = 4
    g, u = x @ stacks["gate_proj"][e].T, x @ stacks["up_proj"][e].T
    expected = (nn.silu(g) * u) @ stacks["down_proj"][e].T
    got = glu(x, mx.array([[e, e]], dtype=mx.uint32))
    assert np.abs(np.array(got[:, 0]) - np.array(expected)).max() < 1e-5


@pytest.mark.parametrize("n,expect_sorted", [(1, False), (31, False), (32, True), (40, True)])
def test_tokens_are_sorted_by_expert_from_64_indices(monkeypatch, n, expect_sorted):
    stacks = random_experts()
    glu = float_glu(stacks)
    seen = []
    original = SwitchLinear.__call__

    def spy(self, x, indices, sorted_indices=False):
        seen.append(sorted_indices)
        return original(self, x, indices, sorted_indices)

    monkeypatch.setattr(SwitchLinear, "__call__", spy)
    glu(mx.random.normal((n, D), key=mx.random.key(0)), routing(n))  # K = 2 indices per token
    assert seen == [expect_sorted] * 3


@pytest.mark.parametrize("mode,gs,bits", [("mxfp4", 32, 4), ("mxfp8", 32, 8), ("nvfp4", 16, 4)])
def test_bias_free_modes_load_per_expert_and_match_dense(tmp_path, mode, gs, bits):
    stacks = random_experts()
    quantized = {p: mx.quantize(w, group_size=gs, bits=bits, mode=mode) for p, w in stacks.items()}
    tensors = {f"{ROOT}.experts.{e}.{p}.{s}": v[e] for p, q in quantized.items() for e in range(E)
               for s, v in zip(("weight", "scales"), q, strict=True)}
    glu = load(write(tmp_path, tensors), Quantization(QuantSpec(gs, bits, mode)))
    parts = glu.up_proj.quantized_parts()
    assert (parts.mode, parts.bits, parts.group_size, parts.biases) == (mode, bits, gs, None)
    x, inds = mx.random.normal((5, D), key=mx.random.key(4)), routing(5)
    dense = {p: np.array(mx.dequantize(*q, group_size=gs, bits=bits, mode=mode).astype(mx.float32))
             for p, q in quantized.items()}
    assert np.abs(np.array(glu(x, inds)) - dense_reference(dense, np.array(x), np.array(inds))).max() < 1e-4
