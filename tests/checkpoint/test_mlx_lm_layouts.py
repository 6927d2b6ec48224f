"""Every layout `mlx_lm.convert` writes for the two families loads in moebench and computes mlx-lm's logits.

The folders come from outside moebench: transformers builds a tiny Qwen2-MoE / Qwen3-MoE and saves it
(safetensors, per-expert HF layout), then mlx-lm's own `convert` quantizes it with each recipe (plain
affine at every width and group size, the mixed recipes whose per-module entries carry `"group_size":
null`, mxfp4 / mxfp8 / nvfp4, and no quantization at all). moebench's float32 logits on a short sequence
must match mlx-lm's on the same folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from byte_tokenizer import write_byte_tokenizer

import moebench

pytest.importorskip("torch", reason="the HF float folders are written by transformers (dev dependency torch)")
pytest.importorskip("transformers", reason="the HF float folders are written by transformers")
pytest.importorskip("mlx_lm", reason="the layouts are written and checked by mlx-lm")

TOKENS = [1, 17, 200, 5, 99, 42, 7, 128]
TOLERANCE = 1e-4
# The vocabulary is larger than the byte tokenizer's 256 ids plus the eos token transformers adds when mlx-lm
# saves it (published Qwen checkpoints pad theirs too). Every group size (32/64/128) divides every input width,
# except under Qwen3's experts: their width 64 leaves down_proj float at group 128 (mlx-lm skips a module whose
# input width does not divide), one more layout moebench must read.
COMMON = dict(vocab_size=320, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts=8, num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              tie_word_embeddings=False, intermediate_size=128)
FAMILIES = {
    "qwen2_moe": dict(moe_intermediate_size=128, shared_expert_intermediate_size=128),
    "qwen3_moe": dict(moe_intermediate_size=64, head_dim=32, norm_topk_prob=True),
}
AFFINE = {f"affine-{bits}bit-g{group}": dict(q_bits=bits, q_group_size=group)
          for bits in (4, 6, 8) for group in (32, 64, 128)}
RECIPES = {
    "float": {},
    **AFFINE,
    **{f"affine-{bits}bit-g64": dict(q_bits=bits, q_group_size=64) for bits in (2, 3, 5)},
    **{recipe: dict(quant_predicate=recipe) for recipe in ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")},
    "mixed_3_6-g32": dict(quant_predicate="mixed_3_6", q_group_size=32),
    **{mode: dict(q_mode=mode) for mode in ("mxfp4", "mxfp8", "nvfp4")},
}


def write_hf_folder(folder: Path, family: str) -> Path:
    """A random float32 model saved by transformers, its config.json in the published form.

    transformers 5 writes RoPE's theta under `rope_parameters` and Qwen3's expert count as
    `num_local_experts`; the published Qwen config.json files (and mlx-lm 0.32's reader) have top-level
    `rope_theta` and `num_experts`, so both are added.
    """
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config_cls, model_cls = {"qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
                             "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}[family]
    torch.manual_seed(0)
    model_cls(config_cls(**COMMON, **FAMILIES[family], rope_theta=1e6)).to(torch.float32).save_pretrained(folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["rope_theta"] = 1e6
    config["num_experts"] = COMMON["num_experts"]
    path.write_text(json.dumps(config, indent=2))
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """hf_folder(family) -> the family's transformers-saved float folder (made once, read-only)."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = write_hf_folder(tmp_path_factory.mktemp(family) / "hf", family)
        return made[family]

    return get


@pytest.fixture(scope="session")
def converted(tmp_path_factory, hf_folder):
    """converted(family, recipe) -> the folder `mlx_lm.convert` wrote with that recipe (made once, read-only)."""
    from mlx_lm.convert import convert

    made: dict[tuple[str, str], Path] = {}

    def get(family: str, recipe: str) -> Path:
        if (family, recipe) not in made:
            out = tmp_path_factory.mktemp(f"{family}-{recipe}") / "mlx"
            kwargs = RECIPES[recipe]
            convert(str(hf_folder(family)), str(out), quantize=bool(kwargs), **kwargs)
            made[family, recipe] = out
        return made[family, recipe]

    return get


def mlx_lm_logits(folder: Path) -> mx.array:
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    return model(mx.array([TOKENS])).astype(mx.float32)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_converted_folder_matches_mlx_lm(converted, family, recipe):
    folder = converted(family, recipe)
    model, tokenizer = moebench.load(folder, dtype=mx.float32)
    logits = model(mx.array([TOKENS])).astype(mx.float32)
    reference = mlx_lm_logits(folder)
    assert logits.shape == reference.shape == (1, len(TOKENS), COMMON["vocab_size"])
    assert float(mx.abs(reference).max()) > 0
    error = float(mx.abs(logits - reference).max())
    assert error <= TOLERANCE, f"{family} {recipe}: max |moebench - mlx-lm| = {error:.3g}"
    from mlx_lm.tokenizer_utils import load as load_mlx_lm_tokenizer

    text = "def f(x):\n    return x  # ünï"
    assert tokenizer.encode(text) == load_mlx_lm_tokenizer(folder).encode(text, add_special_tokens=False)


def test_recipes_write_what_the_issue_names(converted):
    """The layouts really differ: null group sizes in the mixed recipe, Qwen3's router kept affine under mxfp4."""
    mixed = json.loads((converted("qwen2_moe", "mixed_3_6") / "config.json").read_text())["quantization"]
    assert mixed["model.embed_tokens"] == {"group_size": None, "bits": 3, "mode": "affine"}
    mxfp4 = json.loads((converted("qwen3_moe", "mxfp4") / "config.json").read_text())["quantization"]
    assert mxfp4["mode"] == "mxfp4" and "mode" not in mxfp4["model.layers.0.mlp.gate"]
    model, _ = moebench.load(converted("qwen3_moe", "mxfp4"), dtype=mx.float32)
    assert model.load_info.bits["mlp.gate"] == "8-bit g64"
    assert model.load_info.bits["mlp.switch_mlp.up_proj"] == "4-bit g32 mxfp4"
    float_down = moebench.load(converted("qwen3_moe", "affine-4bit-g128"), dtype=mx.float32)[0]
    assert float_down.load_info.bits["mlp.switch_mlp.down_proj"] == "float float32"


# mlx_lm.convert's recipes whose experts the fused pair once declined: 2, 3, 5 and 6 bits, and the mixed recipes
# (gate and up at the low width; down at the high width on the first and last eighth of the layers and every third
# between, so the second of two layers, and at the low one elsewhere)
FUSED_RECIPES = ["affine-2bit-g64", "affine-3bit-g64", "affine-5bit-g64", "affine-6bit-g64", "mixed_3_6",
                 "mixed_3_6-g32", "mixed_2_6"]


@pytest.mark.parametrize("recipe", FUSED_RECIPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_converted_experts_run_the_fused_kernels_on_every_decode_step(converted, family, recipe):
    """Every MoE layer of the converted folder runs the fused kernels on each decode step (the CPU's `reference`
    backend); the prefill is the only step that falls back. The mixed recipes' layers store down at two widths."""
    folder = converted(family, recipe)
    model, _ = moebench.load(folder, dtype=mx.float32)
    widths = {layer: tuple(p.bits for p in block.switch_mlp.quantized_parts())
              for layer, block in model.moe_blocks().items()}
    if recipe.startswith("mixed"):
        low = int(recipe.split("_")[1])
        assert widths == {0: (low, low, low), 1: (low, low, 6)}, widths
    else:
        bits = int(recipe.split("-")[1].removesuffix("bit"))
        assert set(widths.values()) == {(bits, bits, bits)}, widths
    with moebench.fused_moe(True, model):
        moebench.generate(model, TOKENS[:4], max_tokens=9)
    counts = moebench.dispatch(model)["moe"]
    assert sorted(counts) == sorted(widths)
    for layer, d in counts.items():
        assert d["fused"] == {"reference": 8} and d["fallback"] == 1, (layer, d)
