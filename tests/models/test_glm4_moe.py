"""The GLM-4.x MoE family against transformers' Glm4MoeForCausalLM on tiny float32 folders it saved itself (a random
selection bias, grouped routing, a dense first layer, shared experts, partial rotary, with and without q/k norm) and
mlx-lm's glm4_moe on the folders `mlx_lm.convert` writes from them; the fused kernels on every decode step of the
quantized ones, and the selection bias shown apart from the scores."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from family_parity import (
    conversions,
    converted_matches_and_runs_fused,
    make_random_loads_in_mlx_lm,
    matches_transformers,
    prompt,
    published,
    recipes,
)

import moebench
from moebench.inspect.record import decode

pytest.importorskip("torch", reason="the float folders are written by transformers (dev dependency torch)")
pytest.importorskip("mlx_lm", reason="the quantized folders are written and checked by mlx-lm")

BASE = dict(vocab_size=256, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16, n_shared_experts=1,
            num_experts_per_tok=4, first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
            routed_scaling_factor=1.5, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
            rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=None,
            pad_token_id=None, bos_token_id=None, num_nextn_predict_layers=0)
CONFIGS = {"grouped-qknorm": {}, "air-like": dict(n_group=1, topk_group=1, use_qk_norm=False,
                                                  routed_scaling_factor=1.0, num_experts_per_tok=2)}
RECIPES = recipes()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    return published(tmp_path_factory, "glm", Glm4MoeConfig, Glm4MoeForCausalLM, BASE, CONFIGS)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hf_folder):
    return conversions(tmp_path_factory, "glm", lambda: hf_folder("grouped-qknorm"), RECIPES)


@pytest.mark.parametrize("name", CONFIGS)
def test_float_folders_compute_transformers_logits(hf_folder, name):
    from transformers import Glm4MoeForCausalLM

    folder = hf_folder(name)
    model, _ = moebench.load(folder)
    assert model.args.model_type == "glm4_moe" and sorted(model.moe_blocks()) == [1, 2]  # layer 0 dense
    block = model.moe_blocks()[1]
    assert float(mx.abs(block.parts().selection_bias).max()) > 0.05  # the stored bias, not zeros
    matches_transformers(folder, Glm4MoeForCausalLM, prompt(0, BASE["vocab_size"]))


def test_the_selection_bias_changes_the_choice_and_is_recorded_apart(hf_folder):
    """The recorded router_probs are the unbiased sigmoid scores; choice_scores adds the bias (and masks the groups
    left out); some chosen experts are there because of the bias alone."""
    model, tokenizer = moebench.load(hf_folder("grouped-qknorm"))
    trace = decode(model, tokenizer, "def f(x):", 6, record=True)
    made_by_bias = 0
    for step in trace.steps:
        for layer in (1, 2):
            rec = step.layers[layer]
            bias = np.array(model.moe_blocks()[layer].parts().selection_bias)
            kept = np.isfinite(rec.choice_scores)
            np.testing.assert_allclose(rec.choice_scores[kept], (rec.router_probs + bias)[kept], rtol=1e-6)
            assert set(rec.topk_ids.tolist()) <= set(np.flatnonzero(kept).tolist())
            unbiased = set(np.argsort(-np.where(kept, rec.router_probs, -np.inf))[:4].tolist())
            made_by_bias += len(set(rec.topk_ids.tolist()) - unbiased)
    assert made_by_bias > 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_converted_folders_match_mlx_lm_and_run_fused(converted, recipe):
    converted_matches_and_runs_fused(converted(recipe), BASE["vocab_size"])


def test_make_random_writes_what_mlx_lm_loads(tmp_path):
    make_random_loads_in_mlx_lm(tmp_path / "g", "glm4-moe-tiny", BASE["vocab_size"])
