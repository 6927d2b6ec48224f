"""The DeepSeek-V3 family (multi-head latent attention, the grouped sigmoid router) against transformers'
DeepseekV3ForCausalLM on tiny float32 folders it saved itself (kv_b_proj whole, a random selection bias, YaRN or
plain rotary, with and without q_lora_rank) and mlx-lm's deepseek_v3 on the folders `mlx_lm.convert` writes from
them (embed_q / unembed_out); the fused MoE kernels on every decode step of the quantized ones, the attention's
latent cache, and the plan saying why the decode-attention kernel does not run it."""

from __future__ import annotations

import mlx.core as mx
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
from moebench.decode.cache import make_cache
from moebench.execution.steps import LATENT_REASON

pytest.importorskip("torch", reason="the float folders are written by transformers (dev dependency torch)")
pytest.importorskip("mlx_lm", reason="the quantized folders are written and checked by mlx-lm")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
BASE = dict(vocab_size=256, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16, n_shared_experts=1,
            num_experts_per_tok=4, first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
            routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=32, rope_parameters=YARN, rms_norm_eps=1e-6, max_position_embeddings=256,
            tie_word_embeddings=False, attention_bias=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)
CONFIGS = {"yarn-q-lora": {}, "plain-q-proj": dict(q_lora_rank=None, n_group=1, topk_group=1,
                                                   rope_parameters={"rope_type": "default", "rope_theta": 5e4})}
RECIPES = recipes(32)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return published(tmp_path_factory, "dsv3", DeepseekV3Config, DeepseekV3ForCausalLM, BASE, CONFIGS)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hf_folder):
    return conversions(tmp_path_factory, "dsv3", lambda: hf_folder("yarn-q-lora"), RECIPES)


@pytest.mark.parametrize("name", CONFIGS)
def test_float_folders_compute_transformers_logits(hf_folder, name):
    from transformers import DeepseekV3ForCausalLM

    folder = hf_folder(name)
    model, _ = moebench.load(folder)
    assert model.args.model_type == "deepseek_v3" and sorted(model.moe_blocks()) == [1, 2]
    matches_transformers(folder, DeepseekV3ForCausalLM, prompt(0, BASE["vocab_size"]))


def test_the_cache_holds_the_latent_and_the_rotary_key(hf_folder):
    model, _ = moebench.load(hf_folder("yarn-q-lora"))
    cache = make_cache(len(model.layers))
    model(mx.array([prompt(3, BASE["vocab_size"])]), cache)
    assert cache[0].keys.shape[1:] == (1, cache[0].keys.shape[2], BASE["kv_lora_rank"])
    assert cache[0].values.shape[-1] == BASE["qk_rope_head_dim"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_converted_folders_match_mlx_lm_and_run_fused(converted, recipe):
    found = converted_matches_and_runs_fused(converted(recipe), BASE["vocab_size"])
    for counts in found["attention"].values():  # MLA runs as MLX ops on every decode step, and the plan says why
        assert counts["fused"] == {} and counts["reasons"].get(LATENT_REASON) == 7, counts


def test_make_random_writes_what_mlx_lm_loads(tmp_path):
    make_random_loads_in_mlx_lm(tmp_path / "d", "deepseek-v3-tiny", BASE["vocab_size"], group_size=32)
