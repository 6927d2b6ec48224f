"""The test-checkpoint writer: HF float layout, MLX quantization in both layouts, shards with an index."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from moebench.checkpoint.config import model_args
from moebench.checkpoint.files import INDEX_FILE, read_safetensors_header
from moebench.checkpoint.weights import tensor_shapes
from moebench.tools.writer import (
    quantize_tensors,
    qwen2_moe_config,
    random_tensors,
    save_checkpoint,
    write_random_checkpoint,
)


def test_tensor_shapes_follow_the_config():
    args = model_args(qwen2_moe_config(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3],
                                                tie_word_embeddings=True))
    shapes = dict(tensor_shapes(args))
    assert "lm_head.weight" not in shapes
    assert shapes["model.layers.1.mlp.experts.7.down_proj.weight"] == (128, 128)
    assert shapes["model.layers.1.mlp.shared_expert_gate.weight"] == (1, 128)
    assert shapes["model.layers.3.mlp.gate_proj.weight"] == (256, 128)  # dense: mlp-only
    assert not any(n.startswith("model.layers.3.mlp.experts") for n in shapes)
    assert shapes["model.layers.0.self_attn.k_proj.bias"] == (64,)
    assert len([n for n in shapes if ".experts." in n]) == 8 * 3 * 1
    stacked = dict(tensor_shapes(args, layout="stacked"))
    assert stacked["model.layers.1.mlp.switch_mlp.down_proj.weight"] == (8, 128, 128)
    assert not any(".experts." in n for n in stacked)
    assert {n: s for n, s in stacked.items() if "switch_mlp" not in n} == {
        n: s for n, s in shapes.items() if ".experts." not in n}


def test_tensor_shapes_are_in_file_order_experts_one_by_one():
    """The order random draws follow (seeded checkpoints depend on it): each layer's norms, attention, then the
    router, the experts one by one (gate, up, down), the shared expert."""
    names = [n for n, _ in tensor_shapes(model_args(qwen2_moe_config(num_hidden_layers=1)))]
    layer = [n.removeprefix("model.layers.0.") for n in names if n.startswith("model.layers.0.")]
    assert layer[:4] == ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                         "self_attn.q_proj.bias"]
    assert layer[layer.index("mlp.gate.weight") + 1:][:4] == [
        "mlp.experts.0.gate_proj.weight", "mlp.experts.0.up_proj.weight", "mlp.experts.0.down_proj.weight",
        "mlp.experts.1.gate_proj.weight"]
    assert names[0] == "model.embed_tokens.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"]


def test_random_tensors_are_reproducible():
    args = model_args(qwen2_moe_config(num_hidden_layers=1))
    a, b, c = (dict(random_tensors(args, seed)) for seed in (0, 0, 1))
    assert all(np.array_equal(np.array(a[n]), np.array(b[n])) for n in a)
    assert not np.array_equal(np.array(a["model.embed_tokens.weight"]), np.array(c["model.embed_tokens.weight"]))
    norm = np.array(a["model.norm.weight"])
    assert abs(norm.mean() - 1) < 0.05


def named(**arrays):
    return iter(arrays.items())


def test_quantize_per_expert_stacked_and_skipped():
    w = mx.random.normal((4, 128), key=mx.random.key(0))
    experts = {f"l.mlp.experts.{i}.up_proj.weight": w * (i + 1) for i in range(3)}
    tensors = {**experts, "norm.weight": mx.ones((128,)), "odd.weight": mx.zeros((4, 100)), "keep.weight": w}
    per_expert = dict(quantize_tensors(iter(tensors.items()), 64, 4, skip=lambda n: n == "keep.weight"))
    assert per_expert["l.mlp.experts.2.up_proj.weight"].dtype == mx.uint32
    assert per_expert["l.mlp.experts.2.up_proj.scales"].shape == (4, 2)
    assert per_expert["odd.weight"].dtype == mx.float32  # 100 inputs: no whole groups of 64
    assert per_expert["keep.weight"].dtype == mx.float32 and "keep.scales" not in per_expert
    assert per_expert["norm.weight"].ndim == 1

    stacked = dict(quantize_tensors(iter(tensors.items()), 32, lambda n: 8, layout="stacked", num_experts=3))
    assert stacked["l.mlp.switch_mlp.up_proj.weight"].shape == (3, 4, 32)
    assert not any(".experts." in n for n in stacked)
    for i in range(3):
        assert np.array_equal(np.array(stacked["l.mlp.switch_mlp.up_proj.scales"][i]),
                              np.array(mx.quantize(w * (i + 1), group_size=32, bits=8)[1]))


def test_quantize_rejects_bad_layouts_and_incomplete_stacks():
    with pytest.raises(ValueError, match="layout"):
        list(quantize_tensors(named(), layout="rows"))
    with pytest.raises(ValueError, match="incomplete expert stacks"):
        list(quantize_tensors(named(**{"l.mlp.experts.0.up_proj.weight": mx.zeros((4, 64))}),
                              layout="stacked", num_experts=2))
    with pytest.raises(ValueError, match=r"experts \[0, 2\], expected 0..1"):
        list(quantize_tensors(named(**{f"l.mlp.experts.{i}.up_proj.weight": mx.zeros((4, 64)) for i in (0, 2)}),
                              layout="stacked", num_experts=2))


def test_stacked_quantization_stacks_experts_by_index_not_by_arrival():
    """Tensors sorted by name list expert 10 before expert 2: each still lands at its own index."""
    experts = {f"l.mlp.experts.{i}.up_proj.weight": mx.full((4, 64), float(i)) for i in range(12)}
    stacked = dict(quantize_tensors(iter(sorted(experts.items())), 64, 8, layout="stacked", num_experts=12))
    values = mx.dequantize(*(stacked[f"l.mlp.switch_mlp.up_proj.{part}"] for part in ("weight", "scales", "biases")),
                           group_size=64, bits=8)
    assert np.allclose(np.array(values[:, 0, 0]), np.arange(12), atol=0.05)


def test_sharded_save_writes_an_index_that_covers_every_tensor(tmp_path):
    folder = write_random_checkpoint(tmp_path / "c", qwen2_moe_config(), bits=4, shard_bytes=120_000)
    index = json.loads((folder / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == sorted(p.name for p in folder.glob("*.safetensors")) and len(shards) > 2
    assert all(name.endswith(f"-of-{len(shards):05d}.safetensors") for name in shards)
    assert not list(folder.glob("*.tmp.*"))
    stored = {}
    for shard in shards:
        header = read_safetensors_header(folder / shard)
        stored.update(dict.fromkeys(header, shard))
        data = sum(h["data_offsets"][1] - h["data_offsets"][0] for h in header.values())
        assert data <= 120_000 or len(header) == 1
    assert stored == index["weight_map"]


def test_quantized_checkpoint_config_records_the_quantization(tmp_path):
    folder = write_random_checkpoint(tmp_path / "c", qwen2_moe_config(), bits=8, group_size=32, layout="stacked")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    header = read_safetensors_header(folder / "model.safetensors")
    assert header["model.layers.1.mlp.switch_mlp.down_proj.weight"]["shape"] == [8, 128, 32]
    assert header["model.layers.1.mlp.switch_mlp.down_proj.scales"]["dtype"] == "F32"


def test_single_file_save_round_trips(tmp_path):
    tensors = {"a": mx.arange(4, dtype=mx.float32), "b": mx.ones((2, 2), dtype=mx.float16)}
    folder = save_checkpoint(tmp_path / "c", {"x": 1}, iter(tensors.items()))
    assert json.loads((folder / "config.json").read_text()) == {"x": 1}
    loaded = mx.load(str(folder / "model.safetensors"))
    assert all(np.array_equal(np.array(loaded[k]), np.array(v)) and loaded[k].dtype == v.dtype
               for k, v in tensors.items())
