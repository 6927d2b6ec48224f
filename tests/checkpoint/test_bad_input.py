"""Bad checkpoints: each raises a moebench error naming the file, tensor or field, never an MLX abort."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

import moebench
from moebench.checkpoint.files import INDEX_FILE
from moebench.errors import CheckpointError, ConfigError
from moebench.tools.writer import qwen2_moe_config

EXPERTS = "model.layers.0.mlp.experts"
SWITCH = "model.layers.0.mlp.switch_mlp"


def edit_tensors(folder: Path, edit: Callable[[dict[str, mx.array]], None]) -> Path:
    """Load model.safetensors, let `edit` change the dict of tensors, and save it back."""
    path = folder / "model.safetensors"
    tensors = dict(mx.load(str(path)))
    edit(tensors)
    mx.save_safetensors(str(path), tensors)
    return path


def edit_config(folder: Path, edit: Callable[[dict], None]) -> Path:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))
    return path


def drop(*names: str) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        for name in names:
            del tensors[name]
    return edit


def quantized_names(base: str) -> tuple[str, ...]:
    return tuple(f"{base}.{s}" for s in ("weight", "scales", "biases"))


@pytest.fixture
def per_expert(quantized_checkpoint, copy_checkpoint) -> Path:
    return copy_checkpoint(quantized_checkpoint)


@pytest.fixture
def stacked(make_checkpoint) -> Path:
    return make_checkpoint("stacked", bits=4, layout="stacked")


def assert_load_error(folder: Path, error: type, *fragments: str) -> None:
    with pytest.raises(error) as err:
        moebench.load(folder)
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} not in: {err.value}"


def test_missing_expert(per_expert):
    edit_tensors(per_expert, drop(*quantized_names(f"{EXPERTS}.3.gate_proj")))
    assert_load_error(per_expert, CheckpointError, f"missing tensor {EXPERTS}.3.gate_proj.", "8 experts")


def test_missing_expert_scales_only(per_expert):
    edit_tensors(per_expert, drop(f"{EXPERTS}.6.down_proj.scales"))
    assert_load_error(per_expert, CheckpointError, f"{EXPERTS}.6.down_proj.scales")


def test_extra_expert(per_expert):
    def add(t):
        for name in quantized_names("up_proj"):
            t[f"{EXPERTS}.8.{name}"] = t[f"{EXPERTS}.0.{name}"]
    path = edit_tensors(per_expert, add)
    assert_load_error(per_expert, CheckpointError, str(path), f"{EXPERTS}.8.up_proj.", "8 experts")


def test_ragged_expert_shape(per_expert):
    def shrink(t):
        for name in quantized_names(f"{EXPERTS}.5.down_proj"):
            t[name] = t[name][:-1]
    path = edit_tensors(per_expert, shrink)
    assert_load_error(per_expert, CheckpointError, str(path), "ragged expert", f"{EXPERTS}.5.down_proj.")


def test_ragged_expert_dtype(make_checkpoint):
    folder = make_checkpoint()
    name = f"{EXPERTS}.2.gate_proj.weight"
    edit_tensors(folder, lambda t: t.update({name: t[name].astype(mx.float16)}))
    assert_load_error(folder, CheckpointError, "ragged expert", name, "float16")


def test_missing_tensor(per_expert):
    edit_tensors(per_expert, drop("model.layers.1.self_attn.k_proj.bias"))
    assert_load_error(per_expert, CheckpointError, "missing tensor 'model.layers.1.self_attn.k_proj.bias'",
                      str(per_expert))


def test_missing_stacked_and_per_expert_projection(stacked):
    edit_tensors(stacked, drop(*quantized_names(f"{SWITCH}.up_proj")))
    assert_load_error(stacked, CheckpointError, f"{SWITCH}.up_proj.weight", f"{EXPERTS}.0.up_proj.weight")


def test_unexpected_tensor(per_expert):
    path = edit_tensors(per_expert, lambda t: t.update({"model.layers.7.mlp.gate.weight": mx.zeros((8, 128))}))
    assert_load_error(per_expert, CheckpointError, str(path), "unexpected tensor 'model.layers.7.mlp.gate.weight'")


def test_stacked_and_per_expert_copies_of_one_projection(stacked):
    def duplicate(t):
        t[f"{EXPERTS}.0.gate_proj.weight"] = t[f"{SWITCH}.gate_proj.weight"][0]
    edit_tensors(stacked, duplicate)
    assert_load_error(stacked, CheckpointError, f"{EXPERTS}.0.gate_proj.weight", "duplicates", SWITCH)


def test_stacked_expert_count_differs_from_config(stacked):
    def cut(t):
        for name in quantized_names(f"{SWITCH}.gate_proj"):
            t[name] = t[name][:7]
    edit_tensors(stacked, cut)
    assert_load_error(stacked, CheckpointError, f"{SWITCH}.gate_proj.weight", "(7, ", "8 stacked experts")


def test_wrong_bits_for_the_shape(per_expert):
    # 4-bit g64 stores 16 words per row of 128 inputs; 14 words would be 3.5 bits
    name = "model.layers.1.self_attn.q_proj.weight"
    path = edit_tensors(per_expert, lambda t: t.update({name: t[name][:, :14]}))
    assert_load_error(per_expert, CheckpointError, str(path), "model.layers.1.self_attn.q_proj", "no valid bit width")


def test_bits_that_mlx_does_not_support(per_expert):
    # 28 words per 128 inputs at group 64 would be 7 bits: not an MLX width

    def widen(t):
        for i in range(8):
            w = t[f"{EXPERTS}.{i}.up_proj.weight"]
            t[f"{EXPERTS}.{i}.up_proj.weight"] = mx.concatenate([w, w[:, :12]], axis=1)
    edit_tensors(per_expert, widen)
    assert_load_error(per_expert, CheckpointError, str(per_expert), f"{SWITCH}.up_proj", "no valid bit width")


def test_bits_that_fit_but_give_the_wrong_width(per_expert):
    # a 4-bit group-32 tensor read under group 64 looks 2-bit, and then has 256 inputs, not 128
    name = "model.layers.0.self_attn.o_proj"

    def regroup(t):
        w = mx.dequantize(t[f"{name}.weight"], t[f"{name}.scales"], t[f"{name}.biases"], group_size=64, bits=4)
        t[f"{name}.weight"], t[f"{name}.scales"], t[f"{name}.biases"] = mx.quantize(w, group_size=32, bits=4)
    edit_tensors(per_expert, regroup)
    assert_load_error(per_expert, CheckpointError, name, "2-bit", "expected (128, 128)")


def test_unsupported_group_size(per_expert):
    path = edit_config(per_expert, lambda c: c["quantization"].update(group_size=16))
    assert_load_error(per_expert, ConfigError, str(path), "group_size 16")


def test_unsupported_bits_in_config(per_expert):
    path = edit_config(per_expert, lambda c: c["quantization"].update(bits=7))
    assert_load_error(per_expert, ConfigError, str(path), "bits 7")


def test_quantized_tensors_without_quantization_block(per_expert):
    edit_config(per_expert, lambda c: c.pop("quantization"))
    # decoder layers load first: the first quantized tensor read is layer 0's q_proj
    assert_load_error(per_expert, CheckpointError, "model.layers.0.self_attn.q_proj", "no quantization")


def test_affine_without_biases(per_expert):
    path = edit_tensors(per_expert, drop("model.layers.0.self_attn.v_proj.biases"))
    assert_load_error(per_expert, CheckpointError, str(path), "model.layers.0.self_attn.v_proj.biases", "needs biases")


def test_float_weight_with_integer_dtype(make_checkpoint):
    folder = make_checkpoint()
    name = "model.layers.0.mlp.shared_expert.up_proj.weight"
    edit_tensors(folder, lambda t: t.update({name: t[name].astype(mx.int32)}))
    assert_load_error(folder, CheckpointError, name, "int32")


def test_truncated_safetensors_file(per_expert):
    path = per_expert / "model.safetensors"
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    assert_load_error(per_expert, CheckpointError, str(path), "truncated")


def test_corrupt_header(per_expert):
    path = per_expert / "model.safetensors"
    blob = bytearray(path.read_bytes())
    blob[8:40] = b"\x00garbage, not the JSON header :(" [:32]
    path.write_bytes(bytes(blob))
    assert_load_error(per_expert, CheckpointError, str(path), "corrupt safetensors header")


def test_header_shape_that_disagrees_with_the_config(per_expert, raw_safetensors):
    path = per_expert / "model.safetensors"
    raw = raw_safetensors.read(path)
    raw.header["model.norm.weight"]["shape"] = [2, 64]  # same bytes, wrong shape
    raw.write(path)
    assert_load_error(per_expert, CheckpointError, "model.norm.weight", "(2, 64)", "expected (128,)")


def test_config_missing_a_field(per_expert):
    path = edit_config(per_expert, lambda c: c.pop("moe_intermediate_size"))
    assert_load_error(per_expert, ConfigError, str(path), "'moe_intermediate_size'", "missing")


def test_config_size_that_disagrees_with_the_tensors(per_expert):
    edit_config(per_expert, lambda c: c.update(moe_intermediate_size=64))
    assert_load_error(per_expert, CheckpointError, "switch_mlp.gate_proj", "(8, 128, 128)", "expected (8, 64, 128)")


def test_unsupported_model_type(per_expert):
    edit_config(per_expert, lambda c: c.update(model_type="llama"))
    assert_load_error(per_expert, ConfigError, "'llama'", "qwen2_moe")


def test_not_a_folder(tmp_path):
    assert_load_error(tmp_path / "nowhere", ConfigError, str(tmp_path / "nowhere"))


def test_shard_index_pointing_to_a_missing_file(make_checkpoint):
    folder = make_checkpoint(config=qwen2_moe_config(), bits=4, shard_bytes=100_000)
    index = json.loads((folder / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (folder / INDEX_FILE).write_text(json.dumps(index))
    assert_load_error(folder, CheckpointError, str(folder / "model-00009-of-00009.safetensors"), "missing")


@pytest.mark.parametrize("name", ["model.layers.1.post_attention_layernorm.weight", "model.norm.weight",
                                  "model.layers.0.self_attn.q_proj.bias"])
def test_integer_norm_or_bias(per_expert, raw_safetensors, name):
    path = per_expert / "model.safetensors"
    raw = raw_safetensors.read(path)
    raw.header[name]["dtype"] = "I32"  # same bytes, integer values
    raw.write(path)
    assert_load_error(per_expert, CheckpointError, str(path), name, "int32", "floating point")
