"""The Mixtral family against transformers' MixtralForCausalLM on tiny float32 folders it saved itself (its
per-expert w1 / w3 / w2 under block_sparse_moe) and mlx-lm's mixtral on the folders `mlx_lm.convert` writes from
them; the fused kernels on every decode step of the quantized ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from byte_tokenizer import write_byte_tokenizer
from family_parity import (
    convert,
    converted_matches_and_runs_fused,
    made_once,
    make_random_loads_in_mlx_lm,
    matches_transformers,
    prompt,
    recipes,
)
from hf_reference import save_hf_checkpoint

import moebench

pytest.importorskip("torch", reason="the float folders are written by transformers (dev dependency torch)")
pytest.importorskip("mlx_lm", reason="the quantized folders are written and checked by mlx-lm")

BASE = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
            max_position_embeddings=256, rope_theta=1e6, tie_word_embeddings=False, sliding_window=None,
            eos_token_id=None, bos_token_id=None)
RECIPES = recipes()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    folder = save_hf_checkpoint(tmp_path_factory.mktemp("mixtral") / "hf", MixtralConfig, MixtralForCausalLM, BASE)
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hf_folder):
    return made_once(lambda recipe: convert(hf_folder, tmp_path_factory.mktemp(f"mixtral-{recipe}") / "mlx",
                                            RECIPES[recipe]))


def test_the_hub_layout_loads_and_computes_transformers_logits(hf_folder):
    from transformers import MixtralForCausalLM

    names = json.loads((hf_folder / "model.safetensors.index.json").read_text())["weight_map"] \
        if (hf_folder / "model.safetensors.index.json").exists() else None
    model, _ = moebench.load(hf_folder)
    assert model.args.model_type == "mixtral" and sorted(model.moe_blocks()) == [0, 1]
    assert names is None or any(".block_sparse_moe.experts.0.w1." in n for n in names)
    matches_transformers(hf_folder, MixtralForCausalLM, prompt(0, BASE["vocab_size"]))


@pytest.mark.parametrize("recipe", RECIPES)
def test_converted_folders_match_mlx_lm_and_run_fused(converted, recipe):
    converted_matches_and_runs_fused(converted(recipe), BASE["vocab_size"])


def test_make_random_writes_what_mlx_lm_loads(tmp_path):
    make_random_loads_in_mlx_lm(tmp_path / "m", "mixtral-tiny", BASE["vocab_size"])
