"""Trace export: long-format frames that agree with the records, and parquet/JSON files that read back."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pandas as pd
import pytest

import moebench
from moebench.errors import MoebenchError
from moebench.inspect.export import read_frames, save_frames, save_trace, to_frames
from moebench.inspect.interventions import intervene
from moebench.inspect.record import Stepper
from moebench.tools.presets import get_preset
from moebench.tools.writer import write_random_checkpoint

PROMPT = "Hello"  # one token per byte with the test tokenizer


@pytest.fixture(scope="module")
def trace(quantized_checkpoint):
    model, tok = moebench.load(quantized_checkpoint)
    with intervene(model, {1: moebench.Intervention(top_k=3)}):
        return Stepper(model, tok, PROMPT, record=True).run(4)


def test_frames_are_long_format_and_match_the_records(trace):
    frames = to_frames(trace)
    steps, layers = len(trace.steps), len(trace.steps[0].layers)
    r = trace.steps[-1].layers[1]
    assert len(frames["tokens"]) == steps and len(frames["candidates"]) == steps * 5
    assert len(frames["router"]) == steps * layers * len(r.router_probs)
    assert len(frames["routing"]) == steps * (2 + 3)  # layer 0 top-2, layer 1 top-3 (the intervention)
    assert len(frames["layers"]) == steps * layers
    last = frames["routing"].query(f"step == {steps - 1} and layer == 1").sort_values("rank")
    assert last["expert"].tolist() == r.topk_ids.tolist() and np.allclose(last["score"], r.topk_scores)
    row = frames["layers"].query(f"step == {steps - 1} and layer == 1").iloc[0]
    assert row["resid_mid_norm"] == pytest.approx(r.resid_mid_norm) and row["top_k"] == 3
    assert row["shared_gate"] == pytest.approx(r.shared_gate) and row["path"] == r.path.path
    assert row["attn_path"] == r.attn_path.path and row["attn_reason"] == (r.attn_path.reason or "")
    first = frames["layers"].query("step == 0").iloc[0]  # the prefill: attention ran MLX ops, and says why
    assert first["attn_path"] == "fallback" and "tokens (the kernel runs single-token decode)" in first["attn_reason"]
    tokens = frames["tokens"]
    assert tokens["token_id"].dropna().tolist() == trace.token_ids
    assert tokens["input_text"].tolist()[: len(PROMPT)] == list("Hello")
    assert json.loads(tokens["interventions"][0]) == {"1": {
        "force_experts": None, "ablate": [], "renormalize_ablation": False, "top_k": 3,
        "shared_expert": True, "shared_gate_scale": 1.0}}
    vectors = frames["vectors"].query(f"step == {steps - 1} and layer == 1")
    expert = vectors[vectors["name"] == "expert_out"].sort_values("rank")
    assert np.array_equal(np.stack(expert["values"].to_numpy()), r.expert_out)
    assert set(vectors["name"]) == {"expert_out", "routed_out", "shared_out", "block_out", "resid_pre",
                                    "resid_mid", "resid_post"}
    assert "vectors" not in to_frames(trace, vectors=False)


@pytest.mark.parametrize("fmt", ["parquet", "json"])
def test_files_read_back(trace, tmp_path, fmt):
    paths = save_trace(trace, tmp_path / "out", fmt)
    assert sorted(p.name for p in paths) == sorted(f"{n}.{fmt}" for n in to_frames(trace))
    back, frames = read_frames(tmp_path / "out"), to_frames(trace)
    for name in ("routing", "router", "layers", "candidates"):
        pd.testing.assert_frame_equal(back[name], frames[name], check_dtype=False)
    assert back["tokens"]["token_id"].dropna().astype(int).tolist() == trace.token_ids
    values = np.stack(back["vectors"]["values"].to_numpy())
    assert np.allclose(values, np.stack(frames["vectors"]["values"].to_numpy()))


def test_other_frames_save_beside_and_bad_format_is_rejected(tmp_path):
    frame = pd.DataFrame({"layer": [0, 1], "entropy": [1.5, 2.0]})
    save_frames({"stats": frame}, tmp_path, "json")
    pd.testing.assert_frame_equal(read_frames(tmp_path)["stats"], frame)
    with pytest.raises(MoebenchError, match="format"):
        save_frames({"stats": frame}, tmp_path, "csv")
    with pytest.raises(MoebenchError, match="not a folder"):
        read_frames(tmp_path / "missing")


# -- issue 37: paths and files an export cannot use are named, never raw and never a hang ---------------------------
FRAME = {"stats": pd.DataFrame({"layer": [0, 1], "entropy": [1.5, 2.0]})}


def test_an_export_makes_a_missing_folder_with_its_parents(tmp_path):
    [path] = save_frames(FRAME, tmp_path / "a" / "b", "json")
    assert path == tmp_path / "a" / "b" / "stats.json" and path.is_file()


@pytest.mark.parametrize("frames, fmt, words", [
    ({"stats": [1, 2]}, "json", "frame 'stats': expected a pandas DataFrame, got list"),
    ([pd.DataFrame()], "json", "frames must be a mapping of name to DataFrame"),
    ({"../up": pd.DataFrame()}, "json", "frame name '../up': must be a plain file name"),
    ({"": pd.DataFrame()}, "json", "frame name ''"), ({1: pd.DataFrame()}, "json", "frame name 1"),
    (FRAME, "csv", "export format must be one of"), (FRAME, None, "export format must be one of"),
    (FRAME, ["json"], "export format must be one of"),
])
def test_what_save_frames_cannot_write_is_named_before_anything_is_written(tmp_path, frames, fmt, words):
    with pytest.raises(MoebenchError, match=re.escape(words)):
        save_frames(frames, tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()


def test_export_paths_that_cannot_be_used_are_named(tmp_path):
    with pytest.raises(MoebenchError, match="a path cannot hold a NUL byte"):
        save_frames(FRAME, f"{tmp_path}/a\0b", "json")
    with pytest.raises(MoebenchError, match="export folder must be a path"):
        save_frames(FRAME, 3, "json")
    (tmp_path / "file").write_text("in the way")
    with pytest.raises(MoebenchError, match=re.escape(f"{tmp_path / 'file'}: cannot make the export folder")):
        save_frames(FRAME, tmp_path / "file", "json")
    (tmp_path / "folder" / "stats.json").mkdir(parents=True)  # a folder where the file goes
    with pytest.raises(MoebenchError, match="stats.json: not a regular file"):
        save_frames(FRAME, tmp_path / "folder", "json")
    os.mkfifo(tmp_path / "fifo.json")  # writing would block until a reader comes
    with pytest.raises(MoebenchError, match="fifo.json: not a regular file"):
        save_frames({"fifo": FRAME["stats"]}, tmp_path, "json")


@pytest.mark.parametrize("name, content, words", [
    ("stats.parquet", b"not parquet", "cannot read it as an exported parquet frame"),
    ("stats.json", b"{corrupt", "cannot read it as an exported json frame"),
    ("stats.json", b"\xff\xfe\x00", "cannot read it as an exported json frame"),
])
def test_read_frames_names_a_corrupt_file(tmp_path, name, content, words):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(MoebenchError, match=re.escape(f"{tmp_path / name}: {words}")):
        read_frames(tmp_path)


def test_read_frames_never_opens_what_is_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "stats.json")  # opening it would block for ever
    with pytest.raises(MoebenchError, match="stats.json: not a regular file"):
        read_frames(tmp_path)
    (tmp_path / "stats.json").unlink()
    (tmp_path / "stats.json").symlink_to(tmp_path / "gone.json")
    with pytest.raises(MoebenchError, match="stats.json: a link to .*gone.json, which does not exist"):
        read_frames(tmp_path)
    with pytest.raises(MoebenchError, match="a path cannot hold a NUL byte"):
        read_frames(f"{tmp_path}/a\0b")


def test_to_frames_takes_a_trace():
    with pytest.raises(MoebenchError, match="to_frames takes a Trace"):
        to_frames([1, 2])


@pytest.fixture(scope="module")
def hybrid_trace(tmp_path_factory):
    """A tiny Qwen3-Next written by make-random (three Gated DeltaNet layers, then a gated full-attention one)."""
    config = {**get_preset("qwen3-next-tiny").config, "torch_dtype": "float32"}
    model, _ = moebench.load(write_random_checkpoint(tmp_path_factory.mktemp("hybrid") / "ckpt", config, seed=6))
    return Stepper(model, None, [5, 6, 7], record=True).run(3)


def test_a_hybrid_exports_its_token_mixing_per_head_and_its_layer_kinds(hybrid_trace, tmp_path):
    frames = to_frames(hybrid_trace)
    steps = len(hybrid_trace.steps)
    kinds = frames["layers"].sort_values(["step", "layer"])["mixer_kind"].tolist()
    assert kinds == (["linear_attention"] * 3 + ["full_attention"]) * steps
    mixer = frames["mixer"]
    assert len(mixer) == steps * 4 * 4  # every layer 4 heads (4 value heads; 4 query heads on the full layer)
    last = hybrid_trace.steps[-1]
    for layer in (1, 3):
        r, rows = last.layers[layer], mixer.query(f"step == {last.index} and layer == {layer}").sort_values("head")
        assert (rows["mixer_kind"] == r.mixer_kind).all()
        assert np.allclose(rows["output_gate"], r.output_gate_means)
        for h in ("decay", "beta", "state_norm"):
            assert rows[h].isna().all() if getattr(r, h) is None else np.allclose(rows[h], getattr(r, h))
    first = mixer.query("step == 0 and layer == 0")  # a prompt position before the last: no state of its own
    assert first["state_norm"].isna().all() and first["decay"].notna().all()
    gate = frames["vectors"].query(f"step == {last.index} and layer == 3 and name == 'output_gate'")["values"]
    assert np.array_equal(np.array(gate.iloc[0]), last.layers[3].output_gate.reshape(-1))
    for fmt in ("parquet", "json"):
        save_trace(hybrid_trace, tmp_path / fmt, fmt)
        back = read_frames(tmp_path / fmt)
        pd.testing.assert_frame_equal(back["mixer"], mixer, check_dtype=False)
        assert back["layers"]["mixer_kind"].tolist() == frames["layers"]["mixer_kind"].tolist()


def test_a_family_with_one_kind_of_attention_exports_no_token_mixing(trace):
    frames = to_frames(trace)
    assert frames["mixer"].empty and list(frames["mixer"].columns) == [
        "step", "layer", "mixer_kind", "head", "decay", "beta", "state_norm", "output_gate"]
    assert (frames["layers"]["mixer_kind"] == "").all() and "output_gate" not in set(frames["vectors"]["name"])
