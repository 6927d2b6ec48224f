"""The gpt-oss family against the references users trust: HF transformers' GptOssForCausalLM on tiny float32
checkpoints it saved itself; the hub's mxfp4 layout (openai/gpt-oss-*: `_blocks` / `_scales` experts) written
from them, against transformers' own mxfp4 decoding and mlx-lm's gpt_oss; and the folders `mlx_lm.convert`
writes from that (float, affine 4-bit and 8-bit, mxfp4), against mlx-lm.

What gpt-oss computes unlike the other families: a router with a bias, top-k logits then a softmax over the k;
experts with biases and the clamped SwiGLU; attention with biases, per-head sinks, a sliding window on the
'sliding_attention' layers and YaRN rotary. The prompts cross the window (window 4, prompts of 16 and more).

Two known differences of mlx-lm 0.32's gpt_oss, kept out of the folders compared with it: it reads the RoPE
settings only from `rope_scaling` / `rope_theta` (transformers 5 writes `rope_parameters`) and always truncates
YaRN's correction range (gpt-oss's config says `truncate: false`, which transformers and moebench follow), and it
clamps at 7.0 whatever `swiglu_limit` says. The folders given to mlx-lm use `rope_scaling` with `truncate: true`
and the limit 7.0; the transformers folders use gpt-oss's own `truncate: false` and a limit that bites.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hf_reference import (
    max_error,
    mlx_lm_cached_steps,
    model_call_matches,
    save_hf_checkpoint,
    save_hub_mxfp4,
    session_matches,
)

import moebench
from moebench.decode.cache import make_cache
from moebench.decode.loop import generate
from moebench.inspect.record import Recorder, decode
from moebench.models import hooks
from moebench.models.args import YarnScaling
from moebench.models.rotary import yarn

pytest.importorskip("torch", reason="the float folders are written by transformers (dev dependency torch)")
pytest.importorskip("mlx_lm", reason="the converted folders are written and checked by mlx-lm")

TOLERANCE = 1e-4
PROMPT_LEN = 16
GREEDY_STEPS = 24
CACHED_STEPS = 12
# gpt-oss-20b's arithmetic at a CPU size: D 64 unlike 2I 192 (the expert layouts' orientations show), head_dim 32
# (a multiple of the attention kernel's lanes, so its decline names the window and the sinks), window 4
BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
            rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False, eos_token_id=None,
            swiglu_limit=1.0)  # a clamp that bites on these weights
CONFIGS = {
    "yarn": {},  # transformers' default rope_parameters: YaRN factor 32, truncate false; sliding then full
    "three-layers-top4": dict(num_hidden_layers=3, layer_types=["full_attention", "sliding_attention",
                                                                "sliding_attention"], num_experts_per_tok=4,
                              num_key_value_heads=1, sliding_window=6, swiglu_limit=7.0,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
# the folder mlx-lm is compared on: YaRN as mlx-lm reads it (truncated), its fixed clamp
MLX_LM_CONFIG = dict(swiglu_limit=7.0, rope_parameters={
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
    "original_max_position_embeddings": 4096, "rope_theta": 150000.0})
RECIPES = {
    "float": dict(),
    "4bit": dict(quantize=True, q_bits=4, q_group_size=32),
    "8bit": dict(quantize=True, q_bits=8, q_group_size=32),
    "mxfp4": dict(quantize=True, q_mode="mxfp4"),
}


def save_gpt_oss(folder: Path, overrides: dict, seed: int = 0) -> Path:
    from byte_tokenizer import write_byte_tokenizer
    from transformers import GptOssConfig, GptOssForCausalLM

    save_hf_checkpoint(folder, GptOssConfig, GptOssForCausalLM, {**BASE, **overrides}, seed)
    write_byte_tokenizer(folder)
    return folder


def _prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    return np.random.default_rng(seed).integers(0, BASE["vocab_size"], n).tolist()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            overrides = MLX_LM_CONFIG if name == "mlx-lm" else CONFIGS[name]
            made[name] = save_gpt_oss(tmp_path_factory.mktemp("gpt-oss-hf") / name, overrides)
        return made[name]

    return get


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory, hf_folder):
    """The mlx-lm-comparable float folder's experts in the hub's mxfp4 layout (config as the hub writes it)."""
    return save_hub_mxfp4(hf_folder("mlx-lm"), tmp_path_factory.mktemp("gpt-oss-hub") / "hub")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hub_folder):
    """converted(recipe): mlx_lm.convert of the hub folder, dequantized to float32 ("float"), then quantized."""
    from mlx_lm.convert import convert

    made: dict[str, Path] = {}

    def get(recipe: str) -> Path:
        if "float" not in made:
            made["float"] = tmp_path_factory.mktemp("gpt-oss-mlx") / "float"
            convert(str(hub_folder), str(made["float"]), dequantize=True, dtype="float32")
        if recipe not in made:
            made[recipe] = tmp_path_factory.mktemp(f"gpt-oss-{recipe}") / "mlx"
            convert(str(made["float"]), str(made[recipe]), dtype="float32", **RECIPES[recipe])
        return made[recipe]

    return get


# ---- arithmetic ------------------------------------------------------------------------------------

@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_are_transformers(truncate):
    """YaRN's inverse frequencies and attention factor as transformers computes them, truncated or not."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
            "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
    config = GptOssConfig(head_dim=64, rope_parameters=rope)
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    got, got_factor = yarn(64, 150000.0, YarnScaling(32.0, 4096, 32.0, 1.0, truncate))
    assert np.allclose(np.array(got), expected.numpy(), rtol=1e-6, atol=0)
    assert got_factor == pytest.approx(factor, rel=1e-12)


# ---- transformers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_greedy_and_routing_match_hf(hf_folder, name):
    import torch
    from transformers import GptOssForCausalLM

    folder = hf_folder(name)
    config = {**BASE, **CONFIGS[name]}
    hf = GptOssForCausalLM.from_pretrained(folder, dtype="float32").eval()
    ours, _ = moebench.load(folder)
    assert ours.args.model_type == "gpt_oss"
    windows = [layer.self_attn.window for layer in ours.layers]
    types = config.get("layer_types") or ["sliding_attention", "full_attention"]
    assert windows == [config["sliding_window"] if t == "sliding_attention" else None for t in types]

    ids = _prompt(0)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS,
                          do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
                          return_dict_in_generate=True)
    expected = out.logits.numpy()
    recorder = Recorder()
    got = np.array(ours(mx.array([ids]), None, recorder))
    assert got.shape == expected.shape == (1, PROMPT_LEN, config["vocab_size"])
    assert np.abs(expected).max() > 0.5
    assert max_error(got, expected) <= TOLERANCE, f"{name}: whole sequence, max |moebench - transformers|"

    # the recorded router: transformers' bias-added logits, and its top-k experts at every position
    k = config["num_experts_per_tok"]
    for layer, hf_logits in enumerate(out.router_logits):
        logits = recorder.values[f"layers.{layer}.moe.{hooks.ROUTER_LOGITS}"]
        assert max_error(logits, hf_logits.numpy()) <= TOLERANCE, (name, layer)
        top = torch.topk(hf_logits, k, dim=-1).indices.numpy()
        ids_ours = np.array(recorder.values[f"layers.{layer}.moe.{hooks.TOPK_IDS}"])
        assert [sorted(r) for r in ids_ours.tolist()] == [sorted(r) for r in top.tolist()], (name, layer)
        scores = np.array(recorder.values[f"layers.{layer}.moe.{hooks.TOPK_SCORES}"])
        assert np.allclose(scores.sum(-1), 1, atol=1e-6)  # the softmax over the k selected

    tokens = gen.sequences[0, PROMPT_LEN:].tolist()
    assert generate(ours, ids, GREEDY_STEPS).token_ids == tokens
    assert len(set(tokens)) > 1

    step_logits = torch.stack(gen.logits, dim=1)[0].numpy()
    cache = make_cache(len(ours.layers))
    logits = [np.array(ours(mx.array([ids]), cache)[0, -1])]
    for tok in tokens[:-1]:
        logits.append(np.array(ours(mx.array([[tok]]), cache)[0, -1]))
    assert max_error(np.stack(logits), step_logits) <= TOLERANCE, f"{name}: cached steps vs transformers"

    # a recorded decode (the Stepper) routes each generated token as transformers does
    trace = decode(ours, None, ids, 6, record=True)
    assert [s.token_id for s in trace.generated] == tokens[:6]
    with torch.no_grad():
        routed = hf(torch.tensor([ids + tokens[:5]]), output_router_logits=True).router_logits
    for step in trace.generated:
        for layer, record in step.layers.items():
            top = torch.topk(routed[layer][step.position], k).indices.tolist()
            assert sorted(record.topk_ids.tolist()) == sorted(top), (name, step.position, layer)


def test_a_float_gpt_oss_falls_back_and_says_why(hf_folder):
    """The fused MoE kernels compute gpt-oss's routing and experts (tests/execution/test_gpt_oss_fused.py) but read
    quantized experts only: on a float folder every decode step's MoE falls back, with reasons a person reads, while
    the attention kernel (window, sinks and YaRN its variants) runs both layers; the tokens are the fallback's."""
    ours, _ = moebench.load(hf_folder("yarn"))
    ids = _prompt(2)
    with moebench.fused_moe(True, ours):
        fused = generate(ours, ids, 6)
    found = moebench.dispatch(ours)
    for layer, counts in found["moe"].items():
        assert counts["fused"] == {} and counts["fallback"] == 6, (layer, counts)
        declined = [r for r in counts["reasons"] if "tokens" not in r]
        assert declined == ["float experts (the kernel needs quantized weights)"], (layer, counts)
    for layer, counts in found["attention"].items():
        assert counts["fused"] == {moebench.available_backend(): 5} and counts["fallback"] == 1, (layer, counts)
    with moebench.fused_moe(False, ours):
        assert generate(ours, ids, 6).token_ids == fused.token_ids


# ---- the hub's mxfp4 layout ------------------------------------------------------------------------

def test_hub_mxfp4_layout_is_transformers_decoding(hub_folder, tmp_path):
    """The hub layout's experts read as MLX mxfp4 are the values transformers' own mxfp4 decoder gives: moebench on
    the hub folder equals transformers on a float folder of those values (whole prompt, float32)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ours, _ = moebench.load(hub_folder)
    assert ours.load_info.bits["mlp.switch_mlp.gate_proj"] == "4-bit g32 mxfp4"
    tensors = load_file(hub_folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        dense = convert_moe_packed_tensors(tensors.pop(name), tensors.pop(f"{base}_scales"), dtype=torch.float32)
        tensors[base] = dense  # transformers' x @ W orientation [E, in, rows]
    floats = tmp_path / "dequantized"
    floats.mkdir()
    save_file(tensors, floats / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hub_folder / "config.json").read_text())
    config.pop("quantization_config")
    (floats / "config.json").write_text(json.dumps(config))
    ids = _prompt(5, 20)
    with torch.no_grad():
        expected = GptOssForCausalLM.from_pretrained(floats, dtype="float32").eval()(torch.tensor([ids])).logits
    assert max_error(ours(mx.array([ids])), expected.numpy()) <= TOLERANCE


# ---- mlx-lm ----------------------------------------------------------------------------------------

def _matches_mlx_lm(folder: Path, what: str) -> None:
    """moebench's float32 logits are mlx-lm's over the whole prompt, then token by token: through the model's own
    call with make_cache, and through the decode loop's Session with the fused kernels on and off; greedy tokens
    are mlx-lm's."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    reference, _ = load_model(folder)
    ours, _ = moebench.load(folder, dtype=mx.float32)
    ids = _prompt(3)
    whole = reference(mx.array([ids])).astype(mx.float32)
    assert float(mx.abs(whole).max()) > 0.5
    assert max_error(ours(mx.array([ids])), whole) <= TOLERANCE, f"{what}: whole prompt"

    expected, tokens = mlx_lm_cached_steps(reference, ids, CACHED_STEPS)
    assert len(set(tokens)) > 1
    model_call_matches(ours, ids, tokens, expected, what, TOLERANCE)
    session_matches(ours, ids, tokens, expected, what, TOLERANCE)

    greedy = [int(token) for token, _ in generate_step(mx.array(ids), reference, max_tokens=GREEDY_STEPS)]
    assert generate(ours, ids, GREEDY_STEPS).token_ids == greedy


def test_hub_folder_matches_mlx_lm(hub_folder):
    _matches_mlx_lm(hub_folder, "hub mxfp4")


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_converted_folder_matches_mlx_lm(converted, recipe):
    folder = converted(recipe)
    ours, _ = moebench.load(folder)
    bits = {"float": "float float32", "4bit": "4-bit g32", "8bit": "8-bit g32", "mxfp4": "4-bit g32 mxfp4"}[recipe]
    assert ours.load_info.bits["mlp.switch_mlp.gate_proj"] == bits
    _matches_mlx_lm(folder, recipe)


# ---- bad checkpoints -------------------------------------------------------------------------------

def test_bad_expert_tensors_are_named(hf_folder, tmp_path):
    """A transformers folder whose gate_up_proj lost its interleaved partner, or whose expert tensor is missing,
    fails naming the tensor and the file."""
    from safetensors.numpy import load_file, save_file

    source = hf_folder("yarn")
    tensors = load_file(source / "model.safetensors")
    for case, change in {
        "odd": lambda t: t.__setitem__("model.layers.1.mlp.experts.gate_up_proj_bias",
                                       t["model.layers.1.mlp.experts.gate_up_proj_bias"][:, :-1]),
        "missing": lambda t: t.pop("model.layers.0.mlp.experts.down_proj_bias"),
        "wrong-type": lambda t: t.__setitem__("model.layers.0.mlp.experts.down_proj",
                                              t["model.layers.0.mlp.experts.down_proj"].astype(np.int32)),
    }.items():
        folder = tmp_path / case
        shutil.copytree(source, folder)
        changed = dict(tensors)
        change(changed)
        save_file(changed, folder / "model.safetensors")
        with pytest.raises(moebench.CheckpointError) as e:
            moebench.load(folder)
        message = str(e.value)
        assert "mlp.experts." in message, (case, message)
        if case != "missing":
            assert "model.safetensors" in message, (case, message)


# ---- sharding ----------------------------------------------------------------------------------------

def test_each_rank_of_the_hub_layout_holds_its_experts_rows(hub_folder):
    """Expert parallelism on the hub's mxfp4 layout, whose gate and up are split from interleaved rows in memory
    (only the mlx-lm layout can be read rank by rank from the file): each rank of two holds its experts' rows of
    every part, biases included, equal to the whole model's. The two-process decode is tests/models/test_sharding."""
    from moebench.checkpoint.config import read_model_args
    from moebench.checkpoint.files import TensorStore
    from moebench.checkpoint.weights import load_weights
    from moebench.models import family
    from moebench.models.gpt_oss_layouts import to_moebench_names
    from moebench.models.sharding import shard_experts

    class Ranks:  # an mx.distributed group as rank `rank` of two sees it (loading makes no collective call)
        def __init__(self, rank: int):
            self.rank, self.size = lambda: rank, lambda: 2

    def loaded(group):
        store = TensorStore(hub_folder)
        args = to_moebench_names(store, read_model_args(hub_folder / "config.json"))
        model = family("gpt_oss").model(args)
        if group is not None:
            shard_experts(model, group)
        load_weights(model, store, mx.float32, args.quantization)
        store.check_all_used()
        return model

    whole = loaded(None)
    for rank in (0, 1):
        sharded = loaded(Ranks(rank))
        for i, block in sharded.moe_blocks().items():
            full, experts = whole.moe_blocks()[i].switch_mlp, block.switch_mlp
            assert (experts.first, experts.num_experts, experts.total) == (4 * rank, 4, 8)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for part in ("weight", "scales", "bias"):
                    theirs = full[proj][part][4 * rank:4 * rank + 4]
                    assert mx.array_equal(experts[proj][part], theirs).item(), (rank, i, proj, part)
