"""make-random and the model-size presets: exact real-model configs, streamed sharded random checkpoints."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest

from moebench import fused_moe, load
from moebench.checkpoint.config import model_args
from moebench.checkpoint.files import checkpoint_files, read_safetensors_header
from moebench.checkpoint.weights import tensor_shapes
from moebench.cli import main
from moebench.errors import ConfigError
from moebench.execution.support import moe_reason
from moebench.tools.presets import PRESETS, cut_to, default_layout, get_preset, parameter_counts, write_random
from moebench.tools.writer import random_tensors


def test_a27b_preset_is_qwen15_moe_a27b():
    args = model_args(get_preset("qwen1.5-moe-a2.7b").config)
    assert (args.hidden_size, args.num_hidden_layers, args.num_attention_heads, args.num_key_value_heads,
            args.head_dim) == (2048, 24, 16, 16, 128)
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
            args.shared_expert_intermediate_size, args.intermediate_size) == (60, 4, 1408, 5632, 5632)
    assert (args.vocab_size, args.rope_theta, args.rms_norm_eps) == (151936, 1e6, 1e-6)
    assert not args.norm_topk_prob and not args.tie_word_embeddings and args.qkv_bias
    assert all(args.is_moe_layer(i) for i in range(24))
    total, active = parameter_counts(get_preset("qwen1.5-moe-a2.7b").config)
    assert round(total / 1e9, 1) == 14.3 and round(active / 1e9, 1) == 2.7  # the model card's figures


def test_qwen3_preset_is_config_only():
    cfg = get_preset("qwen3-30b-a3b").config
    assert (cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"], cfg["num_experts_per_tok"],
            cfg["num_hidden_layers"], cfg["norm_topk_prob"]) == (2048, 768, 128, 8, 48, True)


@pytest.mark.parametrize(("preset", "shape", "published"), [
    ("qwen3-235b-a22b", (4096, 94, 64, 4, 128, 128, 8, 1536, 0), (235, 22)),
    ("qwen2-57b-a14b", (3584, 28, 28, 4, 128, 64, 8, 2560, 20480), (57, 14)),
])
def test_the_presets_past_one_device_are_the_published_models(preset, shape, published):
    args = model_args(get_preset(preset).config)
    assert (args.hidden_size, args.num_hidden_layers, args.num_attention_heads, args.num_key_value_heads,
            args.head_dim, args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
            args.shared_expert_intermediate_size) == shape
    total, active = parameter_counts(get_preset(preset).config)
    assert (int(total / 1e9), int(active / 1e9)) == published  # the names' figures: 235B total, 22B active


def test_olmoe_preset_is_olmoe_1b_7b():
    """OLMoE-1B-7B as transformers' OlmoeConfig writes it (intermediate_size is the expert width), checked by shape
    only: the real-size model is never materialised."""
    cfg = get_preset("olmoe-1b-7b").config
    assert (cfg["model_type"], cfg["architectures"]) == ("olmoe", ["OlmoeForCausalLM"])
    assert "moe_intermediate_size" not in cfg and "shared_expert_intermediate_size" not in cfg
    assert (cfg["intermediate_size"], cfg["clip_qkv"], cfg["attention_bias"]) == (1024, None, False)
    args = model_args(cfg)
    assert (args.hidden_size, args.num_hidden_layers, args.num_attention_heads, args.num_key_value_heads,
            args.head_dim) == (2048, 16, 16, 16, 128)
    assert (args.num_experts, args.num_experts_per_tok, args.shared_expert_intermediate_size) == (64, 8, 0)
    assert (args.vocab_size, args.rope_theta, args.rms_norm_eps, args.max_position_embeddings) == (
        50304, 10000.0, 1e-5, 4096)
    assert not args.norm_topk_prob and not args.tie_word_embeddings and not args.qkv_bias
    assert all(args.is_moe_layer(i) for i in range(16))
    shapes = dict(tensor_shapes(args))
    assert shapes["model.layers.0.mlp.experts.63.gate_proj.weight"] == (1024, 2048)  # the expert width
    assert shapes["model.layers.0.mlp.experts.0.down_proj.weight"] == (2048, 1024)
    assert shapes["model.layers.15.mlp.gate.weight"] == (64, 2048)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (2048,)  # over the whole projection, not per head
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (2048,)
    assert shapes["lm_head.weight"] == (50304, 2048)
    assert not any("shared_expert" in name for name in shapes)
    total, active = parameter_counts(cfg)
    assert round(total / 1e9, 1) == 6.9 and round(active / 1e9, 1) == 1.3  # the model card's 6.9B, 1.3B active
    assert default_layout("olmoe-1b-7b") == default_layout("olmoe-tiny") == "stacked"  # as mlx-lm converts OLMoE


def test_make_random_refuses_bad_input(tmp_path, capsys):
    with pytest.raises(Exception, match="unknown preset 'nope'"):
        get_preset("nope")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("keep me")
    assert main(["make-random", str(full), "--preset", "tiny"]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    with pytest.raises(Exception, match="layout 'flat'"):
        write_random(tmp_path / "new", "tiny", layout="flat")


def expected_tensors(config: dict, bits: int, group_size: int, dtype: str) -> dict[str, tuple[tuple, str]]:
    """What a per-expert MLX affine checkpoint of `config` holds: name -> (shape, safetensors dtype)."""
    out = {}
    float_dtype = {"float32": "F32", "bfloat16": "BF16"}[dtype]
    for name, shape in tensor_shapes(model_args(config)):
        if len(shape) == 2 and shape[1] % group_size == 0:
            base = name.removesuffix(".weight")
            out[f"{base}.weight"] = ((shape[0], shape[1] * bits // 32), "U32")
            out[f"{base}.scales"] = ((shape[0], shape[1] // group_size), float_dtype)
            out[f"{base}.biases"] = ((shape[0], shape[1] // group_size), float_dtype)
        else:
            out[name] = (shape, float_dtype)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_make_random_writes_a_loadable_sharded_checkpoint_with_the_presets_tensors(tmp_path, dtype, capsys):
    folder = tmp_path / "tiny"
    assert main(["make-random", str(folder), "--preset", "tiny", "--bits", "4", "--group-size", "64",
                 "--dtype", dtype, "--shard-gb", "0.0003"]) == 0
    assert "experts per-expert (mlp.experts.{i}.*)" in capsys.readouterr().out
    files = checkpoint_files(folder)
    assert len(files) > 1 and (folder / "model.safetensors.index.json").exists()
    found = {}
    for f in files:
        for name, info in read_safetensors_header(f).items():
            found[name] = (tuple(info["shape"]), info["dtype"])
    assert found == expected_tensors(PRESETS["tiny"].config, 4, 64, dtype)
    assert any(".mlp.experts.7.down_proj.scales" in n for n in found)  # per-expert layout, like MLX conversions
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    model, tokenizer = load(folder)
    assert tokenizer.id_count == 256 and tokenizer.decode(tokenizer.encode("x = 1")) == "x = 1"
    assert model.load_info.bits["mlp.switch_mlp.down_proj"] == "4-bit g64"
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, 256) and bool(mx.all(mx.isfinite(logits)))


def test_gpt_oss_preset_is_gpt_oss_20b():
    """gpt-oss-20b as its config.json writes it, checked by shape only; the tiny preset keeps every gpt-oss part."""
    from moebench.models.gpt_oss import Model

    cfg = get_preset("gpt-oss-20b").config
    assert (cfg["model_type"], cfg["architectures"]) == ("gpt_oss", ["GptOssForCausalLM"])
    args = model_args(cfg)
    assert (args.hidden_size, args.num_hidden_layers, args.num_attention_heads, args.num_key_value_heads,
            args.head_dim) == (2880, 24, 64, 8, 64)
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size, args.vocab_size) == (
        32, 4, 2880, 201088)
    assert args.layer_types == ("sliding_attention", "full_attention") * 12 and args.sliding_window == 128
    assert (args.rope_theta, args.rope_scaling.factor, args.rope_scaling.truncate) == (150000.0, 32.0, False)
    assert (args.swiglu_limit, args.swiglu_alpha, args.qkv_bias) == (7.0, 1.702, True)
    shapes = dict(tensor_shapes(args, "stacked"))
    assert shapes["model.layers.0.mlp.switch_mlp.gate_proj.weight"] == (32, 2880, 2880)
    assert shapes["model.layers.0.mlp.switch_mlp.down_proj.bias"] == (32, 2880)
    assert shapes["model.layers.23.mlp.gate.bias"] == (32,)
    assert shapes["model.layers.0.self_attn.sinks"] == (64,)
    assert shapes["model.layers.0.self_attn.o_proj.bias"] == (2880,)
    total, active = parameter_counts(cfg)
    assert round(total / 1e9, 1) == 20.9  # the model card's 21B, and its 3.6B active: the input embedding left out
    assert round((active - 201088 * 2880) / 1e9, 1) == 3.6
    windows = [layer.self_attn.window for layer in Model(model_args(get_preset("gpt-oss-tiny").config)).layers]
    assert windows == [4, None]


def test_make_random_gpt_oss_tiny_is_mlx_lms_layout_and_mlx_lm_computes_what_moebench_does(tmp_path, capsys):
    """gpt-oss as mlx-lm's convert writes it (and mlx-community publishes it): mlp.router in 8-bit groups of 64,
    the experts stacked at mlp.experts.* in mxfp4 (uint8 e8m0 scales, no affine biases) with float biases, the rest
    at the bits asked for, each named in config.json. mlx-lm and moebench load the folder; their float32 logits
    agree within 1e-4 over a prompt past the window. mlx-lm 0.32 always truncates YaRN's correction range (the
    family's tests say so), so the comparison reads the folder with `truncate: true`, which moebench honours."""
    from mlx_lm.utils import load_model

    folder = tmp_path / "gpt-oss"
    assert main(["make-random", str(folder), "--preset", "gpt-oss-tiny", "--dtype", "float32", "--group-size", "32",
                 "--generator", "numpy"]) == 0
    assert "mlp.experts.{gate,up,down}_proj.* in mxfp4" in capsys.readouterr().out
    header = read_safetensors_header(folder / "model.safetensors")
    names = set(header)
    assert not any(".switch_mlp." in n or ".mlp.gate." in n for n in names)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        base = f"model.layers.1.mlp.experts.{proj}"
        assert (header[f"{base}.weight"]["dtype"], header[f"{base}.scales"]["dtype"]) == ("U32", "U8")
        assert header[f"{base}.weight"]["shape"] == [8, 128, 16] and header[f"{base}.bias"]["shape"] == [8, 128]
        assert f"{base}.biases" not in names
    assert {"model.layers.0.mlp.router.weight", "model.layers.0.mlp.router.biases"} <= names
    quantization = json.loads((folder / "config.json").read_text())["quantization"]
    assert quantization["model.layers.0.mlp.experts.down_proj"] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    assert quantization["model.layers.1.mlp.router"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    ours, _ = load(folder)
    assert ours.args.model_type == "gpt_oss"
    assert ours.load_info.bits["mlp.switch_mlp.down_proj"] == "4-bit g32 mxfp4"
    assert ours.load_info.bits["mlp.gate"] == "8-bit g64" and ours.load_info.bits["self_attn.q_proj"] == "4-bit g32"

    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"]["truncate"] = True
    (folder / "config.json").write_text(json.dumps(config))
    ids = mx.array([[1, 5, 9, 200, 3, 7, 42, 0, 11, 12]])  # past the window of 4
    reference, _ = load_model(folder)
    truncated, _ = load(folder)
    expected = np.array(reference(ids))
    got, untruncated = np.array(truncated(ids)), np.array(ours(ids))
    assert got.dtype == np.float32 and np.abs(expected).max() > 0.5
    assert np.abs(got - expected).max() <= 1e-4
    assert np.abs(untruncated - expected).max() > 1e-4  # the setting reaches moebench's YaRN


def test_gpt_oss_is_written_stacked_only(tmp_path):
    with pytest.raises(ConfigError, match="layout 'per-expert': gpt-oss checkpoints stack their experts"):
        write_random(tmp_path / "per-expert", "gpt-oss-tiny", progress=False, layout="per-expert")
    assert not (tmp_path / "per-expert").exists()


@pytest.mark.parametrize("preset,layout,stacked", [("qwen3-tiny", None, True), ("tiny", None, False),
                                                   ("tiny", "stacked", True), ("olmoe-tiny", None, True)])
def test_make_random_writes_the_familys_mlx_layout_and_mlx_lm_computes_what_moebench_does(
        tmp_path, capsys, preset, layout, stacked):
    """By default as the family's MLX checkpoints (mlx-lm convert stacks Qwen3-MoE's experts, mlx-community's
    Qwen1.5-MoE keeps them per expert): mlx-lm loads the folder and its float32 logits are moebench's."""
    from mlx_lm.utils import load_model

    folder = tmp_path / preset
    chosen = ["--layout", layout] if layout else []
    assert main(["make-random", str(folder), "--preset", preset, "--dtype", "float32", *chosen]) == 0
    printed = "experts stacked (mlp.switch_mlp.*)" if stacked else "experts per-expert (mlp.experts.{i}.*)"
    assert printed in capsys.readouterr().out
    names = set(read_safetensors_header(folder / "model.safetensors"))
    assert ("model.layers.1.mlp.switch_mlp.down_proj.weight" in names) == stacked
    assert any(".mlp.experts." in n for n in names) != stacked
    ours, _ = load(folder)
    assert ours.args.model_type == get_preset(preset).config["model_type"]
    reference, _ = load_model(folder)
    ids = mx.array([[1, 5, 9, 200, 3, 7, 42, 0]])
    with fused_moe(False, ours):
        got = np.array(ours(ids))
    assert got.dtype == np.float32 and np.abs(got - np.array(reference(ids))).max() <= 1e-5


@pytest.mark.parametrize("mode,bits,group_size", [("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)])
def test_make_random_in_a_microscaled_mode_is_what_mlx_lm_convert_writes_and_runs_fused(
        tmp_path, capsys, mode, bits, group_size):
    """--mode writes every quantized weight in the mode (uint8 scales, no biases), as `mlx_lm.convert --q-mode`
    does: mlx-lm loads it and computes moebench's logits, and moebench's fused kernels read its experts."""
    from mlx_lm.utils import load_model

    folder = tmp_path / mode
    assert main(["make-random", str(folder), "--preset", "qwen3-tiny", "--dtype", "float32", "--mode", mode]) == 0
    assert f"{mode} ({bits}-bit g{group_size})" in capsys.readouterr().out
    assert json.loads((folder / "config.json").read_text())["quantization"] == {
        "group_size": group_size, "bits": bits, "mode": mode}
    header = read_safetensors_header(folder / "model.safetensors")
    assert header["model.layers.0.mlp.switch_mlp.up_proj.scales"]["dtype"] == "U8"
    assert not any(name.endswith(".biases") for name in header)
    ours, _ = load(folder)
    ids = mx.array([[1, 5, 9, 200, 3, 7, 42, 0]])
    with fused_moe(False, ours):
        got = np.array(ours(ids))
    assert np.abs(got - np.array(load_model(folder)[0](ids))).max() <= 1e-5
    for block in ours.moe_blocks().values():
        assert {p.mode for p in block.switch_mlp.quantized_parts()} == {mode}
        assert moe_reason(block.spec, block.switch_mlp.quantized_parts(), "reference") is None


def test_make_random_mode_for_gpt_oss_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="gpt-oss presets write their experts in mxfp4"):
        write_random(tmp_path / "g", "gpt-oss-tiny", progress=False, mode="nvfp4")
    assert not (tmp_path / "g").exists()


def test_both_layouts_of_one_seed_are_one_model(tmp_path):
    folders = {layout: write_random(tmp_path / layout, "qwen3-tiny", dtype="float32", progress=False, layout=layout)
               for layout in ("stacked", "per-expert")}
    ids = mx.array([[3, 1, 4, 1, 5, 9]])
    logits = [np.array(load(f)[0](ids)) for f in folders.values()]
    assert np.array_equal(*logits)


def test_write_random_streams_one_tensor_at_a_time(tmp_path, monkeypatch):
    """The random tensors are produced lazily and consumed before the next one is drawn."""
    import moebench.tools.presets as presets

    drawn, live = [], []

    def spy(args, seed, dtype, generator):
        for name, value in random_tensors(args, seed, dtype, generator):
            drawn.append(name)
            live.append(len(set(drawn) - set(saved)))  # quantized outputs keep the input's .weight name
            yield name, value

    saved: list[str] = []
    real_save = presets.save_checkpoint

    def save(folder, config, tensors, shard_bytes):
        def counted():
            for name, value in tensors:
                saved.append(name)
                yield name, value
        return real_save(folder, config, counted(), shard_bytes)

    monkeypatch.setattr(presets, "random_tensors", spy)
    monkeypatch.setattr(presets, "save_checkpoint", save)
    write_random(tmp_path / "t", "tiny", progress=False)
    assert len(drawn) == sum(1 for _ in tensor_shapes(model_args(PRESETS["tiny"].config)))
    assert max(live) == 1  # only the tensor just drawn is not yet in the checkpoint


def test_mlx_generator_matches_numpy_generator_statistics():
    args = model_args(get_preset("small").config)
    by_gen = {g: dict(random_tensors(args, seed=3, generator=g)) for g in ("numpy", "mlx")}
    for name, shape in (("model.layers.0.self_attn.q_proj.weight", (256, 256)),
                        ("model.layers.0.input_layernorm.weight", (256,))):
        a, b = (np.array(by_gen[g][name]) for g in ("numpy", "mlx"))
        assert a.shape == b.shape == shape and not np.array_equal(a, b)
        assert abs(a.mean() - b.mean()) < 0.02 and abs(a.std() - b.std()) < 0.1 * a.std()
    q = np.array(by_gen["mlx"]["model.layers.0.self_attn.q_proj.weight"])
    assert math.isclose(q.std(), 1 / 16, rel_tol=0.05)


@pytest.mark.parametrize("seed", [-1, 2**64, True, 1.0])
def test_a_seed_numpy_and_mlx_cannot_take_is_named_before_a_file_is_written(tmp_path, seed):
    from moebench.errors import DecodeError
    from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

    with pytest.raises(DecodeError, match="seed must be an integer from 0 to 2"):
        write_random(tmp_path / "preset", "tiny", seed=seed, progress=False)
    with pytest.raises(DecodeError, match="seed must be an integer from 0 to 2"):
        write_random_checkpoint(tmp_path / "ckpt", qwen2_moe_config(), seed=seed)
    assert not (tmp_path / "preset").exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("shard_gb", [0, -1, float("inf"), float("nan")])
def test_a_shard_size_that_is_not_a_positive_number_is_named(tmp_path, shard_gb):
    with pytest.raises(ConfigError, match=r"shard size \(GB\) must be a finite number above 0"):
        write_random(tmp_path / "preset", "tiny", shard_gb=shard_gb, progress=False)


@pytest.mark.parametrize("preset,layers", [("glm-4.5-air", 36), ("deepseek-v3", 10), ("gpt-oss-20b", 5),
                                           ("qwen3-next-80b-a3b", 6), ("qwen3.5-35b-a3b", 3)])
def test_a_preset_cut_to_fewer_layers_keeps_each_layers_shapes(preset, layers):
    """A model cut to fit a machine (make-random --layers): its first layers, tensor for tensor, are the whole
    model's, so a decode step costs per layer what the whole model's does."""
    whole = PRESETS[preset].config
    cut = cut_to(whole, layers, preset)
    shapes = dict(tensor_shapes(model_args(cut)))
    whole_shapes = dict(tensor_shapes(model_args(whole)))
    assert {k: v for k, v in whole_shapes.items() if not k.startswith("model.layers.") or
            int(k.split(".")[2]) < layers} == shapes
    assert model_args(cut).num_hidden_layers == layers and cut_to(whole, None, preset) is whole


def test_make_random_layers_writes_the_first_layers_and_refuses_a_count_the_preset_lacks(tmp_path, capsys):
    folder = tmp_path / "glm"
    assert main(["make-random", str(folder), "--preset", "glm4-moe-tiny", "--layers", "2", "--dtype", "float32",
                 "--generator", "numpy"]) == 0
    assert "wrote" in capsys.readouterr().out
    model, _ = load(folder)
    assert len(model.layers) == 2 and sorted(model.moe_blocks()) == [1]  # layer 0 dense, as in the whole preset
    for bad in ("0", "4"):
        assert main(["make-random", str(tmp_path / f"bad{bad}"), "--preset", "glm4-moe-tiny", "--layers", bad]) == 2
        assert f"layers {bad}: preset glm4-moe-tiny has 3 decoder layers; keep 1 to 3" in capsys.readouterr().err
        assert not (tmp_path / f"bad{bad}").exists()
