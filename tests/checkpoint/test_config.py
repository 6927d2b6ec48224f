"""ModelArgs from config.json: every computation field, transformers 5's rope_parameters, quantization."""

from __future__ import annotations

import json

import pytest

from moebench.checkpoint.config import DEFAULT_ROPE_THETA, GenerationConfig, model_args, read_model_args
from moebench.errors import ConfigError
from moebench.models.args import QuantSpec
from moebench.tools.writer import qwen2_moe_config

REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "rms_norm_eps", "vocab_size")


def test_reads_every_computation_field():
    cfg = qwen2_moe_config(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True,
                           tie_word_embeddings=True, rope_theta=5e5, rms_norm_eps=1e-5, eos_token_id=[7, 9])
    args = model_args(cfg)
    assert (args.hidden_size, args.num_hidden_layers, args.vocab_size) == (128, 4, 256)
    assert (args.num_attention_heads, args.num_key_value_heads, args.head_dim) == (4, 2, 32)
    assert (args.num_experts, args.num_experts_per_tok) == (8, 2)
    assert (args.moe_intermediate_size, args.shared_expert_intermediate_size, args.intermediate_size) == (128, 256, 256)
    assert args.norm_topk_prob and args.tie_word_embeddings and args.qkv_bias
    assert (args.decoder_sparse_step, args.mlp_only_layers) == (2, (3,))
    assert (args.rope_theta, args.rms_norm_eps) == (5e5, 1e-5)
    assert args.eos_token_id == (7, 9)
    assert args.quantization is None


def test_moe_layer_rule_follows_sparse_step_and_mlp_only_layers():
    args = model_args(qwen2_moe_config(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [args.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    dense = model_args(qwen2_moe_config(num_experts=0, num_experts_per_tok=1))
    assert not any(dense.is_moe_layer(i) for i in range(dense.num_hidden_layers))


def test_rope_theta_under_rope_parameters_and_default():
    cfg = qwen2_moe_config()
    del cfg["rope_theta"]
    assert model_args(cfg).rope_theta == DEFAULT_ROPE_THETA
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 123456.0}
    assert model_args(cfg).rope_theta == 123456.0


def test_explicit_head_dim_and_defaults_for_optional_fields():
    cfg = qwen2_moe_config(head_dim=64)
    for key in ("num_key_value_heads", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                "tie_word_embeddings", "qkv_bias"):
        del cfg[key]
    args = model_args(cfg)
    assert args.head_dim == 64
    assert args.num_key_value_heads == args.num_attention_heads
    assert not args.norm_topk_prob and not args.tie_word_embeddings and args.qkv_bias
    assert (args.decoder_sparse_step, args.mlp_only_layers) == (1, ())


def test_null_optional_fields_take_their_defaults():
    nulls = dict.fromkeys(("num_key_value_heads", "shared_expert_intermediate_size", "norm_topk_prob",
                           "decoder_sparse_step", "mlp_only_layers", "tie_word_embeddings", "qkv_bias", "hidden_act",
                           "rope_scaling", "head_dim"))
    args = model_args(qwen2_moe_config(**nulls))
    assert (args.num_key_value_heads, args.shared_expert_intermediate_size, args.decoder_sparse_step) == (4, 0, 1)
    assert (args.norm_topk_prob, args.tie_word_embeddings, args.qkv_bias, args.mlp_only_layers) == (False, False,
                                                                                                    True, ())


def test_unknown_keys_are_ignored():
    args = model_args(qwen2_moe_config(some_future_field={"x": 1}, layer_types=["full_attention"] * 2))
    assert args == model_args(qwen2_moe_config())


@pytest.mark.parametrize("key", REQUIRED)
def test_missing_required_field_is_named(key):
    cfg = qwen2_moe_config()
    del cfg[key]
    with pytest.raises(ConfigError, match=f"'{key}'.*missing|missing.*'{key}'"):
        model_args(cfg, source="some/config.json")


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(hidden_size=0), "hidden_size"),
        (dict(hidden_size="128"), "hidden_size"),
        (dict(num_attention_heads=3), "num_key_value_heads"),
        (dict(hidden_size=130), "hidden_size"),
        (dict(head_dim=33), "head_dim"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(norm_topk_prob="yes"), "norm_topk_prob"),
        (dict(mlp_only_layers=[5]), "mlp_only_layers"),
        (dict(mlp_only_layers="0"), "mlp_only_layers"),
        (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
        (dict(rope_theta=True), "rope_theta"),
        (dict(vocab_size=2.5), "vocab_size"),
        (dict(eos_token_id="<|im_end|>"), "eos_token_id"),
        (dict(quantization={"group_size": 16, "bits": 4}), "group_size"),
        (dict(quantization={"group_size": 64, "bits": 7}), "bits"),
        (dict(quantization={"group_size": 64, "bits": 4, "mode": "int4"}), "mode"),
        (dict(quantization={"group_size": 64, "bits": 4, "mode": "mxfp4"}), "mxfp4"),
        (dict(quantization={"group_size": 64, "bits": "4"}), "bits"),
        (dict(quantization=[64, 4]), "quantization"),
        (dict(decoder_sparse_step=0), "decoder_sparse_step"),
        (dict(num_key_value_heads=0), "num_key_value_heads"),
        (dict(mlp_only_layers=""), "mlp_only_layers"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(use_sliding_window=True, sliding_window=4096), "use_sliding_window"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_parameters.*'yarn'"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling.*'linear'"),
    ],
)
def test_invalid_values_are_named(overrides, field):
    with pytest.raises(ConfigError, match=field):
        model_args(qwen2_moe_config(**overrides))


def test_quantization_block_with_per_module_overrides():
    block = {"group_size": 64, "bits": 4, "model.layers.0.mlp.switch_mlp.down_proj": {"bits": 8},
             "model.layers.0.mlp.gate": False, "model.embed_tokens": {"group_size": 32, "bits": 6}}
    q = model_args(qwen2_moe_config(quantization=block)).quantization
    assert q.for_module("model.layers.1.mlp.switch_mlp.down_proj") == QuantSpec(64, 4)
    assert q.for_module("model.layers.0.mlp.switch_mlp.down_proj") == QuantSpec(64, 8)
    assert q.for_module("model.layers.0.mlp.gate") is None
    assert q.for_module("model.embed_tokens") == QuantSpec(32, 6)
    mx_block = model_args(qwen2_moe_config(quantization={"group_size": 32, "bits": 4, "mode": "mxfp4"}))
    assert mx_block.quantization.default == QuantSpec(32, 4, "mxfp4")


def test_from_file_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        read_model_args(tmp_path / "config.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=str(bad)):
        read_model_args(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        read_model_args(bad)
    bad.write_text(json.dumps(qwen2_moe_config()))
    assert read_model_args(bad).hidden_size == 128


def test_mixed_recipe_null_group_size_is_the_mode_default():
    """mlx-lm 0.31+ writes `--quant-predicate mixed_3_6` entries with "group_size": null: MLX's affine default, 64."""
    block = {"group_size": 64, "bits": 4, "mode": "affine",
             "model.embed_tokens": {"group_size": None, "bits": 3, "mode": "affine"},
             "lm_head": {"group_size": None, "bits": 6, "mode": "affine"}}
    q = model_args(qwen2_moe_config(quantization=block)).quantization
    assert q.for_module("model.embed_tokens") == QuantSpec(64, 3)
    assert q.for_module("lm_head") == QuantSpec(64, 6)


def test_entries_never_inherit_the_top_level():
    """mlx-lm passes an entry to MLX's to_quantized as written: no mode is affine, no group size the mode's default."""
    block = {"group_size": 32, "bits": 4, "mode": "mxfp4", "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
             "model.layers.1.mlp.gate": {"bits": 8}, "model.layers.2.mlp.gate": {"mode": "mxfp8"}}
    q = model_args(qwen2_moe_config(quantization=block)).quantization
    assert q.default == QuantSpec(32, 4, "mxfp4")
    assert q.for_module("model.layers.0.mlp.gate") == QuantSpec(64, 8)
    assert q.for_module("model.layers.1.mlp.gate") == QuantSpec(64, 8)
    assert q.for_module("model.layers.2.mlp.gate") == QuantSpec(32, 8, "mxfp8")
    nulls = model_args(qwen2_moe_config(quantization={"group_size": None, "bits": None, "mode": "nvfp4"}))
    assert nulls.quantization.default == QuantSpec(16, 4, "nvfp4")


@pytest.mark.parametrize("flag", ["global_scale", "quantize_input"])
def test_entry_flags_moebench_cannot_compute_are_refused(flag):
    block = {"group_size": 16, "bits": 4, "mode": "nvfp4", "model.layers.0.mlp.switch_mlp.up_proj": {
        "group_size": 16, "bits": 4, "mode": "nvfp4", flag: True}}
    with pytest.raises(ConfigError, match=rf"quantization\['model.layers.0.mlp.switch_mlp.up_proj'\].{flag}"):
        model_args(qwen2_moe_config(quantization=block), source="c/config.json")


def test_stop_ids_are_config_and_generation_config_together(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(qwen2_moe_config(eos_token_id=151645)))
    assert read_model_args(tmp_path / "config.json").eos_token_id == (151645,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert read_model_args(tmp_path / "config.json").eos_token_id == (151645, 151643)


def test_generation_config_sampling_settings(tmp_path):
    path = tmp_path / "generation_config.json"
    assert GenerationConfig.from_file(path) == GenerationConfig()
    path.write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                "repetition_penalty": 1.05, "eos_token_id": [151645, 151643], "bos_token_id": 1}))
    assert GenerationConfig.from_file(path) == GenerationConfig((151645, 151643), True, 0.7, 0.8, 20, 1.05)


@pytest.mark.parametrize("field,value", [("top_k", 2.5), ("top_k", -1), ("top_p", 0), ("temperature", "hot"),
                                         ("repetition_penalty", 0), ("do_sample", 1), ("eos_token_id", "2"),
                                         ("eos_token_id", [1, True])])
def test_bad_generation_config_field_is_named(tmp_path, field, value):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({field: value}))
    with pytest.raises(ConfigError, match=rf"{path}.*'{field}'"):
        GenerationConfig.from_file(path)
    (tmp_path / "config.json").write_text(json.dumps(qwen2_moe_config()))
    with pytest.raises(ConfigError, match=str(path)):
        read_model_args(tmp_path / "config.json")
