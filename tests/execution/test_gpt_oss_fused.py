"""gpt-oss decodes through the fused MoE kernels on every decode step: a tiny gpt-oss checkpoint as the published
MLX conversions lay it out (mxfp4 experts with biases, a biased router, affine 4-bit around them) and its
mlx_lm.convert affine 4-bit conversion run the router kernel (top-k logits then softmax) and the kernel pair (expert
biases, the clamped SwiGLU) with no decline; greedy tokens and logits match the gather_qmm fallback's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from byte_tokenizer import write_byte_tokenizer
from test_microscaled_decode import fused_then_fallback

from moebench.checkpoint.loader import load
from moebench.execution.executor import executor
from moebench.inspect.truth import nmax
from moebench.tools.drift import make_variant
from moebench.tools.presets import get_preset
from moebench.tools.writer import write_gpt_oss_mlx_lm_checkpoint

pytest.importorskip("mlx_lm")

PROMPT = [5, 17, 99, 3, 42, 7, 200, 11]  # past the window of 4
STEPS = 10  # tokens: the prefill's, then STEPS - 1 single-token decode steps
LOGITS_NMAX = 1e-5  # fused vs fallback logits, as for the other families (test_microscaled_decode)
NEAR_TIE = 1e-3  # a greedy parting is a near-tie when the fallback's top two logits are this close


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """gpt-oss-tiny's widths at gpt-oss-20b's routing (32 experts, top-4) with a clamp that bites (limit 1), in
    mlx-lm's layout: mxfp4 experts, affine 4-bit g32 elsewhere (as `moebench make-random` writes it)."""
    config = {**get_preset("gpt-oss-tiny").config, "num_local_experts": 32, "num_experts_per_tok": 4,
              "swiglu_limit": 1.0, "torch_dtype": "float32"}
    folder = write_gpt_oss_mlx_lm_checkpoint(tmp_path_factory.mktemp("gpt-oss") / "gpt-oss-tiny", config, seed=36)
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def folders(published, tmp_path_factory) -> dict[str, Path]:
    return {"mxfp4": published, "affine": make_variant(published, "4bit", tmp_path_factory.mktemp("variants"))}


@pytest.mark.parametrize("mode", ("mxfp4", "affine"))
def test_gpt_oss_runs_the_fused_moe_kernels_on_every_decode_step(folders, mode):
    model, _ = load(folders[mode])
    assert model.args.model_type == "gpt_oss"
    for block in model.moe_blocks().values():
        assert {p.mode for p in block.switch_mlp.quantized_parts()} == {mode}
        assert "bias" in block.gate and "bias" in block.switch_mlp.down_proj
    decode_plan = executor(model).plan_for(1, False)  # a decode step's plan, fused on (the default)
    for i in model.moe_blocks():
        decision = decode_plan.layers[i].moe
        assert decision.fused and decision.reason is None and decision.note is None, (i, decision)
    (fused_ids, fused_logits), (fallback_ids, fallback_logits) = fused_then_fallback(model, PROMPT, STEPS)
    for step, (fused, fallback) in enumerate(zip(fused_logits, fallback_logits, strict=True)):
        assert np.isfinite(fused).all()
        if fused_ids[:step] != fallback_ids[:step]:
            break  # parted at a near-tie (checked below): the later steps see different tokens
        assert nmax(fused, fallback) < LOGITS_NMAX, f"step {step}: nmax {nmax(fused, fallback):.2e}"
    parted = next((i for i, (a, b) in enumerate(zip(fused_ids, fallback_ids, strict=True)) if a != b), None)
    if parted is not None:
        top2 = np.sort(fallback_logits[parted].reshape(-1))[-2:]
        assert top2[1] - top2[0] < NEAR_TIE, f"greedy tokens part at step {parted}, no near-tie"
