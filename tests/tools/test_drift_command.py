"""moebench drift: variants named on the command line (folders, switch suffixes, routing files, recipes made from the
reference by mlx-lm or, without it, by moebench's writer), the per-layer table it prints, and its errors."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pandas as pd
import pytest

import moebench
from moebench.cli import main
from moebench.errors import MoebenchError
from moebench.inspect.drift import teacher_force
from moebench.inspect.routing_files import write_routing
from moebench.tools.drift import make_variant, read_prompts, source_digest

# mlx-lm saves the byte tokenizer with <|endoftext|> added as id 256, past the tiny vocabulary: moebench warns, as
# it should, on every converted folder
pytestmark = pytest.mark.filterwarnings("ignore:.*the tokenizer has ids up to 256:UserWarning")


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('"def add(a, b):\\n    return a + b"\n{"prompt": "Once upon a time"}\n[1, 2, 3, 4, 5]\n')
    return path


def _run(capsys, *argv) -> dict:
    assert main(["drift", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_switch_suffix_and_routing_file_variants(capsys, tmp_path, float_checkpoint, prompts):
    model, tok = moebench.load(float_checkpoint)
    ids = [tok.encode("def add(a, b):\n    return a + b"), tok.encode("Once upon a time"), [1, 2, 3, 4, 5]]
    served = write_routing(teacher_force(model, ids), tmp_path / "served.npy", "sglang")
    out = tmp_path / "out" / "drift.parquet"
    r = _run(capsys, float_checkpoint, f"{float_checkpoint}:fallback", served, "--prompts", prompts, "--out", out)
    assert r["variants"] == ["ckpt", "ckpt:fallback", "served.npy"]
    assert r["tokens"] == sum(map(len, ids))
    table = pd.DataFrame(r["by_layer"])
    assert set(table["variant"]) == {"ckpt:fallback", "served.npy"}
    assert (table["real"] == 0).all()  # float32 fallback vs prefill, and the model's own routing read back
    assert (table.loc[table["variant"] == "served.npy", "jaccard"] == 1).all()
    frame = pd.read_parquet(out)
    assert len(frame) == 2 * r["tokens"] * len(model.moe_blocks())
    assert pd.read_csv(out.with_suffix(".csv")).shape[0] == len(table)


def test_recipes_are_made_by_mlx_lm_and_reused(capsys, tmp_path, float_checkpoint, prompts):
    pytest.importorskip("mlx_lm", reason="the recipes come from mlx_lm.convert")
    made = tmp_path / "made"
    r = _run(capsys, float_checkpoint, "8-bit", "mixed_3_6", "--prompts", prompts, "--variants-dir", made)
    assert r["variants"] == ["ckpt", "8bit", "mixed_3_6"]
    name = f"ckpt-{source_digest(float_checkpoint)}"
    q8 = json.loads((made / f"{name}-8bit" / "config.json").read_text())["quantization"]
    assert q8["bits"] == 8 and q8["group_size"] == 64
    mixed = json.loads((made / f"{name}-mixed_3_6" / "config.json").read_text())["quantization"]
    assert {v["bits"] for v in mixed.values() if isinstance(v, dict)} >= {3, 6}  # the recipe really mixes
    table = pd.DataFrame(r["by_layer"])
    q8_rows, mixed_rows = (table[table["variant"] == v] for v in ("8bit", "mixed_3_6"))
    assert q8_rows["jaccard"].mean() >= mixed_rows["jaccard"].mean()  # fewer bits, no less drift
    stamp = (made / f"{name}-8bit" / "model.safetensors").stat().st_mtime_ns
    assert make_variant(float_checkpoint, "8bit", made) == made / f"{name}-8bit"
    assert (made / f"{name}-8bit" / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_variant_is_never_taken_from_another_folder_of_the_same_name(tmp_path, float_checkpoint):
    """Made variants are kept by folder name and contents: another `ckpt`, or this one rewritten, gets its own."""
    other = tmp_path / "elsewhere" / "ckpt"
    shutil.copytree(float_checkpoint, other)
    assert source_digest(other) != source_digest(float_checkpoint)
    config = other / "config.json"
    before = source_digest(other)
    config.write_text(config.read_text() + "\n")
    assert source_digest(other) != before


def test_without_mlx_lm_the_writer_makes_affine_recipes(monkeypatch, tmp_path, float_checkpoint):
    monkeypatch.setitem(sys.modules, "mlx_lm.convert", None)  # import fails as if mlx-lm were absent
    folder = make_variant(float_checkpoint, "4bit", tmp_path)
    assert json.loads((folder / "config.json").read_text())["quantization"]["bits"] == 4
    model, tok = moebench.load(folder)
    assert tok is not None and model.load_info.bits
    with pytest.raises(MoebenchError, match="mxfp4 recipe needs mlx-lm"):
        make_variant(float_checkpoint, "mxfp4", tmp_path)


def test_errors_name_what_is_wrong(capsys, tmp_path, float_checkpoint, prompts):
    assert main(["drift", str(float_checkpoint), "8bit"]) == 2
    assert "exactly one of --prompts FILE and --held-out DOMAIN" in capsys.readouterr().err
    assert main(["drift", str(float_checkpoint), "--prompts", str(prompts)]) == 2
    assert "a reference and at least one variant" in capsys.readouterr().err
    assert main(["drift", str(float_checkpoint), "nothing-here", "--prompts", str(prompts)]) == 2
    assert "nothing-here: neither a checkpoint folder nor a routing file" in capsys.readouterr().err
    with pytest.raises(MoebenchError, match="unknown recipe"):
        make_variant(float_checkpoint, "9bit", tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    with pytest.raises(MoebenchError, match="bad.jsonl: prompt 0 must be"):
        read_prompts(bad)
    broken = tmp_path / "broken.json"
    broken.write_text("[1, ")
    with pytest.raises(MoebenchError, match="broken.json: not valid JSON"):
        read_prompts(broken)
    assert read_prompts(prompts)[2] == [1, 2, 3, 4, 5]


def test_every_option_has_help():
    from moebench.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    parser = sub.choices["drift"]
    assert all(a.help for a in parser._actions), [a.dest for a in parser._actions if not a.help]
    assert np.isfinite(parser.get_default("tie_margin"))
