"""The Qwen3-MoE family on the shared SwitchGLU, loader, routing and kernel dispatch: parity with HF
transformers' Qwen3MoeForCausalLM (float32) and with mlx-lm's qwen3_moe (quantized)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from hf_reference import save_hf_checkpoint

import moebench
from moebench.decode.loop import generate
from moebench.models import qwen3_moe
from moebench.tools.writer import quantize_tensors, save_checkpoint, write_random_checkpoint

TOLERANCE = 1e-4
BASE = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, intermediate_size=256, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=8,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
            tie_word_embeddings=False, rope_theta=1e6)
CONFIGS = {
    "gqa-normtopk": {},
    "mha-no-renorm-tied": dict(num_key_value_heads=4, norm_topk_prob=False, tie_word_embeddings=True),
    "sparse-step2-mlp-only": dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]),
}


def _hf_folder(tmp_path, overrides: dict, seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return save_hf_checkpoint(tmp_path / "hf", Qwen3MoeConfig, Qwen3MoeForCausalLM, {**BASE, **overrides}, seed)


def _prompt(seed: int, n: int = 16) -> list[int]:
    return np.random.default_rng(seed).integers(0, BASE["vocab_size"], n).tolist()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_greedy_match_hf(tmp_path, name):
    import torch
    from transformers import Qwen3MoeForCausalLM

    folder = _hf_folder(tmp_path, CONFIGS[name])
    hf = Qwen3MoeForCausalLM.from_pretrained(folder, dtype="float32").eval()
    ours, _ = moebench.load(folder)
    assert not any("shared_expert" in b for b in ours.moe_blocks().values())
    expected_moe = [i for i in range(ours.args.num_hidden_layers) if ours.args.is_moe_layer(i)]
    assert sorted(ours.moe_blocks()) == expected_moe and expected_moe
    ids = _prompt(0)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits.numpy()
        tokens = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                             pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
    assert np.abs(np.array(ours(mx.array([ids]))) - expected).max() <= TOLERANCE
    assert generate(ours, ids, 32).token_ids == tokens


def _quantized_folder(tmp_path, bits: int, group_size: int):
    """HF's float checkpoint, quantized by moebench.tools.writer in MLX's stacked layout (mlx-lm's qwen3_moe stacks
    only unquantized per-expert weights)."""
    src = _hf_folder(tmp_path, {}, seed=bits)
    config = json.loads((src / "config.json").read_text())
    config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    # mlx-lm's qwen3_moe reads the transformers-4 names; transformers 5 writes these two differently
    config["num_experts"] = config["num_local_experts"]
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    tensors = mx.load(str(src / "model.safetensors"))
    quantized = quantize_tensors(iter(sorted(tensors.items())), group_size, bits, "stacked", config["num_experts"])
    return save_checkpoint(tmp_path / "q", config, quantized)


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32)])
def test_quantized_logits_match_mlx_lm(tmp_path, bits, group_size):
    from mlx_lm.utils import load_model

    folder = _quantized_folder(tmp_path, bits, group_size)
    reference, _ = load_model(folder)
    ours, _ = moebench.load(folder)
    ids = _prompt(1)
    with moebench.fused_moe(False):
        got = np.array(ours(mx.array([ids])))
    assert np.abs(got - np.array(reference(mx.array([ids])))).max() <= TOLERANCE


def test_fused_kernel_dispatches_with_top8(tmp_path):
    folder = _quantized_folder(tmp_path, 4, 64)
    ours, _ = moebench.load(folder)
    ids = _prompt(2)
    with moebench.fused_moe(True):
        fused = generate(ours, ids, 8)
    counts = moebench.dispatch(ours)["moe"]
    assert sorted(counts) == sorted(ours.moe_blocks())
    assert all(sum(c["fused"].values()) == 7 and c["fallback"] == 1 for c in counts.values())  # prefill falls back
    with moebench.fused_moe(False):
        fallback = generate(ours, ids, 8)
    assert fused.token_ids == fallback.token_ids


def test_writer_layout_is_transformers_layout(tmp_path):
    """moebench.tools.writer (make-random, tests) writes exactly the tensors transformers saves for Qwen3-MoE."""
    from safetensors import safe_open

    hf = _hf_folder(tmp_path, {})
    config = json.loads((hf / "config.json").read_text())
    ours = write_random_checkpoint(tmp_path / "ours", config)
    with safe_open(hf / "model.safetensors", "np") as a, safe_open(ours / "model.safetensors", "np") as b:
        assert {k: a.get_slice(k).get_shape() for k in a.keys()} == {k: b.get_slice(k).get_shape() for k in b.keys()}
    model, _ = moebench.load(ours)
    assert isinstance(model.layers[0].self_attn, qwen3_moe.Attention)
