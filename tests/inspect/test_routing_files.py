"""Routing files: every format written and read back is identical in what it carries, read_routing tells the formats
apart by content, and a file it cannot read is an error naming it."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from moebench.errors import MoebenchError
from moebench.inspect.drift import teacher_force
from moebench.inspect.routing_files import FORMATS, Routing, read_routing, write_routing

IDS_ONLY = ("sglang", "sglang-raw", "sglang-b64", "vllm")


@pytest.fixture(scope="module")
def routing(float_checkpoint):
    """A real routing: the tiny model teacher-forced on two sequences (ids, scores, probabilities, tokens)."""
    import moebench

    model, _ = moebench.load(float_checkpoint)
    rng = np.random.default_rng(0)
    return teacher_force(model, [rng.integers(0, 256, 12).tolist(), rng.integers(0, 256, 7).tolist()], name="tiny")


def _shape(r: Routing) -> dict:
    return {"layers": r.ids.shape[1], "top_k": r.ids.shape[2]}


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_is_identical(tmp_path, routing, fmt):
    path = write_routing(routing, tmp_path / f"r.{fmt}", fmt)
    back = read_routing(path, **_shape(routing))
    assert back.ids.dtype == np.int32
    assert np.array_equal(back.ids, routing.ids)
    if fmt == "moebench":
        assert back.layers == routing.layers
        for name in ("tokens", "seq", "scores", "probs"):
            assert np.array_equal(getattr(back, name), getattr(routing, name)), name
        assert back.scores.dtype == back.probs.dtype == np.float32
    else:  # ids only, the layer axis numbered from 0
        assert back.tokens is back.scores is back.probs is None
        assert back.layers == tuple(range(len(routing.layers)))
    assert back.logits is None  # logits never go to a file


def test_formats_are_the_layouts_engines_write(tmp_path, routing):
    """SGLang: int32 [tokens, layers, top_k] bytes (base64 in its meta_info); vLLM: nested id lists."""
    raw = write_routing(routing, tmp_path / "r.bin", "sglang-raw").read_bytes()
    assert np.array_equal(np.frombuffer(raw, np.int32).reshape(routing.ids.shape), routing.ids)
    text = write_routing(routing, tmp_path / "r.txt", "sglang-b64").read_bytes()
    assert base64.b64decode(text) == raw
    assert np.array_equal(np.load(write_routing(routing, tmp_path / "r.npy", "sglang")), routing.ids)
    data = json.loads(write_routing(routing, tmp_path / "r.json", "vllm").read_text())
    assert data["routed_experts"] == routing.ids.tolist()
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(routing.ids.tolist()))  # a bare list reads too
    assert np.array_equal(read_routing(bare).ids, routing.ids)


def test_bad_files_name_the_file(tmp_path, routing):
    cases = {
        "empty.bin": (b"", "empty"),
        "odd.bin": (b"\x01\x00\x00\x00" * 3, "not a whole number of tokens"),
        "notjson.json": (b"{nope", "not valid JSON"),
        "nofield.json": (b'{"experts": []}', "routed_experts"),
        "ragged.json": (b"[[[1, 2]], [[3]]]", "routed_experts"),
        "flat.json": (b"[1, 2, 3]", "[tokens, layers, top_k]"),
        "negative.json": (b"[[[1, -2]]]", "expert id -2"),
        "floats.json": (b"[[[1.5, 2.0]]]", "integer expert ids"),
        "bad.npy": (b"\x93NUMPY\x01\x00garbage", "corrupt .npy"),
        "bad.parquet": (b"PAR1 not really", "corrupt parquet"),
    }
    for name, (blob, words) in cases.items():
        path = tmp_path / name
        path.write_bytes(blob)
        with pytest.raises(MoebenchError, match=words) as e:
            read_routing(path, layers=2, top_k=2)
        assert name in str(e.value)
    raw = write_routing(routing, tmp_path / "noshape.bin", "sglang-raw")
    with pytest.raises(MoebenchError, match="give layers and top_k") as e:
        read_routing(raw)
    assert "noshape.bin" in str(e.value)
    with pytest.raises(MoebenchError, match="missing.npy"):
        read_routing(tmp_path / "missing.npy")
    with pytest.raises(MoebenchError, match="format must be one of"):
        write_routing(routing, tmp_path / "x", "csv")


def test_a_parquet_file_of_other_data_is_refused(tmp_path):
    import pandas as pd

    path = tmp_path / "other.parquet"
    pd.DataFrame({"a": [1, 2]}).to_parquet(path)
    with pytest.raises(MoebenchError, match="without moebench routing metadata") as e:
        read_routing(path)
    assert "other.parquet" in str(e.value)


def test_routing_checks_its_shapes():
    with pytest.raises(MoebenchError, match="ids must be"):
        Routing(np.zeros((3, 2), np.int32), (0, 1))
    with pytest.raises(MoebenchError, match="scores has shape"):
        Routing(np.zeros((3, 2, 2), np.int32), (0, 1), scores=np.zeros((3, 2, 3)))
    with pytest.raises(MoebenchError, match="2 layer numbers for 3 layers"):
        Routing(np.zeros((1, 3, 2), np.int32), (0, 1))
    r = Routing(np.zeros((4, 2, 2), np.int32), (0, 1), source="x")
    assert "4 tokens" in repr(r) and "top-2" in repr(r)
