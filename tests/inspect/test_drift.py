"""Routing drift: a model against itself drifts nowhere; a copy whose router was changed at a known layer by a known
amount drifts exactly there, by exactly that much; moebench against transformers (float32) on tiny replicas of every
family routes the same top-k everywhere but at flagged near-ties; routing files compare like models."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import moebench
from moebench.errors import MoebenchError
from moebench.inspect.drift import TIE_MARGIN, Drift, drift, teacher_force, transformers_routing
from moebench.inspect.routing_files import read_routing, write_routing
from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

LAYERS = 4
SWAP = (2, 5)  # experts whose router rows trade places


def _prompts(n: int = 2, length: int = 40, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("drift") / "base",
                                   qwen2_moe_config(num_hidden_layers=LAYERS), seed=3)


def _edited(base: Path, folder: Path, layer: int, edit) -> Path:
    """A copy of `base` whose layer's router weight [experts, hidden] is edit(weight)."""
    shutil.copytree(base, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    name = f"model.layers.{layer}.mlp.gate.weight"
    tensors[name] = np.ascontiguousarray(edit(tensors[name]))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_a_model_against_itself_has_zero_drift(base):
    model, _ = moebench.load(base)
    d = drift([model, model], _prompts(), names=["a", "b"])
    f = d.frame()
    assert len(f) == 2 * 40 * LAYERS
    assert (f["jaccard"] == 1).all() and not f["top1_flip"].any() and not f["set_change"].any()
    assert (f["router_kl"] == 0).all() and (f["moved"] == 0).all() and (f["logits_kl"] == 0).all()
    assert not f["near_tie"].any() and not f["real"].any() and not f["next_top1_change"].astype(bool).any()
    assert "no routing drift" in repr(d)
    assert (d.by_expert()["lost"] == 0).all()


def test_swapped_router_rows_drift_exactly_at_that_layer(base, tmp_path):
    """Experts 2 and 5 trade router rows at layer 1: layer 0 is untouched bit for bit; at layer 1 the new routing
    is the old one with 2 and 5 exchanged, so the set changes exactly at the tokens that chose one of them, and the
    router KL is KL(p || p with 2 and 5 exchanged)."""
    layer = 1

    def swap(w):
        w = w.copy()
        w[list(SWAP)] = w[list(SWAP[::-1])]
        return w

    model, _ = moebench.load(base)
    changed, _ = moebench.load(_edited(base, tmp_path / "swapped", layer, swap))
    d = drift([model, changed], _prompts(), names=["base", "swapped"])
    f = d.frame()
    before = f[f["layer"] < layer]
    assert (before["jaccard"] == 1).all() and (before["router_kl"] == 0).all() and (before["moved"] == 0).all()

    ref = d.routings["base"]
    ids, probs = ref.ids[:, layer], ref.probs[:, layer].astype(np.float64)
    one_of_them = np.isin(ids, SWAP).sum(-1) == 1
    assert one_of_them.any() and not one_of_them.all()  # the test bites both ways
    at = f[f["layer"] == layer]
    assert np.array_equal(at["set_change"].to_numpy(), one_of_them)
    expected_ids = np.where(ids == SWAP[0], SWAP[1], np.where(ids == SWAP[1], SWAP[0], ids))
    assert np.array_equal(np.sort(d.routings["swapped"].ids[:, layer], -1), np.sort(expected_ids, -1))
    swapped = probs.copy()
    swapped[:, list(SWAP)] = swapped[:, list(SWAP[::-1])]
    expected_kl = (probs * (np.log(probs) - np.log(swapped))).sum(-1)
    np.testing.assert_allclose(at["router_kl"].to_numpy(), expected_kl, atol=1e-5)
    assert d.by_layer().set_index("layer").loc[layer, "set_changes"] == one_of_them.sum()
    experts = d.by_expert()
    moved = experts[(experts["layer"] == layer) & experts["expert"].isin(SWAP)]
    assert moved["lost"].sum() == moved["gained"].sum() == one_of_them.sum()  # every change is 2 <-> 5
    assert (experts.loc[~experts["expert"].isin(SWAP) & (experts["layer"] == layer), ["lost", "gained"]] == 0)\
        .all().all()


def test_a_scaled_last_router_changes_probabilities_not_experts(base, tmp_path):
    """Layer 3's router logits times 1.5 (its weight scaled): the order of the experts stays, so no set changes;
    the router KL is KL(softmax(z) || softmax(1.5 z)) from the recorded logits z; nothing before layer 3 moves."""
    last = LAYERS - 1
    model, _ = moebench.load(base)
    scaled, _ = moebench.load(_edited(base, tmp_path / "scaled", last, lambda w: 1.5 * w))
    prompts = _prompts(1, 48, seed=1)
    d = drift([model, scaled], prompts, names=["base", "scaled"])
    f = d.frame()
    assert (f.loc[f["layer"] < last, "router_kl"] == 0).all()
    at = f[f["layer"] == last]
    assert (at["jaccard"] == 1).all() and not at["top1_flip"].any()
    z = np.stack([r.layers[last].router_logits for r in
                  moebench.inspect.record.Stepper(model, None, prompts[0], record=True, stop_ids=(),
                                                  max_tokens=1).prefill()]).astype(np.float64)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    lq = 1.5 * z - np.log(np.exp(1.5 * z).sum(-1, keepdims=True))
    np.testing.assert_allclose(at["router_kl"].to_numpy(), (np.exp(lp) * (lp - lq)).sum(-1), rtol=1e-3, atol=1e-7)
    assert (at["moved"] > 0).all()  # the two experts' shares change
    assert (f.loc[f["layer"] == last, "logits_kl"] > 0).all()  # and with them the next-token distribution


def test_near_ties_are_told_apart_by_the_margin():
    """Two routings that differ at one token: a near-tie when the reference's probabilities there are nearly equal
    at the top-k boundary, a real change otherwise; the stated bound decides."""
    probs = np.array([[[0.5, 0.2, 0.1999, 0.1001]], [[0.5, 0.3, 0.1, 0.1]]], np.float32)  # [T=2, L=1, E=4]
    ref = moebench.inspect.routing_files.Routing(np.array([[[0, 1]], [[0, 1]]]), (0,), probs=probs)
    other = moebench.inspect.routing_files.Routing(np.array([[[0, 2]], [[0, 2]]]), (0,), probs=probs)
    d = drift([ref, other], [[1, 2]], names=["ref", "other"])
    f = d.frame()
    assert f["set_change"].tolist() == [True, True]
    assert f["near_tie"].tolist() == [True, False] and f["real"].tolist() == [False, True]
    np.testing.assert_allclose(f["margin"], [1e-4, 0.2], rtol=1e-3)
    assert drift([ref, other], [[1, 2]], names=["ref", "other"], tie_margin=0.5).frame()["near_tie"].all()


def test_worst_tokens_of_one_variant_point_at_their_token_in_context():
    """worst(variant=) ranks that variant's changes alone; each row's index is its token's place in the fed tokens,
    shown in [brackets] with neighbours from its own sequence only."""
    Routing = moebench.inspect.routing_files.Routing
    ids = np.tile([0, 1], (5, 1, 1))  # 5 tokens, one layer, top-2
    at_3, at_1 = ids.copy(), ids.copy()
    at_3[3, 0], at_1[1, 0] = [2, 3], [0, 4]
    d = drift([Routing(ids, (0,)), Routing(at_3, (0,)), Routing(at_1, (0,))], [[10, 11, 12], [13, 14]],
              names=["ref", "a", "b"])
    worst = d.worst(1, context=1, variant="a").iloc[0]
    assert (worst["variant"], worst["index"], worst["seq"], worst["pos"]) == ("a", 3, 1, 0)
    assert worst["context"] == "[13]14"  # token 12 belongs to the first sequence
    assert d.worst(1, variant="b")["index"].tolist() == [1]
    assert d.context(1, 1) == "10[11]12"
    with pytest.raises(MoebenchError, match="variant must be one of"):
        d.worst(variant="ref")
    with pytest.raises(MoebenchError, match=r"index must be in 0\.\.4, got 5"):
        d.context(5)
    with pytest.raises(MoebenchError, match="next-token logits need two model variants"):
        d.next_tokens("a", 0)

def test_routing_files_compare_like_models(base, tmp_path):
    """A model's routing written as SGLang bytes and read back compares as the model itself: zero set drift."""
    model, _ = moebench.load(base)
    prompts = _prompts()
    routing = teacher_force(model, prompts)
    path = write_routing(routing, tmp_path / "server.b64", "sglang-b64")
    served = read_routing(path, layers=LAYERS, top_k=2)
    d = drift([model, served], prompts, names=["moebench", "server"])
    f = d.frame()
    assert (f["jaccard"] == 1).all() and not f["top1_flip"].any()
    assert f["router_kl"].isna().all() and f["logits_kl"].isna().all()  # the file has ids only
    short = read_routing(write_routing(routing, tmp_path / "short.npy", "sglang"))
    with pytest.raises(MoebenchError, match="80 routed tokens, but the prompts hold 40"):
        drift([model, short], prompts[:1], names=["m", "s"])


def test_stepwise_fused_and_fallback_route_alike_in_float32(base):
    """Fused vs fallback token by token (the decode step): on CPU in float32 the same top-k everywhere but ties."""
    model, _ = moebench.load(base)
    d = drift([moebench.inspect.drift.Variant("fused", model=model, fused=True),
               moebench.inspect.drift.Variant("fallback", model=model, fused=False)], _prompts(1, 16))
    assert isinstance(d, Drift) and len(d.frame()) == 16 * LAYERS
    assert d.frame()["real"].sum() == 0


def test_bad_input_is_named(base):
    model, _ = moebench.load(base)
    with pytest.raises(MoebenchError, match="at least two variants"):
        drift([model], [[1, 2]])
    with pytest.raises(MoebenchError, match="names must differ"):
        drift([model, model], [[1, 2]])
    with pytest.raises(MoebenchError, match="tie_margin"):
        drift([model, model], [[1, 2]], names=["a", "b"], tie_margin=-1)
    with pytest.raises(MoebenchError, match="prompt 0 is text but no variant has a tokenizer"):
        drift([model, model], "hello", names=["a", "b"])
    with pytest.raises(MoebenchError, match="nowhere: neither a checkpoint folder nor a routing file"):
        drift([model, "nowhere"], [[1, 2]])
    with pytest.raises(MoebenchError, match="variant must be one of"):
        drift([model, model], [[1, 2]], names=["a", "b"]).cell("a", 0, 0)


# -- moebench against transformers, float32, every family ---------------------------------------------------------
def _qwen2_moe(folder):
    from models.hf_reference import save_hf_checkpoint
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return save_hf_checkpoint(folder, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                              qwen2_moe_config(num_hidden_layers=3, num_experts=16, num_experts_per_tok=4))


def _qwen3_moe(folder):
    from models.hf_reference import save_hf_checkpoint
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return save_hf_checkpoint(folder, Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=256, moe_intermediate_size=64, num_experts=32, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1e6))


def _olmoe(folder):
    from models.hf_reference import save_hf_checkpoint
    from transformers import OlmoeConfig, OlmoeForCausalLM

    return save_hf_checkpoint(folder, OlmoeConfig, OlmoeForCausalLM, dict(
        vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False, rms_norm_eps=1e-5,
        max_position_embeddings=256, rope_theta=10000.0, clip_qkv=None, eos_token_id=None))


def _gpt_oss(folder):
    from models.hf_reference import save_hf_checkpoint
    from transformers import GptOssConfig, GptOssForCausalLM

    return save_hf_checkpoint(folder, GptOssConfig, GptOssForCausalLM, dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=96, num_local_experts=16, num_experts_per_tok=4, sliding_window=8,
        rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=None))


HYBRID = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
              shared_expert_intermediate_size=64, rms_norm_eps=1e-6, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, tie_word_embeddings=False)


def _qwen3_next(folder):
    from models.hf_reference import save_hf_checkpoint
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return save_hf_checkpoint(folder, Qwen3NextConfig, Qwen3NextForCausalLM, dict(**HYBRID, intermediate_size=64))


def _qwen3_5_moe(folder):
    from models.hf_reference import save_hf_checkpoint
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    return save_hf_checkpoint(folder, Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, HYBRID)


FAMILIES = [_qwen2_moe, _qwen3_moe, _olmoe, _gpt_oss, _qwen3_next, _qwen3_5_moe]


@pytest.mark.parametrize("family", FAMILIES, ids=[f.__name__[1:] for f in FAMILIES])
def test_moebench_routes_as_transformers(tmp_path, family):
    pytest.importorskip("torch", reason="transformers' model runs on PyTorch (dev dependency)")
    folder = family(tmp_path / "hf")
    model, _ = moebench.load(folder)
    prompts = _prompts(2, 64, seed=4)
    hf = transformers_routing(folder, prompts)
    assert hf.layers == tuple(sorted(model.moe_blocks()))
    d = drift([model, hf], prompts, names=["moebench", "transformers"])
    f = d.frame()
    assert f["real"].sum() == 0, d.worst(5)  # every difference is a flagged near-tie
    assert (f.loc[f["set_change"] | f["top1_flip"], "margin"] < TIE_MARGIN).all()
    assert np.abs(d.routings["moebench"].probs - hf.probs).max() < 1e-4
    assert f["logits_kl"].max() < 1e-6
    assert (f["jaccard"] == 1).mean() > 0.95  # near-ties are rare, not the rule


def test_a_selection_biased_router_reports_bias_made_choices(tmp_path):
    """GLM's grouped sigmoid router: drift judges near-ties on what it chose by (the score plus its bias), counts
    the experts the bias alone put in, flags changes of such a choice, and gives no router KL (its scores are no
    distribution)."""
    from moebench.tools.presets import write_random

    folders = [write_random(tmp_path / name, "glm4-moe-tiny", bits=bits, group_size=64, dtype="float32",
                            progress=False) for name, bits in (("8bit", 8), ("3bit", 3))]
    result = drift([str(f) for f in folders], ["def f(x):\n    return x * 2 + 1"])
    frame = result.frame()
    assert frame["router_kl"].isna().all() and (frame["bias_made"] >= 0).all()
    assert frame["bias_made"].sum() > 0 and frame["bias_change"].any()
    assert (frame.loc[frame["bias_change"], "set_change"] | frame.loc[frame["bias_change"], "top1_flip"]).all()
    routing = result.routings[result.names[1]]
    made = routing.bias_made()
    assert made.shape == routing.ids.shape and made.sum(-1).reshape(-1).tolist() == \
        frame["bias_made"].astype(int).tolist()
    assert "chosen by the selection bias alone" in repr(result)
    assert "bias_changes" in result.by_layer()
