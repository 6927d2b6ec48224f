"""Trace export: long-format frames that agree with the records, and parquet/JSON files that read back."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import moebench
from moebench.errors import MoebenchError
from moebench.inspect.export import read_frames, save_frames, save_trace, to_frames
from moebench.inspect.interventions import intervene
from moebench.inspect.record import Stepper

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
