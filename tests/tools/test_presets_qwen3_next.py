"""The hybrid presets: Qwen3-Next-80B-A3B and Qwen3.5-35B-A3B as their config.json write them (checked by shape
and parameter count), and make-random's tiny hybrids in mlx-lm's layout, which mlx-lm computes as moebench does."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from moebench import fused_moe, load
from moebench.checkpoint.config import model_args
from moebench.checkpoint.files import read_safetensors_header
from moebench.checkpoint.weights import tensor_shapes
from moebench.cli import main
from moebench.tools.presets import default_layout, get_preset, parameter_counts

HYBRID = ("linear_attention",) * 3 + ("full_attention",)


@pytest.mark.parametrize("preset,model_type,layers,experts,top_k,vocab,billions", [
    ("qwen3-next-80b-a3b", "qwen3_next", 48, 512, 10, 151936, (79.7, 3.9)),
    ("qwen3.5-35b-a3b", "qwen3_5_moe", 40, 256, 8, 248320, (34.7, 3.5)),
])
def test_hybrid_presets_are_the_published_models(preset, model_type, layers, experts, top_k, vocab, billions):
    cfg = get_preset(preset).config
    args = model_args(cfg)
    assert args.model_type == model_type and default_layout(preset) == "stacked"
    assert (args.hidden_size, args.num_hidden_layers, args.num_attention_heads, args.num_key_value_heads,
            args.head_dim) == (2048, layers, 16, 2, 256)
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
            args.shared_expert_intermediate_size, args.vocab_size) == (experts, top_k, 512, 512, vocab)
    assert args.layer_types == HYBRID * (layers // 4) and args.norm_topk_prob
    assert (args.linear_num_key_heads, args.linear_num_value_heads, args.linear_key_head_dim,
            args.linear_value_head_dim, args.linear_conv_kernel_dim) == (16, 32, 128, 128, 4)
    assert (args.rope_theta, args.partial_rotary_factor, args.max_position_embeddings) == (1e7, 0.25, 262144)
    shapes = dict(tensor_shapes(args, "stacked"))
    assert shapes["model.layers.3.self_attn.q_proj.weight"] == (2 * 16 * 256, 2048)  # queries and the output gate
    assert shapes["model.layers.0.linear_attn.conv1d.weight"] == (2 * 16 * 128 + 32 * 128, 4, 1)
    assert shapes["model.layers.0.mlp.switch_mlp.gate_proj.weight"] == (experts, 512, 2048)
    assert shapes["model.layers.0.mlp.shared_expert_gate.weight"] == (1, 2048)
    total, active = parameter_counts(cfg)
    assert (round(total / 1e9, 1), round(active / 1e9, 1)) == billions


@pytest.mark.parametrize("preset,projection", [("qwen3-next-tiny", "in_proj_qkvz"),
                                               ("qwen3.5-moe-tiny", "in_proj_qkv")])
def test_make_random_tiny_hybrids_are_mlx_lms_layout_and_mlx_lm_computes_what_moebench_does(
        tmp_path, capsys, preset, projection):
    from mlx_lm.utils import load_model

    folder = tmp_path / preset
    assert main(["make-random", str(folder), "--preset", preset, "--dtype", "float32"]) == 0
    assert "experts stacked (mlp.switch_mlp.*)" in capsys.readouterr().out
    names = set(read_safetensors_header(folder / "model.safetensors"))
    assert f"model.layers.0.linear_attn.{projection}.weight" in names
    ours, _ = load(folder)
    assert ours.args.layer_types == HYBRID
    reference, _ = load_model(folder)
    ids = mx.array([[1, 5, 9, 200, 3, 7, 42, 0]])
    with fused_moe(False, ours):
        got = np.array(ours(ids))
    assert got.dtype == np.float32 and np.abs(got - np.array(reference(ids))).max() <= 1e-5
