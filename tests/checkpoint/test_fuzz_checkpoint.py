"""Property: however a checkpoint folder is corrupted, loading and running it either works or raises a
MoebenchError. Any other exception fails the test; an MLX abort would kill the test process itself.

Corruptions: truncating any file, overwriting header or data bytes, rewriting a tensor's shape or dtype
in the safetensors header, and changing or deleting config.json values (quantization block included).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moebench
from moebench.checkpoint.files import SAFETENSORS_DTYPES
from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

KINDS = ("truncate", "header_bytes", "data_bytes", "shape", "dtype", "config_value", "config_drop")
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
    else:
        path = folder / "config.json"
        cfg = json.loads(path.read_text())
        target = cfg
        if "quantization" in cfg and data.draw(st.booleans(), label="in quantization block"):
            target = cfg["quantization"]
        key = data.draw(st.sampled_from(sorted(target) + ["head_dim"]), label="key")
        if kind == "config_drop":
            target.pop(key, None)
        else:
            target[key] = data.draw(JSON_VALUES, label="value")
        path.write_text(json.dumps(cfg))


def load_and_run(folder: Path) -> None:
    model, _ = moebench.load(folder, progress=False)
    mx.eval(model(mx.array([[1, 2, 3]])))
    moebench.generate(model, [4, 5], 2)  # prefill + one cached decode step


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_checkpoints_fail_only_with_moebench_errors(bases, raw_safetensors, data):
    base = bases[data.draw(st.sampled_from(sorted(bases)), label="base")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(shutil.copytree(base, Path(tmp) / "ckpt"))
        corrupt(folder, data, raw_safetensors)
        try:
            load_and_run(folder)
        except moebench.MoebenchError as e:
            assert str(e)  # every error says something


def test_the_originals_load_and_run(bases):
    for folder in bases.values():
        load_and_run(folder)
