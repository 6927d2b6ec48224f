"""moebench.load(): layouts, mixed precision, shards with a progress bar, dtypes and the bits report."""

from __future__ import annotations

import gc
import json
import shutil
from collections import defaultdict

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import moebench
from moebench.checkpoint.config import model_args
from moebench.checkpoint.loader import ENV_MODEL, default_model_path
from moebench.checkpoint.tokenizer import Tokenizer
from moebench.checkpoint.weights import checkpoint_tensors, stacked_name
from moebench.tools.writer import qwen2_moe_config, random_tensors, save_checkpoint

TOKENS = mx.array([[5, 17, 200, 3, 99, 42, 7, 1]])


def logits(folder, **kwargs) -> np.ndarray:
    model, _ = moebench.load(folder, **kwargs)
    return np.array(model(TOKENS))


def test_load_returns_model_and_tokenizer(float_checkpoint):
    model, tok = moebench.load(float_checkpoint)
    assert isinstance(tok, Tokenizer)
    out = model(mx.concatenate([TOKENS, TOKENS[:, ::-1]]))
    assert out.shape == (2, 8, 256) and out.dtype == mx.float32
    # each batch row is computed on its own
    assert np.allclose(np.array(out[1]), np.array(model(TOKENS[:, ::-1])[0]), atol=1e-5)
    assert model.load_info.source == float_checkpoint
    assert set(model.load_info.bits.values()) == {"float float32"}


def test_no_tokenizer_is_not_an_error(make_checkpoint):
    _, tok = moebench.load(make_checkpoint())
    assert tok is None


def stack_float_experts(src, dst):
    """Copy a float per-expert checkpoint into the stacked switch_mlp layout."""
    tensors, stacks = {}, defaultdict(dict)
    for name, arr in mx.load(str(src / "model.safetensors")).items():
        expert = stacked_name(name)
        if expert:
            stacks[expert[0]][expert[1]] = arr
        else:
            tensors[name] = arr
    tensors.update({name: mx.stack([by_index[i] for i in sorted(by_index)]) for name, by_index in stacks.items()})
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    mx.save_safetensors(str(dst / "model.safetensors"), tensors)
    return dst


@pytest.mark.parametrize("bits", [None, 4])
def test_per_expert_and_stacked_layouts_give_bitwise_identical_logits(make_checkpoint, bits):
    a = make_checkpoint("per-expert", seed=3, bits=bits, layout="per-expert")
    if bits is None:  # the writer's float layout is HF's per-expert one
        b = stack_float_experts(a, a.parent / "stacked")
    else:
        b = make_checkpoint("stacked", seed=3, bits=bits, layout="stacked")
    assert any("switch_mlp" in n for n in mx.load(str(b / "model.safetensors")))
    assert not any("switch_mlp" in n for n in mx.load(str(a / "model.safetensors")))
    assert np.array_equal(logits(a), logits(b))


@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
def test_a_loaded_model_writes_back_its_own_checkpoint(quantized_checkpoint, tmp_path, layout):
    """checkpoint_tensors: the model's arrays under their checkpoint names, quantized parts included, in either
    layout; what it writes loads into the same model."""
    model, _ = moebench.load(quantized_checkpoint)
    config = json.loads((quantized_checkpoint / "config.json").read_text())
    folder = save_checkpoint(tmp_path / layout, config, checkpoint_tensors(model, layout))
    names = set(mx.load(str(folder / "model.safetensors")))
    assert ("model.layers.0.mlp.experts.7.down_proj.scales" in names) == (layout == "per-expert")
    assert ("model.layers.0.mlp.switch_mlp.down_proj.scales" in names) == (layout == "stacked")
    if layout == "per-expert":
        assert names == set(mx.load(str(quantized_checkpoint / "model.safetensors")))
    assert np.array_equal(logits(folder), np.array(model(TOKENS)))


def test_stacking_never_holds_two_copies_of_the_experts(make_checkpoint):
    cfg = qwen2_moe_config(num_experts=16, moe_intermediate_size=256, hidden_size=256, num_hidden_layers=4)
    folder = make_checkpoint(config=cfg)
    gc.collect()  # earlier tests' models (one that decoded waits for the cycle collector) must not count
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    model, _ = moebench.load(folder)
    params = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    layer_experts = sum(v.nbytes for _, v in tree_flatten(model.layers[0].mlp.switch_mlp.parameters()))
    assert layer_experts * 4 > params / 2  # experts dominate, so a second full copy would show
    assert mx.get_peak_memory() - before <= params + 1.5 * layer_experts


def test_mixed_precision_loads_each_tensor_at_its_width(make_checkpoint):
    def bits(name: str) -> int:
        return 8 if ".experts." in name and "down_proj" in name else 4

    folder = make_checkpoint(bits=bits)
    model, _ = moebench.load(folder)
    for block in model.moe_blocks().values():
        assert [getattr(block.switch_mlp, p).quant for p in ("gate_proj", "up_proj", "down_proj")] == [
            (64, 4, "affine"), (64, 4, "affine"), (64, 8, "affine")]
    report = model.load_info.bits
    assert report["mlp.switch_mlp.down_proj"] == "8-bit g64"
    assert report["mlp.switch_mlp.gate_proj"] == report["mlp.shared_expert.down_proj"] == "4-bit g64"
    assert {"embed_tokens", "lm_head", "mlp.gate", "self_attn.q_proj"} <= set(report)


def test_sharded_checkpoint_shows_progress_and_bits(make_checkpoint, capsys):
    single = make_checkpoint("single", seed=4, bits=8, group_size=32)
    sharded = make_checkpoint("sharded", seed=4, bits=8, group_size=32, shard_bytes=150_000)
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 2
    capsys.readouterr()
    model, _ = moebench.load(sharded, verbose=True)
    captured = capsys.readouterr()
    assert "loading shards" in captured.err and "100%" in captured.err
    assert f"loaded {sharded.name}: " in captured.out and "8-bit g32" in captured.out  # load_summary's one line
    assert np.array_equal(np.array(model(TOKENS)), logits(single, progress=False))
    assert "loading shards" not in capsys.readouterr().err  # one file: no bar unless asked


def test_activations_float32_on_cpu_for_a_half_precision_checkpoint(make_checkpoint):
    folder = make_checkpoint(bits=4, dtype=mx.float16)
    model, _ = moebench.load(folder)
    assert model.layers[0].mlp.switch_mlp.up_proj.scales.dtype == mx.float32
    assert model(TOKENS).dtype == mx.float32
    half, _ = moebench.load(folder, dtype=mx.float16)
    assert half.layers[0].mlp.switch_mlp.up_proj.scales.dtype == mx.float16
    assert half(TOKENS).dtype == mx.float16


def test_tied_quantized_embeddings(make_checkpoint):
    folder = make_checkpoint(config=qwen2_moe_config(tie_word_embeddings=True), bits=4)
    assert "lm_head.weight" not in mx.load(str(folder / "model.safetensors"))
    model, _ = moebench.load(folder)
    assert "lm_head" not in model
    h = model.model(TOKENS)
    table = model.model.embed_tokens
    w = mx.dequantize(table.weight, table.scales, table.biases, group_size=64, bits=4)
    assert np.abs(np.array(model(TOKENS)) - np.array(h @ w.T)).max() < 1e-4


def test_default_model_comes_from_the_environment(float_checkpoint, monkeypatch):
    monkeypatch.setenv(ENV_MODEL, str(float_checkpoint))
    assert default_model_path() == float_checkpoint
    model, _ = moebench.load()
    assert model.load_info.source == float_checkpoint


def test_bias_free_mode_checkpoint_matches_its_dequantized_float_twin(tmp_path):
    """An mxfp4 checkpoint (uint8 scales, no biases) computes what its dequantized weights compute."""
    cfg = qwen2_moe_config()
    quantized, dense = {}, {}
    for name, w in random_tensors(model_args(cfg), seed=6):
        if w.ndim == 2 and w.shape[-1] % 32 == 0:
            q, scales = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
            quantized.update({name: q, name.replace(".weight", ".scales"): scales})
            dense[name] = mx.dequantize(q, scales, None, group_size=32, bits=4, mode="mxfp4").astype(mx.float32)
        else:
            quantized[name] = dense[name] = w
    mode = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    q_folder = save_checkpoint(tmp_path / "mxfp4", {**cfg, "quantization": mode}, iter(quantized.items()))
    f_folder = save_checkpoint(tmp_path / "float", cfg, iter(dense.items()))
    model, _ = moebench.load(q_folder)
    assert set(model.load_info.bits.values()) == {"4-bit g32 mxfp4"}
    assert np.abs(np.array(model(TOKENS)) - logits(f_folder)).max() < 1e-4


def test_tied_embeddings_ignore_a_stored_lm_head_like_transformers(make_checkpoint):
    """With tie_word_embeddings, transformers and mlx-lm unembed with the embedding even when the file also
    holds an lm_head.weight: so does moebench, and the stray tensor is not an error."""
    folder = make_checkpoint(config=qwen2_moe_config(tie_word_embeddings=True))
    tensors = dict(mx.load(str(folder / "model.safetensors")))
    tensors["lm_head.weight"] = mx.ones_like(tensors["model.embed_tokens.weight"])
    mx.save_safetensors(str(folder / "model.safetensors"), tensors)
    model, _ = moebench.load(folder)
    assert "lm_head" not in model
    expected = model.model(TOKENS) @ model.model.embed_tokens.weight.T
    assert np.abs(np.array(model(TOKENS)) - np.array(expected)).max() < 1e-5
