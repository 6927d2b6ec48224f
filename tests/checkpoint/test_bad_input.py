"""Bad checkpoints: each raises a moebench error naming the file, tensor or field, never an MLX abort; nothing
outside the folder is opened and no error quotes a file's bytes; NaN / Inf weights are found at load. Cases that
could hang or crash (FIFOs, huge allocations) run in their own process in tests/test_bad_input_corpus.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

import moebench
from moebench.checkpoint.files import INDEX_FILE
from moebench.checkpoint.weights import SAMPLED_ABOVE, SAMPLED_ROWS, finite_flags, nonfinite_weights
from moebench.errors import CheckpointError, ConfigError, NonFiniteError
from moebench.models.args import QuantizedParts
from moebench.models.layers import Linear
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


# -- files outside the folder, and what errors may quote -----------------------------------------------------------
def _sharded(make_checkpoint) -> Path:
    return make_checkpoint("sharded", config=qwen2_moe_config(), bits=4, shard_bytes=100_000)


def _point_index(folder: Path, shard: str) -> None:
    index = json.loads((folder / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = shard
    (folder / INDEX_FILE).write_text(json.dumps(index))


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """Every path mx.load is asked to open while the test runs."""
    opened: list[str] = []
    real = mx.load

    def spy(path, *args, **kwargs):
        opened.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(mx, "load", spy)
    return opened


@pytest.mark.parametrize("shard", ["../outside/model.safetensors", "{outside}/model.safetensors", "/etc/passwd",
                                   "sub/../../outside/model.safetensors", "", 7, None])
def test_a_shard_index_cannot_name_a_file_outside_the_folder(make_checkpoint, tmp_path, loads, shard):
    folder = _sharded(make_checkpoint)
    outside = make_checkpoint("outside")  # a valid checkpoint: it would load if it were opened
    if isinstance(shard, str):
        shard = shard.format(outside=outside)
    _point_index(folder, shard)
    assert_load_error(folder, CheckpointError, str(folder / INDEX_FILE), "shard")
    assert not any(str(outside) in p or p == "/etc/passwd" for p in loads)


def test_a_link_out_of_the_folder_is_refused(make_checkpoint, loads):
    folder, outside = make_checkpoint("ckpt"), make_checkpoint("outside")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(outside / "model.safetensors")
    assert_load_error(folder, CheckpointError, "outside the checkpoint folder")
    assert loads == []
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(outside / "config.json")
    assert_load_error(folder, ConfigError, "config.json", "outside the checkpoint folder")


def test_links_inside_the_folder_and_a_hugging_face_snapshot_load(make_checkpoint, tmp_path):
    source = make_checkpoint("source")
    repo = tmp_path / "models--x--y"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(source.iterdir())):  # the hub's layout: snapshots/REV/name -> ../../blobs/HASH
        (blobs / f"hash{i}").write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(Path("../../blobs") / f"hash{i}")
    reference = moebench.load(source)[0]
    model = moebench.load(snapshot)[0]
    tokens = mx.array([[1, 2, 3]])
    assert mx.array_equal(model(tokens), reference(tokens)).item()
    inside = make_checkpoint("inside")
    (inside / "weights.bin").write_bytes((inside / "model.safetensors").read_bytes())
    (inside / "model.safetensors").unlink()
    (inside / "model.safetensors").symlink_to("weights.bin")
    moebench.load(inside)


def test_a_file_that_is_not_safetensors_is_never_quoted(make_checkpoint):
    folder = make_checkpoint()
    secret = b"root:x:0:0:root:/root:/bin/bash\n" * 4  # /etc/passwd's shape; its first 8 bytes read as a length
    (folder / "model.safetensors").write_bytes(secret)
    with pytest.raises(CheckpointError, match="corrupt header length") as err:
        moebench.load(folder)
    message = str(err.value)
    assert str(int.from_bytes(secret[:8], "little")) not in message and "root" not in message.replace(str(folder), "")


@pytest.mark.parametrize("index", ['{"weight_map": {"model.norm.weight": ["a"]}}', '{"weight_map": []}',
                                   '{"weight_map": {}}', '{"metadata": {}}', "[1]", "{"])
def test_an_unreadable_shard_index_is_named(make_checkpoint, index):
    folder = _sharded(make_checkpoint)
    (folder / INDEX_FILE).write_text(index)
    assert_load_error(folder, CheckpointError, str(folder / INDEX_FILE))


# -- safetensors headers the format forbids ------------------------------------------------------------------------
def test_duplicate_header_keys_are_refused(per_expert):
    path = per_expert / "model.safetensors"
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = blob[8 : 8 + n].decode()
    first = header.index('"model.norm.weight"')
    entry = header[first : header.index("}", first) + 1]
    doubled = header[:-1] + "," + entry + "}"  # the same tensor twice: parsers keep one or the other
    path.write_bytes(len(doubled).to_bytes(8, "little") + doubled.encode() + blob[8 + n :])
    assert_load_error(per_expert, CheckpointError, str(path), "'model.norm.weight' appears twice")


def test_duplicate_keys_inside_an_entry_are_refused(per_expert):
    path = per_expert / "model.safetensors"
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = blob[8 : 8 + n].decode().replace('"dtype":"F32"', '"dtype":"F32","dtype":"U8"', 1)
    if header == blob[8 : 8 + n].decode():
        header = blob[8 : 8 + n].decode().replace('"dtype": "F32"', '"dtype": "F32", "dtype": "U8"', 1)
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode() + blob[8 + n :])
    assert_load_error(per_expert, CheckpointError, str(path), "'dtype' appears twice")


def test_overlapping_data_offsets_are_refused(per_expert, raw_safetensors):
    path = per_expert / "model.safetensors"
    raw = raw_safetensors.read(path)
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"
    raw.header[b]["data_offsets"] = raw.header[a]["data_offsets"]  # same size: both read the same bytes
    raw.write(path)
    assert_load_error(per_expert, CheckpointError, str(path), "overlap", a, b)


# -- config values that are not numbers in float32 -----------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("rope_theta", "Infinity"), ("rms_norm_eps", "Infinity"),
                                          ("rms_norm_eps", "NaN"), ("rope_theta", "-Infinity"),
                                          ("rms_norm_eps", "1e39"), ("rope_theta", "0")])
def test_config_numbers_must_be_finite_in_float32(per_expert, field, value):
    path = per_expert / "config.json"
    cfg = json.loads(path.read_text())
    cfg[field] = "__value__"
    path.write_text(json.dumps(cfg).replace('"__value__"', value))  # JSON's Infinity / NaN as python writes them
    assert_load_error(per_expert, ConfigError, str(path), f"'{field}'", "positive finite number")


@pytest.mark.parametrize("value", [0, -1, 2.5, "4096", True, [4096]])
def test_max_position_embeddings_must_be_a_positive_integer(per_expert, value):
    path = edit_config(per_expert, lambda c: c.update(max_position_embeddings=value))
    assert_load_error(per_expert, ConfigError, str(path), "'max_position_embeddings'")


def test_max_position_embeddings_is_read(per_expert):
    edit_config(per_expert, lambda c: c.update(max_position_embeddings=77))
    assert moebench.load(per_expert)[0].args.max_position_embeddings == 77


# -- weights that hold NaN or Inf -----------------------------------------------------------------------------------
def _poison(value: float, index: int = 0) -> Callable[[mx.array], mx.array]:
    def edit(array: mx.array) -> mx.array:
        flat = array.reshape(-1)
        return mx.where(mx.arange(flat.size) == index, mx.array(value, array.dtype), flat).reshape(array.shape)
    return edit


@pytest.mark.parametrize("checkpoint, name, shown", [
    ("float", "model.norm.weight", "model.norm.weight"),
    ("float", "model.layers.1.input_layernorm.weight", "model.layers.1.input_layernorm.weight"),
    ("float", "model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("float", "lm_head.weight", "lm_head.weight"),
    ("float", "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_proj.bias"),
    ("float", f"{EXPERTS}.5.up_proj.weight", f"{SWITCH}.up_proj.weight (expert 5)"),
    ("quantized", f"{EXPERTS}.3.down_proj.scales", f"{SWITCH}.down_proj.scales (expert 3)"),
    ("quantized", f"{EXPERTS}.0.gate_proj.biases", f"{SWITCH}.gate_proj.biases (expert 0)"),
    ("quantized", "model.layers.1.mlp.shared_expert.up_proj.scales", "model.layers.1.mlp.shared_expert.up_proj.scales"),
    ("quantized", "model.embed_tokens.biases", "model.embed_tokens.biases"),
])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_weights_are_named_at_load(float_checkpoint, quantized_checkpoint, copy_checkpoint, checkpoint,
                                             name, shown, value):
    folder = copy_checkpoint(float_checkpoint if checkpoint == "float" else quantized_checkpoint)
    path = edit_tensors(folder, lambda t: t.update({name: _poison(value, 7)(t[name])}))
    assert_load_error(folder, NonFiniteError, str(path), f"tensor {shown} holds NaN or Inf")
    model, _ = moebench.load(folder, check_finite=False)  # loads unchecked; the full check names it
    assert nonfinite_weights(model) == [shown.split(" (")[0]]


def test_a_large_float_matrix_is_sampled_at_load_and_checked_whole_by_nonfinite_weights(make_checkpoint):
    """Load checks float matrices of more than SAMPLED_ABOVE values on SAMPLED_ROWS rows spread over them (a whole
    check would cost ~20% of a float checkpoint's load on CPU); nonfinite_weights reads every value."""
    folder = make_checkpoint("wide", config=qwen2_moe_config(vocab_size=SAMPLED_ABOVE // 128 + 64))
    rows = SAMPLED_ABOVE // 128 + 64
    step = -(-rows // SAMPLED_ROWS)
    edit_tensors(folder, lambda t: t.update({"lm_head.weight": _poison(float("nan"), 128)(t["lm_head.weight"])}))
    moebench.load(folder)  # row 1: between two sampled rows
    assert nonfinite_weights(moebench.load(folder)[0]) == ["lm_head.weight"]
    edit_tensors(folder, lambda t: t.update({"lm_head.weight": _poison(float("nan"), step * 128)(t["lm_head.weight"])}))
    assert_load_error(folder, NonFiniteError, "lm_head.weight")


@pytest.mark.parametrize("mode, part, code", [("mxfp4", "scales", 0xFF), ("mxfp8", "scales", 0xFF),
                                              ("nvfp4", "scales", 0x7F), ("mxfp8", "weight", 0x7F)])
def test_nan_codes_of_the_fp_modes_are_found(mode, part, code):
    layer = Linear(64, 8)
    w, scales = mx.quantize(mx.random.normal((8, 64)), mode=mode)
    parts = {"weight": w, "scales": scales}
    bytes_ = mx.array(mx.view(parts[part], mx.uint8))
    bytes_[0, 0] = code
    parts[part] = mx.view(bytes_, parts[part].dtype)
    gs, bits = {"mxfp4": (32, 4), "mxfp8": (32, 8), "nvfp4": (16, 4)}[mode]
    layer.set_weight(parts["weight"], QuantizedParts(parts["weight"], parts["scales"], None, gs, bits, mode))
    assert not finite_flags(layer, "lm_head")[f"lm_head.{part}"].item()
    assert not mx.isfinite(mx.dequantize(parts["weight"], parts["scales"], mode=mode)).all().item()  # a real NaN


# -- what load is given ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [mx.int32, mx.uint32, mx.bool_, mx.float64, "float32", 32])
def test_load_dtype_must_be_an_activation_float(per_expert, dtype):
    with pytest.raises(ConfigError, match="load: dtype must be one of float32, float16, bfloat16"):
        moebench.load(per_expert, dtype=dtype)


@pytest.mark.parametrize("path", [123, 4.5, ["a"], b"folder"])
def test_load_path_must_be_a_folder_name(path):
    with pytest.raises(ConfigError, match="load: path must be a folder name"):
        moebench.load(path)


# -- issue 37: JSON past Python's parser, links that dangle, eos ids past the vocabulary ---------------------------
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name, error", [("config.json", ConfigError), ("generation_config.json", ConfigError),
                                         ("tokenizer_config.json", ConfigError), (INDEX_FILE, CheckpointError)])
def test_json_nested_past_pythons_parser_is_named(make_checkpoint, name, error):
    folder = make_checkpoint(tokenizer=True, bits=4, shard_bytes=100_000)  # sharded: it has an index
    (folder / name).write_text('{"a": ' + DEEP + "}")
    with pytest.raises(error, match=rf"{name}: JSON nested too deeply to read"):
        moebench.load(folder)


@pytest.mark.parametrize("name, error", [
    ("generation_config.json", ConfigError), ("tokenizer_config.json", ConfigError),
    ("special_tokens_map.json", ConfigError), ("tokenizer.json", CheckpointError), ("chat_template.jinja", ConfigError),
    (INDEX_FILE, CheckpointError)])
def test_a_link_that_dangles_is_named_not_taken_for_an_absent_file(make_checkpoint, name, error):
    folder = make_checkpoint(tokenizer=True)
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(folder / "gone.json")
    with pytest.raises(error, match=rf"{name}: a link to .*gone.json, which does not exist"):
        moebench.load(folder)


def test_a_template_that_links_to_itself_is_named(make_checkpoint):
    folder = make_checkpoint(tokenizer=True)
    (folder / "chat_template.jinja").symlink_to("chat_template.jinja")
    with pytest.raises(ConfigError, match="chat_template.jinja: cannot read"):
        moebench.load(folder)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("eos", [256, 10**12])
def test_eos_ids_outside_the_vocabulary_are_named_at_load(make_checkpoint, name, eos):
    folder = make_checkpoint()  # a vocabulary of 256
    path = folder / name
    config = json.loads(path.read_text()) if path.exists() else {}
    config["eos_token_id"] = [1, eos]
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"{name}: field 'eos_token_id' names id {eos}, outside the model's "
                                          "vocabulary of 256"):
        moebench.load(folder)
