"""Qwen2-MoE and Qwen3-MoE converted by mlx_lm.convert to mxfp4, nvfp4 and mxfp8 decode through the fused kernel
pair on every decode step, with logits as close to the gather_qmm fallback's as the affine checkpoints' are."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import moebench
from moebench.checkpoint.loader import load
from moebench.decode.loop import generate_tokens
from moebench.execution.executor import fused_moe
from moebench.execution.support import MICROSCALED
from moebench.inspect.truth import nmax
from moebench.tools.drift import make_variant
from moebench.tools.presets import write_random

pytest.importorskip("mlx_lm")

SHIPPED = Path(__file__).resolve().parents[2] / "data" / "tiny-qwen2-moe"  # float32, affine 4-bit experts
PROMPT = [5, 17, 99, 3, 42, 7]
STEPS = 8  # tokens: the prefill's, then STEPS - 1 single-token decode steps
LOGITS_NMAX = 1e-5  # fused vs fallback logits, largest difference over the largest logit: affine is ~1e-6


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """The shipped Qwen2-MoE and a random float32 Qwen3-MoE at the qwen3-tiny preset, both affine 4-bit."""
    qwen3 = write_random(tmp_path_factory.mktemp("qwen3") / "qwen3-tiny", "qwen3-tiny", dtype="float32",
                         progress=False)
    return {"qwen2_moe": SHIPPED, "qwen3_moe": qwen3}


@pytest.fixture(scope="module")
def variants(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("variants")


def decode_logits(model, fused: bool, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy ids and each step's logits of an eager decode, fused on or off."""
    with fused_moe(fused, model):
        decoded = [(tid, np.array(logits)) for tid, logits in generate_tokens(model, prompt, steps, compiled=False)]
    return [tid for tid, _ in decoded], [logits for _, logits in decoded]


def fused_then_fallback(model, prompt: list[int], steps: int) -> tuple[tuple[list, list], tuple[list, list]]:
    """(ids, logits) fused, then fallback; the fused decode's prefill fell back and every decode step of every MoE
    layer ran the kernels."""
    fused = decode_logits(model, True, prompt, steps)
    counts = moebench.dispatch(model)["moe"]
    assert sorted(counts) == sorted(model.moe_blocks())
    for layer, c in counts.items():
        assert c["fused"] == {"reference": steps - 1} and c["fallback"] == 1, (layer, c)
    return fused, decode_logits(model, False, prompt, steps)


@pytest.mark.parametrize("mode", ("affine", *MICROSCALED))
@pytest.mark.parametrize("family", ("qwen2_moe", "qwen3_moe"))
def test_converted_checkpoints_run_the_fused_pair_on_every_decode_step(sources, variants, family, mode):
    folder = sources[family] if mode == "affine" else make_variant(sources[family], mode, variants)
    model, _ = load(folder)
    assert model.args.model_type == family
    for block in model.moe_blocks().values():
        assert {p.mode for p in block.switch_mlp.quantized_parts()} == {mode}
    (fused_ids, fused_logits), (fallback_ids, fallback_logits) = fused_then_fallback(model, PROMPT, STEPS)
    assert fused_ids == fallback_ids
    for step, (fused, fallback) in enumerate(zip(fused_logits, fallback_logits, strict=True)):
        assert np.isfinite(fused).all()
        assert nmax(fused, fallback) < LOGITS_NMAX, f"step {step}: nmax {nmax(fused, fallback):.2e}"
