"""moebench drift: variants named on the command line (folders, switch suffixes, routing files, recipes made from the
reference by mlx-lm or, without it, by moebench's writer), the per-layer table it prints, and its errors."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import moebench
from moebench.checkpoint.loader import SHIPPED_MODEL
from moebench.cli import main
from moebench.errors import MoebenchError
from moebench.inspect.drift import teacher_force
from moebench.inspect.routing_files import write_routing
from moebench.tools import drift
from moebench.tools.corpus import DEFAULT_CACHE
from moebench.tools.drift import DIGESTS, make_variant, read_prompts, source_digest

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


def test_variants_are_kept_by_content_so_the_same_weights_are_made_once(tmp_path, float_checkpoint,
                                                                        quantized_checkpoint):
    """A copy of a folder (another path, another name) shares its variants, kept under the name of the folder they
    were first made from; other weights of the same name, or the folder rewritten, get their own."""
    other = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(float_checkpoint, other)
    assert source_digest(other) == source_digest(float_checkpoint)
    assert source_digest(quantized_checkpoint) != source_digest(float_checkpoint)  # both named `ckpt`
    made = make_variant(float_checkpoint, "4bit", tmp_path / "made")
    assert make_variant(other, "4bit", tmp_path / "made") == made and len(list((tmp_path / "made").iterdir())) == 2
    config = other / "config.json"
    config.write_text(config.read_text() + "\n")
    assert source_digest(other) != source_digest(float_checkpoint)


def test_a_folders_digest_is_read_once_and_remembered_until_a_file_changes(tmp_path, float_checkpoint, monkeypatch):
    memo = tmp_path / DIGESTS
    digest = source_digest(float_checkpoint, memo)
    assert list(json.loads(memo.read_text()).values()) == [digest]
    monkeypatch.setattr(drift.hashlib, "sha256", lambda *a: pytest.fail("a remembered folder was read again"))
    assert source_digest(float_checkpoint, memo) == digest
    monkeypatch.undo()
    folder = shutil.copytree(float_checkpoint, tmp_path / "copy")
    (folder / "config.json").write_text((folder / "config.json").read_text() + " ")
    assert source_digest(folder, memo) != digest and len(json.loads(memo.read_text())) == 2
    memo.write_text("[not a memo")  # a cache: what it cannot read counts as nothing remembered
    assert source_digest(float_checkpoint, memo) == digest and digest in json.loads(memo.read_text()).values()


def test_the_suite_keeps_moebenchs_cache_in_a_folder_of_its_own():
    """tests/conftest.py points MOEBENCH_CACHE at a folder of the run before moebench reads it: the variants the
    notebooks and these tests make never land in the user's ~/.cache/moebench."""
    assert DEFAULT_CACHE == Path(os.environ["MOEBENCH_CACHE"]) and DEFAULT_CACHE.name.startswith("moebench-test-cache")
    assert main.__module__ == "moebench.cli" and drift.DEFAULT_CACHE == DEFAULT_CACHE


def test_without_mlx_lm_the_writer_makes_affine_recipes(monkeypatch, tmp_path, float_checkpoint):
    monkeypatch.setitem(sys.modules, "mlx_lm.convert", None)  # import fails as if mlx-lm were absent
    folder = make_variant(float_checkpoint, "4bit", tmp_path)
    assert json.loads((folder / "config.json").read_text())["quantization"]["bits"] == 4
    model, tok = moebench.load(folder)
    assert tok is not None and model.load_info.bits
    with pytest.raises(MoebenchError, match="mxfp4 recipe needs mlx-lm"):
        make_variant(float_checkpoint, "mxfp4", tmp_path)


@pytest.mark.parametrize("recipe", ["8bit", "4-bit"])
def test_without_mlx_lm_a_recipe_of_a_quantized_folder_names_that_recipe(monkeypatch, tmp_path, capsys, prompts,
                                                                        recipe):
    """The shipped model is 4-bit: its 8bit variant needs it dequantized first, which needs mlx-lm. The error names
    the 8bit recipe asked for (not the float step under it) and what works without mlx-lm."""
    monkeypatch.setitem(sys.modules, "mlx_lm.convert", None)
    made = tmp_path / "made"
    argv = ["drift", str(SHIPPED_MODEL), recipe, "--prompts", str(prompts), "--variants-dir", str(made)]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after the variants' progress bar
    assert err.startswith(f"moebench: error: {SHIPPED_MODEL}: the {recipe.replace('-', '')} recipe of a quantized "
                          "folder needs mlx-lm to dequantize it first") and "float recipe" not in err
    assert "moebench's writer quantizes float folders only" in err
    assert [p.name for p in made.iterdir()] == [DIGESTS]  # nothing half-made


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


def test_the_per_layer_table_fits_100_columns(capsys, float_checkpoint, prompts):
    assert main(["drift", str(float_checkpoint), f"{float_checkpoint}:fallback", "--prompts", str(prompts)]) == 0
    text = capsys.readouterr().out
    table = text.split("  data: ", 1)[1].splitlines()[1:]
    assert table[0].split()[:3] == ["variant", "layer", "tokens"] and max(map(len, table)) <= 100
    assert any("moved" in line for line in table)  # the columns past 100 are printed below, not dropped
