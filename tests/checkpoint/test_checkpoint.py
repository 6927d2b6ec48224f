"""Safetensors header validation, shard discovery, the TensorStore and tokenizer.json."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from moebench.checkpoint.config import model_args
from moebench.checkpoint.files import INDEX_FILE, TensorStore, checkpoint_files, read_safetensors_header
from moebench.checkpoint.tokenizer import Tokenizer
from moebench.checkpoint.weights import tensor_shapes
from moebench.errors import CheckpointError
from moebench.tools.writer import qwen2_moe_config


@pytest.fixture
def small_file(tmp_path):
    path = tmp_path / "t.safetensors"
    mx.save_safetensors(str(path), {"a": mx.arange(6, dtype=mx.float32).reshape(2, 3),
                                    "b": mx.zeros((4,), dtype=mx.uint32)})
    return path


def test_header_lists_every_tensor(small_file):
    header = read_safetensors_header(small_file)
    assert {n: (h["dtype"], h["shape"]) for n, h in header.items()} == {"a": ("F32", [2, 3]), "b": ("U32", [4])}


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda h: h["a"].update(dtype="F8"), "unknown dtype"),
        (lambda h: h["a"].update(shape=[2, -3]), "invalid shape"),
        (lambda h: h["a"].update(shape="2x3"), "invalid shape"),
        (lambda h: h["a"].update(shape=[3, 3]), "needs 36"),
        (lambda h: h["a"].update(dtype="F16"), "needs 12"),
        (lambda h: h["a"].update(data_offsets=[8, 4]), "invalid data_offsets"),
        (lambda h: h["a"].update(data_offsets=[0]), "invalid data_offsets"),
        (lambda h: h["b"].update(data_offsets=[24, 4000]), "truncated"),
        (lambda h: h.update(a=[1, 2]), "not an object"),
    ],
)
def test_header_entries_are_validated(small_file, raw_safetensors, edit, message):
    raw = raw_safetensors.read(small_file)
    edit(raw.header)
    raw.write(small_file)
    with pytest.raises(CheckpointError, match=message) as err:
        read_safetensors_header(small_file)
    assert str(small_file) in str(err.value)


@pytest.mark.parametrize(
    "blob,message",
    [
        (b"", "truncated"),
        (b"\x05\x00", "truncated"),
        ((10**12).to_bytes(8, "little") + b"{}", "corrupt header length"),
        ((0).to_bytes(8, "little"), "corrupt header length"),
        ((4).to_bytes(8, "little") + b"\xff\xfe{}", "not JSON"),
        ((2).to_bytes(8, "little") + b"[]", "not an object"),
    ],
)
def test_corrupt_files_name_the_file(tmp_path, blob, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError, match=message) as err:
        read_safetensors_header(path)
    assert str(path) in str(err.value)


def test_truncated_data_is_caught_before_mlx(small_file):
    blob = small_file.read_bytes()
    small_file.write_bytes(blob[:-5])
    with pytest.raises(CheckpointError, match="truncated file"):
        read_safetensors_header(small_file)


def test_shard_index_decides_the_files(make_checkpoint):
    folder = make_checkpoint(shard_bytes=200_000)
    files = checkpoint_files(folder)
    assert len(files) > 1 and all(f.exists() for f in files)
    index = json.loads((folder / INDEX_FILE).read_text())
    assert sorted({folder / f for f in index["weight_map"].values()}) == files
    (folder / "stray.safetensors").write_bytes(b"not listed in the index, so never read")
    assert checkpoint_files(folder) == files


def test_shard_index_pointing_to_a_missing_file(make_checkpoint):
    folder = make_checkpoint(shard_bytes=200_000)
    missing = checkpoint_files(folder)[1]
    missing.unlink()
    with pytest.raises(CheckpointError, match=f"shard {missing} is missing"):
        checkpoint_files(folder)


@pytest.mark.parametrize("text", ["{", "[]", '{"metadata": {}}', '{"weight_map": [1]}', '{"weight_map": {}}'])
def test_unreadable_shard_index(make_checkpoint, text):
    folder = make_checkpoint(shard_bytes=200_000)
    (folder / INDEX_FILE).write_text(text)
    with pytest.raises(CheckpointError, match=INDEX_FILE):
        checkpoint_files(folder)


def test_folder_without_weights(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        checkpoint_files(tmp_path)


def test_store_holds_every_tensor_and_reports_leftovers(make_checkpoint):
    folder = make_checkpoint(shard_bytes=200_000)
    store = TensorStore(folder, progress=False)
    expected = dict(tensor_shapes(model_args(qwen2_moe_config())))
    assert {n: tuple(store.peek(n).shape) for n in store.names()} == expected
    assert all(store.where(n).endswith(".safetensors") for n in expected)
    for name in list(expected):
        if name != "model.norm.weight":
            store.take(name)
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.norm.weight' not used"):
        store.check_all_used()
    assert store.take_optional("model.norm.weight") is not None
    assert store.take_optional("model.norm.weight") is None
    store.check_all_used()
    with pytest.raises(CheckpointError, match="missing tensor 'model.norm.weight'"):
        store.take("model.norm.weight")


def test_store_rejects_a_tensor_stored_twice(tmp_path):
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        mx.save_safetensors(str(tmp_path / name), {"x": mx.zeros((2,))})
    with pytest.raises(CheckpointError, match="'x' also stored in"):
        TensorStore(tmp_path)


def test_store_values_round_trip(tmp_path):
    value = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"w": mx.array(value)})
    assert np.array_equal(np.array(TensorStore(tmp_path).take("w")), value)


def test_tokenizer_round_trip(float_checkpoint):
    tok = Tokenizer(float_checkpoint / "tokenizer.json")
    assert tok.vocab_size == 256
    text = "Mixture of experts: héllo!"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode()) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode(range(256))  # every id decodes
    assert tok.token_to_id("!") is not None and tok.token_to_id("not a token") is None


def test_bad_tokenizer_names_the_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": 3}')
    with pytest.raises(CheckpointError, match=str(path)):
        Tokenizer(path)

