"""Property: however a checkpoint folder is corrupted, loading and running it either works or raises a
MoebenchError, and nothing outside the folder is read. Any other exception fails the test; an MLX abort would
kill the test process itself.

Corruptions: truncating any file, overwriting header or data bytes, rewriting a tensor's shape, dtype or
data_offsets in the safetensors header, repeating a header key, writing NaN / Inf over a tensor's values,
pointing a shard index entry outside the folder or at nothing, and changing or deleting config.json values
(quantization block included; numbers as JSON's Infinity and NaN too).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moebench
from moebench.checkpoint.files import INDEX_FILE, SAFETENSORS_DTYPES
from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

KINDS = ("truncate", "header_bytes", "data_bytes", "shape", "dtype", "offsets", "duplicate_key", "nonfinite",
         "index_entry", "config_value", "config_number", "config_drop")
DECOY = "decoy.safetensors"  # a valid checkpoint file beside the folder: reading it would be reading outside
NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e39, 3.5e38, 1e-45, 0.0, -1.0]),
                    st.integers(-2, 10**6))
JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 300), st.sampled_from([0, 1, 2, 4, 8, 32, 64, 128, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4), st.lists(st.integers(-2, 5), max_size=3),
    st.dictionaries(st.sampled_from(["bits", "group_size", "mode"]), st.integers(-1, 129), max_size=2),
)


@pytest.fixture(scope="module")
def bases(float_checkpoint, quantized_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """Read-only originals: float HF layout, 4-bit per-expert, and 8-bit g32 stacked in shards."""
    sharded = write_random_checkpoint(tmp_path_factory.mktemp("fuzz") / "sharded", qwen2_moe_config(), seed=5,
                                      bits=8, group_size=32, layout="stacked", shard_bytes=150_000)
    return {"float": float_checkpoint, "quantized": quantized_checkpoint, "sharded": sharded}


def _safetensors(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _overwrite(path: Path, data: st.DataObject, lo: int, hi: int) -> None:
    """Overwrite a few bytes of `path` somewhere in [lo, hi)."""
    blob = bytearray(path.read_bytes())
    hi = min(hi, len(blob))
    if hi <= lo:
        return
    start = data.draw(st.integers(lo, hi - 1), label="offset")
    new = data.draw(st.binary(min_size=1, max_size=8), label="bytes")
    blob[start : start + len(new)] = new
    path.write_bytes(bytes(blob))


def _new_shape(data: st.DataObject, shape: list[int]) -> list:
    numel = 1
    for d in shape:
        numel *= d
    same_size = [list(reversed(shape)), [numel], [1, *shape], shape[:-1] or [1], [*shape[:-1], 2, shape[-1] // 2]]
    return data.draw(st.one_of(st.sampled_from(same_size),
                               st.lists(st.integers(0, 300), max_size=4),
                               st.just("not a shape")), label="shape")


def corrupt(folder: Path, data: st.DataObject, raw_safetensors) -> None:
    kind = data.draw(st.sampled_from(KINDS), label="kind")
    if kind == "truncate":
        path = data.draw(st.sampled_from(sorted(folder.iterdir())), label="file")
        size = path.stat().st_size
        path.write_bytes(path.read_bytes()[: data.draw(st.integers(0, max(size - 1, 0)), label="keep")])
    elif kind in ("header_bytes", "data_bytes"):
        path = data.draw(st.sampled_from(_safetensors(folder)), label="file")
        header_end = 8 + int.from_bytes(path.read_bytes()[:8], "little")
        lo, hi = (0, header_end) if kind == "header_bytes" else (header_end, path.stat().st_size)
        _overwrite(path, data, lo, hi)
    elif kind in ("shape", "dtype"):
        path = data.draw(st.sampled_from(_safetensors(folder)), label="file")
        raw = raw_safetensors.read(path)
        name = data.draw(st.sampled_from(sorted(n for n in raw.header if n != "__metadata__")), label="tensor")
        if kind == "shape":
            raw.header[name]["shape"] = _new_shape(data, raw.header[name]["shape"])
        else:
            raw.header[name]["dtype"] = data.draw(st.sampled_from([*SAFETENSORS_DTYPES, "F8_E4M3", ""]), label="dtype")
        raw.write(path)
    elif kind == "offsets":
        path = data.draw(st.sampled_from(_safetensors(folder)), label="file")
        raw = raw_safetensors.read(path)
        names = sorted(n for n in raw.header if n != "__metadata__")
        name, other = data.draw(st.sampled_from(names), label="tensor"), data.draw(st.sampled_from(names), label="to")
        start = data.draw(st.one_of(st.just(raw.header[other]["data_offsets"][0]), st.integers(0, len(raw.data))),
                          label="start")
        size = raw.header[name]["data_offsets"][1] - raw.header[name]["data_offsets"][0]
        raw.header[name]["data_offsets"] = [start, start + size]  # the right size, maybe over another tensor's bytes
        raw.write(path)
    elif kind == "duplicate_key":
        path = data.draw(st.sampled_from(_safetensors(folder)), label="file")
        raw = raw_safetensors.read(path)
        name = data.draw(st.sampled_from(sorted(n for n in raw.header if n != "__metadata__")), label="tensor")
        text = raw.header_bytes().decode()
        entry = json.dumps({name: raw.header[name]})[1:-1]
        raw.write(path, (text[:-1] + ", " + entry + "}").encode())
    elif kind == "nonfinite":
        path = data.draw(st.sampled_from(_safetensors(folder)), label="file")
        raw = raw_safetensors.read(path)
        floats = sorted(n for n, h in raw.header.items()
                        if n != "__metadata__" and h["dtype"] in ("F32", "F16", "BF16"))
        if floats:
            name = data.draw(st.sampled_from(floats), label="tensor")
            info = raw.header[name]
            width = {"F32": 4, "F16": 2, "BF16": 2}[info["dtype"]]
            start, end = info["data_offsets"]
            code = data.draw(st.sampled_from(["nan", "inf", "-inf"]), label="value")
            pattern = struct.pack("<f" if width == 4 else "<e", float(code))
            if info["dtype"] == "BF16":
                pattern = struct.pack("<f", float(code))[2:]
            at = start + width * data.draw(st.integers(0, max((end - start) // width - 1, 0)), label="index")
            raw.data = raw.data[:at] + pattern + raw.data[at + width:]
            raw.write(path)
    elif kind == "index_entry":
        index = folder / INDEX_FILE
        if index.exists():
            content = json.loads(index.read_text())
            key = data.draw(st.sampled_from(sorted(content["weight_map"])), label="tensor")
            content["weight_map"][key] = data.draw(st.sampled_from([
                f"../{DECOY}", str(folder.parent / DECOY), "/etc/passwd", "", "missing.safetensors", 5, None,
                f"sub/../../{DECOY}", "./" + content["weight_map"][key], f"{folder.name}/../../{DECOY}"]),
                label="shard")
            index.write_text(json.dumps(content))
    else:
        path = folder / "config.json"
        cfg = json.loads(path.read_text())
        target = cfg
        if "quantization" in cfg and data.draw(st.booleans(), label="in quantization block"):
            target = cfg["quantization"]
        key = data.draw(st.sampled_from(sorted(target) + ["head_dim"]), label="key")
        if kind == "config_drop":
            target.pop(key, None)
        elif kind == "config_number":
            key = data.draw(st.sampled_from(["rope_theta", "rms_norm_eps", "max_position_embeddings", key]),
                            label="number key")
            target[key] = data.draw(NUMBERS, label="value")
        else:
            target[key] = data.draw(JSON_VALUES, label="value")
        path.write_text(json.dumps(cfg))  # json writes inf and nan as Infinity and NaN, which json.loads reads back


def load_and_run(folder: Path) -> None:
    model, _ = moebench.load(folder, progress=False)
    mx.eval(model(mx.array([[1, 2, 3]])))
    moebench.generate(model, [4, 5], 2)  # prefill + one cached decode step


class Reads:
    """The files opened while active: every path mx.load is given, and every open() (an audit hook, which stays for
    the process: it records only while a Reads is active)."""

    active: Reads | None = None
    hooked = False

    def __init__(self):
        self.paths: list[str] = []

    def __enter__(self) -> Reads:
        if not Reads.hooked:
            sys.addaudithook(lambda event, args: Reads.active and event == "open" and Reads.active.add(args[0]))
            Reads.hooked = True
        Reads.active = self
        return self

    def __exit__(self, *exc) -> None:
        Reads.active = None

    def add(self, path) -> None:
        if isinstance(path, (str, bytes, os.PathLike)):
            self.paths.append(os.fsdecode(path))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_checkpoints_fail_only_with_moebench_errors(bases, raw_safetensors, monkeypatch, data):
    base = bases[data.draw(st.sampled_from(sorted(bases)), label="base")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(shutil.copytree(base, Path(tmp) / "ckpt"))
        shutil.copy(_safetensors(bases["float"])[0], Path(tmp) / DECOY)
        corrupt(folder, data, raw_safetensors)
        real_load = mx.load
        with Reads() as reads, monkeypatch.context() as patch:
            patch.setattr(mx, "load", lambda path, *a, **k: reads.add(path) or real_load(path, *a, **k))
            try:
                load_and_run(folder)
            except moebench.MoebenchError as e:
                assert str(e)  # every error says something
        inside = str(folder.resolve()) + os.sep
        outside = [p for p in reads.paths if p.startswith(tmp) and not os.path.realpath(p).startswith(inside)]
        assert not outside and "/etc/passwd" not in reads.paths, outside


def test_the_originals_load_and_run(bases):
    for folder in bases.values():
        load_and_run(folder)
