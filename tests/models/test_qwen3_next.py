"""Qwen3-Next and Qwen3.5-MoE checkpoints opened and decoded by moebench, against the references users trust.

Tiny float32 folders saved by transformers (`save_pretrained`: Qwen3-Next's experts one by one or fused, Qwen3.5's
multimodal folder with its vision tower, fused as the hub stores it or one by one), against transformers' own
models; and the folders `mlx_lm.convert` writes from them (float, affine 4-bit and 8-bit, mxfp4) against mlx-lm.
Three linear-attention layers and a full one, 8 experts and a shared expert; logits over a whole prompt and over
64 decode steps (the recurrent states must not drift), through moebench's decode loop with the fused kernels on and
off. A Stepper interrupted inside a hybrid step is back at its last whole step and resumes exactly.

mlx-lm 0.32 reads Qwen3-Next's rotary settings only at the config's top level (transformers 5 writes them inside
`rope_parameters`; the hub's config.json has both, as these folders do), and converts Qwen3.5 only from the hub's
fused experts (its per-expert folder is not converted, so it is compared with transformers alone).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hf_reference import max_error, session_matches
from hybrids import assert_back_at_and_resumes
from test_gated_delta import randomize

import moebench
from moebench.decode.cache import KVCache, kv_cache_bytes
from moebench.decode.compiled import CompiledForward
from moebench.decode.loop import Session, generate
from moebench.decode.state import LinearAttentionState
from moebench.errors import CheckpointError, ConfigError
from moebench.execution.executor import executor
from moebench.execution.kernel import available_backend
from moebench.inspect.record import Stepper
from moebench.models import qwen3_next

torch = pytest.importorskip("torch", reason="the float folders are written by transformers (dev dependency torch)")
pytest.importorskip("mlx_lm", reason="the converted folders are written and checked by mlx-lm")

TOLERANCE = 1e-4
PROMPT, STEPS = 8, 64
# head_dim 32 (a multiple of the attention kernel's lanes, so its decline names what the hybrid computes); every
# in-dimension a multiple of 64, so mlx-lm quantizes every matrix
BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, rms_norm_eps=1e-6, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, tie_word_embeddings=False)
FOLDERS = [("qwen3_next", "per-expert"), ("qwen3_next", "fused"), ("qwen3_5_moe", "fused"),
           ("qwen3_5_moe", "per-expert")]
HUB = {"qwen3_next": "per-expert", "qwen3_5_moe": "fused"}  # the layout each family's hub folders use
RECIPES = {
    "float": dict(),
    "4bit": dict(quantize=True, q_bits=4, q_group_size=64),
    "8bit": dict(quantize=True, q_bits=8, q_group_size=64),
    "mxfp4": dict(quantize=True, q_mode="mxfp4"),
}


def torch_model(family: str, seed: int):
    """transformers' tiny model with random weights of useful size (test_gated_delta.randomize)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    if family == "qwen3_next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**BASE, intermediate_size=64))
    else:
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=BASE["hidden_size"])
        text = {k: v for k, v in BASE.items() if k != "tie_word_embeddings"}
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision,
                                                                     tie_word_embeddings=False))
    randomize(model.eval(), seed)
    return model


def save(model, folder: Path, layout: str) -> Path:
    """save_pretrained in `layout` (fused: transformers 5's `save_original_format=False`); Qwen3-Next's rotary
    settings also at the top level, as its hub config.json has them."""
    model.save_pretrained(folder, save_original_format=layout == "per-expert")
    config = json.loads((folder / "config.json").read_text())
    if "rope_parameters" in config:
        config.update({k: config["rope_parameters"][k] for k in ("rope_theta", "partial_rotary_factor")})
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """hf(family, layout) -> (folder, transformers' model)."""
    models: dict[str, object] = {}
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, layout: str):
        if family not in models:
            models[family] = torch_model(family, seed=len(models))
        if (family, layout) not in made:
            made[family, layout] = save(models[family], tmp_path_factory.mktemp(family) / layout, layout)
        return made[family, layout], models[family]

    return get


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hf):
    """converted(family, recipe): mlx_lm.convert of the family's hub-layout folder, in float32."""
    from mlx_lm.convert import convert

    made: dict[tuple[str, str], Path] = {}

    def get(family: str, recipe: str) -> Path:
        if (family, recipe) not in made:
            folder = tmp_path_factory.mktemp(f"{family}-mlx") / recipe
            convert(str(hf(family, HUB[family])[0]), str(folder), dtype="float32", **RECIPES[recipe])
            made[family, recipe] = folder
        return made[family, recipe]

    return get


def _prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, BASE["vocab_size"], PROMPT).tolist()


# ---- transformers' folders ---------------------------------------------------------------------------

@pytest.mark.parametrize("family,layout", FOLDERS)
def test_transformers_folders_load_and_match_transformers(hf, family, layout):
    folder, reference = hf(family, layout)
    ours, _ = moebench.load(folder)
    assert [layer.layer_type for layer in ours.layers] == ["linear_attention"] * 3 + ["full_attention"]
    if family == "qwen3_5_moe":
        assert ours.args.model_type == "qwen3_5_moe_text"
        assert list(ours.load_info.skipped) == ["vision tower (model.visual.*)"]
    else:
        assert ours.load_info.skipped == {}

    ids = _prompt(0)
    with torch.no_grad():
        whole = reference(torch.tensor([ids])).logits.numpy()
        gen = reference.generate(torch.tensor([ids]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                                 pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    assert np.abs(whole).max() > 0.5
    assert max_error(ours(mx.array([ids])), whole) <= TOLERANCE, f"{family} {layout}: whole prompt"
    tokens = gen.sequences[0, PROMPT:].tolist()
    assert len(set(tokens)) > 4
    expected = torch.stack(gen.logits, dim=1)[0].numpy()  # [STEPS, V]: after the prompt, then after each token
    session_matches(ours, ids, tokens[:-1], expected, f"{family} {layout}", TOLERANCE)
    assert generate(ours, ids, STEPS).token_ids == tokens


def test_load_summary_says_what_was_left_out(hf):
    from moebench.checkpoint.loader import load_summary

    ours, _ = moebench.load(hf("qwen3_5_moe", "fused")[0])
    assert "left out 21 tensors of the vision tower (model.visual.*)" in load_summary(ours)


# ---- mlx-lm's conversions ----------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("family", sorted(HUB))
def test_converted_folders_match_mlx_lm(converted, family, recipe):
    """moebench's float32 logits are mlx-lm's over the whole prompt and token by token for 64 steps over the caches,
    through the decode loop with the fused kernels on and off; greedy tokens are mlx-lm's. The router and the shared
    expert gate load at the 8 bits mlx-lm keeps them at; quantized affine experts run the fused MoE kernels with the
    shared expert inside."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    folder = converted(family, recipe)
    reference, _ = load_model(folder)
    ours, _ = moebench.load(folder)
    bits = {"float": "float float32", "4bit": "4-bit g64", "8bit": "8-bit g64", "mxfp4": "4-bit g32 mxfp4"}[recipe]
    assert ours.load_info.bits["mlp.switch_mlp.gate_proj"] == bits
    if recipe != "float":
        assert ours.load_info.bits["mlp.gate"] == ours.load_info.bits["mlp.shared_expert_gate"] == "8-bit g64"
    ids = _prompt(1)
    assert max_error(ours(mx.array([ids])), reference(mx.array([ids]))) <= TOLERANCE, f"{recipe}: whole prompt"

    ref_cache = make_prompt_cache(reference)
    step = reference(mx.array([ids]), cache=ref_cache)[0, -1]
    expected, tokens = [np.array(step)], []
    for _ in range(STEPS - 1):
        tokens.append(int(mx.argmax(step)))
        step = reference(mx.array([[tokens[-1]]]), cache=ref_cache)[0, -1]
        expected.append(np.array(step))
    assert len(set(tokens)) > 4
    session_matches(ours, ids, tokens, np.stack(expected), f"{family} {recipe}", TOLERANCE)

    greedy = [int(token) for token, _ in generate_step(mx.array(ids), reference, max_tokens=STEPS)]
    ex = executor(ours)
    ex.reset_counts()
    with moebench.fused_moe(True, ours):
        assert generate(ours, ids, STEPS).token_ids == greedy
    moe = ex.summary()
    if recipe in ("4bit", "8bit"):  # every MoE layer's decode steps through the kernels, the shared expert inside
        assert moe["fallback"] == 4 and sum(moe["fused"].values()) == 4 * (STEPS - 1) and not moe["notes"]
    elif recipe == "float":
        assert not moe["fused"] and moe["reasons"]["float experts (the kernel needs quantized weights)"] == 4 * (
            STEPS - 1)


# ---- decoding ------------------------------------------------------------------------------------------

def test_decisions_caches_and_the_compiled_step(hf, tmp_path):
    """Linear layers run the gated delta step kernel, recorded like every decision; the gated full-attention layer
    runs the attention kernel (partial rotary and the output gate are its variants); caches by layer type, the KV
    bytes of the full-attention layer alone; the compiled step decodes what the eager loop does."""
    folder, _ = hf("qwen3_next", "per-expert")
    ours, _ = moebench.load(folder)
    plan = executor(ours).plan_for(1, False)
    assert [layer.attention.path for layer in plan.layers] == [available_backend()] * 4
    assert ours.layers[3].self_attn.spec.output_gate and plan.layers[3].attention.fused
    trace = Stepper(ours, None, _prompt(2), record=True).run(3)
    assert trace.generated[-1].layers[0].attn_path.path == available_backend()

    session = Session(ours, compiled=True)
    assert isinstance(session.compiled, CompiledForward)  # the recurrent states are the traced step's inputs
    assert [type(c) for c in Session(ours, compiled=False).cache] == [LinearAttentionState] * 3 + [KVCache]
    assert kv_cache_bytes(ours, 100) == 2 * 2 * 32 * 100 * 4
    assert generate(ours, _prompt(2), 3, compiled=True).token_ids == trace.token_ids


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("where", ["linear", "full"])
def test_interrupted_stepper_is_back_at_its_last_whole_step(hf, monkeypatch, where, pipeline):
    """An interrupt inside a hybrid step (in layer 1's linear attention, after layer 0 wrote its state - in its
    projections, which the module and the fused step both run; or in layer 3's full attention, after every linear
    layer wrote) leaves every cache at the last whole step; the tokens
    and logits after resuming are an uninterrupted decode's, bit for bit, and moebench.generate's greedy tokens."""
    folder, _ = hf("qwen3_5_moe", "fused")
    ours, _ = moebench.load(folder)
    ids, steps = _prompt(3), 12
    straight = Stepper(ours, None, ids, keep_logits=True, pipeline=pipeline).run(steps)
    assert generate(ours, ids, steps).token_ids == straight.token_ids

    stepper = Stepper(ours, None, ids, keep_logits=True, pipeline=pipeline, max_tokens=steps)
    stepper.prefill()
    for _ in range(4):
        stepper.step()
    # the full-attention layer's decode step is the attention kernel's (the plan's step taking the module's place)
    target = ours.layers[1].linear_attn if where == "linear" else \
        executor(ours).plan_for(1, False).layers[3].attention_step
    method = "project" if where == "linear" else "__call__"
    original = getattr(type(target), method)

    def interrupted(self, *args, **kwargs):
        if self is target:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(target), method, interrupted)
    with pytest.raises(KeyboardInterrupt):
        stepper.step()
    monkeypatch.setattr(type(target), method, original)
    assert_back_at_and_resumes(stepper, straight, PROMPT + 4)


# ---- bad checkpoints -------------------------------------------------------------------------------------

def test_bad_hybrid_checkpoints_are_named(hf, tmp_path):
    from safetensors.numpy import load_file, save_file

    source = hf("qwen3_5_moe", "fused")[0]
    tensors = load_file(source / "model.safetensors")
    prefix = "model.language_model.layers.0"
    cases = {
        "missing": (lambda t: t.pop(f"{prefix}.mlp.experts.down_proj"),
                    "missing tensor model.layers.0.mlp.experts.down_proj"),
        "odd": (lambda t: t.__setitem__(f"{prefix}.mlp.experts.gate_up_proj",
                                        t[f"{prefix}.mlp.experts.gate_up_proj"][:, 1:]), "odd gate/up width"),
        "conv": (lambda t: t.__setitem__(f"{prefix}.linear_attn.conv1d.weight",
                                         t[f"{prefix}.linear_attn.conv1d.weight"][..., 0].astype(np.int32)),
                 "model.layers.0.linear_attn.conv1d.weight is int32"),
    }
    for case, (change, message) in cases.items():
        folder = tmp_path / case
        shutil.copytree(source, folder)
        changed = dict(tensors)
        change(changed)
        save_file(changed, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=message) as e:
            moebench.load(folder)
        assert "model.safetensors" in str(e.value), case

    config = json.loads((source / "config.json").read_text())
    config["text_config"]["linear_num_value_heads"] = 3
    bad = tmp_path / "heads"
    shutil.copytree(source, bad)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="linear_num_value_heads \\(3\\) must be a multiple"):
        moebench.load(bad)
    assert qwen3_next.LAYOUT["qwen3_5_moe_text"] == qwen3_next.SPLIT_QKV_Z_B_A
