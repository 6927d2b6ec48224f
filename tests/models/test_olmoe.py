"""The OLMoE family (OLMoE-1B-7B) against the references users trust: HF transformers' OlmoeForCausalLM on tiny
float32 checkpoints it saved itself, and mlx-lm's olmoe on the folders `mlx_lm.convert` writes from them (4-bit,
8-bit and the mixed_3_6 recipe). Then the fused kernels on every decode step, and `moebench generate`.

What OLMoE computes unlike Qwen3-MoE: softmax over all experts then top-k, never renormalised (norm_topk_prob
false); RMSNorm over the whole q and k projections (one norm of width heads * head_dim, not per head); no shared
expert, no biases; config.json's `intermediate_size` is the expert width (there is no moe_intermediate_size).
transformers 5 writes RoPE's theta under `rope_parameters` (mlx-lm 0.32 reads only a top-level `rope_theta`,
default 10000: the folders converted here keep OLMoE's 10000 so both read the same).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from byte_tokenizer import write_byte_tokenizer
from family_parity import matches_mlx_lm
from hf_reference import max_error, save_hf_checkpoint

import moebench
from moebench.cli import main
from moebench.decode.cache import make_cache
from moebench.decode.loop import generate
from moebench.tools.writer import write_random_checkpoint

pytest.importorskip("torch", reason="the float folders are written by transformers (dev dependency torch)")
pytest.importorskip("mlx_lm", reason="the quantized folders are written and checked by mlx-lm")
# mlx-lm saves the byte tokenizer as OLMoE's GPT-NeoX tokenizer class, which adds <|endoftext|> and <|padding|> as
# ids 256 and 257, past the tiny vocabulary: moebench warns, as it should, on every converted folder
pytestmark = pytest.mark.filterwarnings("ignore:.*the tokenizer has ids up to 257:UserWarning")

TOLERANCE = 1e-4
PROMPT_LEN = 16
GREEDY_STEPS = 32
CACHED_STEPS = 16
# OLMoE-1B-7B's arithmetic at a CPU size. OlmoeConfig has no head_dim of its own: transformers sizes q_norm by
# hidden_size, so heads * head_dim must equal hidden_size.
BASE = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=128, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False, rms_norm_eps=1e-5,
            max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False, clip_qkv=None,
            eos_token_id=None)  # OlmoeConfig's default eos 50279 lies outside this vocabulary
CONFIGS = {
    "mha-untied": {},
    "gqa-tied-top8": dict(num_key_value_heads=2, num_experts_per_tok=8, tie_word_embeddings=True),
    "kv1-rope-theta": dict(num_key_value_heads=1, rope_theta=500000.0),  # theta read from rope_parameters
}
# mlx_lm.convert recipes, all at group size 64 (every input width here, 128, divides by it)
RECIPES = {
    "4bit": dict(q_bits=4, q_group_size=64),
    "8bit": dict(q_bits=8, q_group_size=64),
    "mixed_3_6": dict(quant_predicate="mixed_3_6", q_group_size=64),
}
CONVERTED = [("mha-untied", recipe) for recipe in RECIPES] + [("gqa-tied-top8", "4bit")]


def save_olmoe(folder: Path, overrides: dict, seed: int = 0) -> Path:
    """A random float32 OLMoE saved by transformers (per-expert tensors), with the byte tokenizer."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    save_hf_checkpoint(folder, OlmoeConfig, OlmoeForCausalLM, {**BASE, **overrides}, seed)
    write_byte_tokenizer(folder)
    return folder


def _prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, BASE["vocab_size"], PROMPT_LEN).tolist()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """hf_folder(name) -> CONFIGS[name] saved by transformers (made once, read-only)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = save_olmoe(tmp_path_factory.mktemp("olmoe-hf") / name, CONFIGS[name])
        return made[name]

    return get


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hf_folder):
    """converted(name, recipe) -> the folder `mlx_lm.convert` wrote from hf_folder(name) (made once, read-only)."""
    from mlx_lm.convert import convert

    made: dict[tuple[str, str], Path] = {}

    def get(name: str, recipe: str) -> Path:
        if (name, recipe) not in made:
            out = tmp_path_factory.mktemp(f"olmoe-{name}-{recipe}") / "mlx"
            convert(str(hf_folder(name)), str(out), quantize=True, **RECIPES[recipe])
            made[name, recipe] = out
        return made[name, recipe]

    return get


# ---- transformers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_greedy_match_hf(hf_folder, name):
    import torch
    from transformers import OlmoeForCausalLM

    folder = hf_folder(name)
    config = {**BASE, **CONFIGS[name]}
    hf = OlmoeForCausalLM.from_pretrained(folder, dtype="float32").eval()
    ours, _ = moebench.load(folder)
    assert ours.args.model_type == "olmoe"
    assert sorted(ours.moe_blocks()) == list(range(config["num_hidden_layers"]))  # every layer MoE
    assert not any("shared_expert" in b for b in ours.moe_blocks().values())
    assert ("lm_head" in ours) == (not config["tie_word_embeddings"])

    ids = _prompt(0)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits.numpy()
        out = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS,
                          do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
                          return_dict_in_generate=True)
    got = np.array(ours(mx.array([ids])))
    assert got.shape == expected.shape == (1, PROMPT_LEN, config["vocab_size"])
    assert np.abs(expected).max() > 0.5  # not two near-zero tensors
    assert max_error(got, expected) <= TOLERANCE, f"{name}: whole sequence, max |moebench - transformers|"

    tokens = out.sequences[0, PROMPT_LEN:].tolist()
    assert generate(ours, ids, GREEDY_STEPS).token_ids == tokens
    assert len(set(tokens)) > 1  # a degenerate repeat would prove little

    # the cached path, fed transformers' tokens: every position's logits agree
    step_logits = torch.stack(out.logits, dim=1)[0].numpy()
    cache = make_cache(len(ours.layers))
    logits = [np.array(ours(mx.array([ids]), cache)[0, -1])]
    for tok in tokens[:-1]:
        logits.append(np.array(ours(mx.array([[tok]]), cache)[0, -1]))
    assert max_error(np.stack(logits), step_logits) <= TOLERANCE, f"{name}: cached steps vs transformers"


def test_clip_qkv_is_computed_as_transformers_or_refused(tmp_path):
    """The published OLMoE checkpoints leave clip_qkv null; one that sets it either computes transformers' clamp
    (q and k after their norms, and v, to +-clip_qkv) or is refused naming the field, never silently ignored
    (as mlx-lm 0.32's olmoe ignores it)."""
    import torch
    from transformers import OlmoeForCausalLM

    clipped = save_olmoe(tmp_path / "clipped", dict(clip_qkv=0.5))
    plain = save_olmoe(tmp_path / "plain", {})  # the same seed: the same weights
    ids = _prompt(4)
    with torch.no_grad():
        expected, unclipped = (OlmoeForCausalLM.from_pretrained(f, dtype="float32").eval()(torch.tensor([ids]))
                               .logits.numpy() for f in (clipped, plain))
    assert max_error(expected, unclipped) > 0.1  # the clamp bites
    try:
        ours, _ = moebench.load(clipped)
    except moebench.ConfigError as e:
        assert "clip_qkv" in str(e)
        return
    assert max_error(np.array(ours(mx.array([ids]))), expected) <= TOLERANCE


def test_writer_layout_is_transformers_layout(tmp_path, hf_folder):
    """moebench.tools.writer (make-random, the notebook checkpoints) writes exactly the tensors transformers saves
    for OLMoE: q_norm / k_norm over the whole projections, experts of width intermediate_size."""
    from safetensors import safe_open

    hf = hf_folder("gqa-tied-top8")
    config = json.loads((hf / "config.json").read_text())
    ours = write_random_checkpoint(tmp_path / "ours", config)
    with safe_open(hf / "model.safetensors", "np") as a, safe_open(ours / "model.safetensors", "np") as b:
        assert {k: a.get_slice(k).get_shape() for k in a.keys()} == {k: b.get_slice(k).get_shape() for k in b.keys()}
    model, _ = moebench.load(ours)
    assert model.args.model_type == "olmoe"


# ---- mlx-lm ----------------------------------------------------------------------------------------

EXPECTED_BITS = {"4bit": "4-bit g64", "8bit": "8-bit g64", "mixed_3_6": "3-bit g64, 6-bit g64"}


@pytest.mark.parametrize("name,recipe", CONVERTED)
def test_converted_folder_matches_mlx_lm(converted, name, recipe):
    """moebench's float32 logits are mlx-lm's over the whole prompt, then token by token over both caches: through
    the model's own call with make_cache (no kernels), and through the decode loop's Session with the fused
    kernels on (where they support the recipe)."""
    folder = converted(name, recipe)
    quantization = json.loads((folder / "config.json").read_text())["quantization"]
    if recipe == "mixed_3_6":  # the recipe really mixes: layer 1's down_proj at 6 bits, layer 0's at 3
        assert quantization["model.layers.1.mlp.switch_mlp.down_proj"]["bits"] == 6
        assert quantization["model.layers.0.mlp.switch_mlp.down_proj"]["bits"] == 3
    ours = matches_mlx_lm(folder, _prompt(3), CACHED_STEPS)
    assert ours.load_info.bits["mlp.switch_mlp.down_proj"] == EXPECTED_BITS[recipe]
    # the decode steps above ran the kernel pair under every recipe, mixed_3_6's 3-bit gate/up included
    for layer, counts in moebench.dispatch(ours)["moe"].items():
        fused = sum(counts["fused"].values())
        assert fused + counts["fallback"] == CACHED_STEPS + 1, (layer, counts)
        assert fused == CACHED_STEPS, (layer, counts)


@pytest.mark.parametrize("name", ["mha-untied", "gqa-tied-top8"])
def test_fused_kernels_run_every_decode_step(converted, name):
    """After generate(model, ids, 8) on a 4-bit conversion every MoE layer ran the fused kernels on each of the 7
    decode steps (the prompt falls back: many tokens); the decode-attention kernel either ran on those steps too
    or says why not. The tokens are the fallback's."""
    ours, _ = moebench.load(converted(name, "4bit"), dtype=mx.float32)
    backend = moebench.available_backend()
    ids = _prompt(2)
    prefill = f"{PROMPT_LEN} tokens (the kernel runs single-token decode)"
    with moebench.fused_moe(True, ours):
        fused = generate(ours, ids, 8)
    found = moebench.dispatch(ours)
    assert sorted(found["moe"]) == sorted(ours.moe_blocks()) == list(range(len(ours.layers)))
    for layer, counts in found["moe"].items():
        assert counts["fused"] == {backend: 7}, (layer, counts)
        assert counts["reasons"] == {prefill: 1}, (layer, counts)
    assert sorted(found["attention"]) == list(range(len(ours.layers)))
    for layer, counts in found["attention"].items():
        assert counts["reasons"].get(prefill) == 1, (layer, counts)
        if counts["fused"]:  # the kernel computes OLMoE's whole-projection q/k norm
            assert counts["fused"] == {backend: 7} and counts["fallback"] == 1, (layer, counts)
        else:  # or it declines OLMoE attention on every decode step and says why
            declined = {reason: n for reason, n in counts["reasons"].items() if reason != prefill}
            assert sum(declined.values()) == 7, (layer, counts)
            assert all(isinstance(r, str) and r.strip() for r in declined), (layer, counts)
    with moebench.fused_moe(False, ours):
        fallback = generate(ours, ids, 8)
    assert fused.token_ids == fallback.token_ids


# ---- the CLI ---------------------------------------------------------------------------------------

def test_cli_generates_on_olmoe_folders(converted, hf_folder, capsys):
    """`moebench generate FOLDER --prompt ... --max-tokens 8` on the float folder transformers wrote and on its
    4-bit mlx-lm conversion: the tokens are generate()'s, the quantized folder's MoE layers ran fused."""
    with moebench.fused_moe(moebench.fused_moe_enabled()):  # the CLI sets the process-wide switch: restore it
        assert main(["generate", str(hf_folder("mha-untied")), "--prompt", "def f(x):", "--max-tokens", "8"]) == 0
        captured = capsys.readouterr()
        assert "def f(x):" in captured.out and "decode 8 tokens" in captured.err

        folder = converted("mha-untied", "4bit")
        assert main(["generate", str(folder), "--prompt", "def f(x):", "--max-tokens", "8", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 8
    model, _ = moebench.load(folder)
    assert out["token_ids"] == generate(model, out["prompt_ids"], 8).token_ids
    assert sorted(out["dispatch"]) == ["0", "1"]
    assert all(layer["fused"] == {moebench.available_backend(): 7} for layer in out["dispatch"].values())
