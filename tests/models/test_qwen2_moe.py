"""The Qwen2-MoE model against the two references users trust: HF transformers and mlx-lm.

HF: tiny random checkpoints saved by transformers itself (float32, CPU), over MHA/GQA, norm_topk_prob,
decoder_sparse_step with an mlp_only_layers entry, and tied/untied embeddings. mlx-lm: the same
quantized checkpoint written by moebench.tools.writer, loaded by mlx_lm.utils.load_model.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hf_reference import save_hf_checkpoint

import moebench
from moebench.decode.cache import make_cache
from moebench.decode.loop import Session, generate
from moebench.tools.writer import qwen2_moe_config

PROMPT_LEN = 16
GREEDY_STEPS = 32
TOLERANCE = 1e-4

HF_CONFIGS = {
    "mha-untied-head-dim": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=64),  # heads*64 != hidden
    "gqa-normtopk": dict(num_attention_heads=4, num_key_value_heads=2, norm_topk_prob=True),
    "sparse-step2-mlp-only": dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3],
                                  num_key_value_heads=1, norm_topk_prob=True),
    "gqa-tied": dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
}


def _prompt(seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, PROMPT_LEN).tolist()


def save_qwen2_moe(folder: Path, overrides: dict, seed: int = 0) -> Path:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return save_hf_checkpoint(folder, Qwen2MoeConfig, Qwen2MoeForCausalLM, qwen2_moe_config(**overrides), seed)


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def hf_pair(request, tmp_path_factory):
    """(HF model, moebench model, config overrides) on one checkpoint saved by transformers."""
    from transformers import Qwen2MoeForCausalLM

    folder = save_qwen2_moe(tmp_path_factory.mktemp("hf") / request.param, HF_CONFIGS[request.param])
    hf = Qwen2MoeForCausalLM.from_pretrained(folder, dtype="float32").eval()
    ours, _ = moebench.load(folder)
    return hf, ours, request.param


def test_hf_checkpoint_layout_is_what_the_loader_expects(hf_pair):
    _, ours, name = hf_pair
    args = ours.args
    overrides = HF_CONFIGS[name]
    assert args.num_key_value_heads == overrides.get("num_key_value_heads", 2)
    assert args.head_dim == overrides.get("head_dim", args.hidden_size // args.num_attention_heads)
    assert args.norm_topk_prob == overrides.get("norm_topk_prob", False)
    assert args.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert ("lm_head" in ours) == (not args.tie_word_embeddings)
    expected_moe = [i for i in range(args.num_hidden_layers) if args.is_moe_layer(i)]
    assert sorted(ours.moe_blocks()) == expected_moe
    if name == "sparse-step2-mlp-only":
        assert expected_moe == [1]  # layer 3 is listed as mlp-only, layers 0 and 2 miss the step


def test_prompt_logits_match_hf(hf_pair):
    import torch

    hf, ours, _ = hf_pair
    ids = _prompt(0, ours.args.vocab_size)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits.numpy()
    got = np.array(ours(mx.array([ids])))
    assert got.shape == expected.shape == (1, PROMPT_LEN, ours.args.vocab_size)
    assert np.abs(got - expected).max() <= TOLERANCE
    assert np.abs(expected).max() > 0.5  # the comparison is not between two near-zero tensors


def test_greedy_decode_with_cache_matches_hf_generate(hf_pair):
    import torch

    hf, ours, _ = hf_pair
    ids = _prompt(1, ours.args.vocab_size)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS,
                          do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
                          return_dict_in_generate=True)
    expected_tokens = out.sequences[0, PROMPT_LEN:].tolist()
    expected_logits = torch.stack(out.logits, dim=1)[0].numpy()
    result = generate(ours, ids, GREEDY_STEPS)
    assert result.token_ids == expected_tokens
    assert len(set(expected_tokens)) > 1  # a degenerate repeat would prove little

    # the cached decode path step by step, fed HF's tokens: logits agree at every position
    cache = make_cache(len(ours.layers))
    logits = [np.array(ours(mx.array([ids]), cache)[0, -1])]
    for tok in expected_tokens[:-1]:
        logits.append(np.array(ours(mx.array([[tok]]), cache)[0, -1]))
    assert np.abs(np.stack(logits) - expected_logits).max() <= TOLERANCE


def test_missing_rope_theta_uses_the_hf_default(tmp_path):
    """A config without rope_theta means what transformers makes of it (its default base)."""
    import json

    import torch
    from transformers import Qwen2MoeForCausalLM

    folder = save_qwen2_moe(tmp_path / "hf", {})
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_theta", None)
    cfg.pop("rope_parameters", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    hf = Qwen2MoeForCausalLM.from_pretrained(folder, dtype="float32").eval()
    ours, _ = moebench.load(folder)
    ids = _prompt(2, ours.args.vocab_size)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits.numpy()
    assert np.abs(np.array(ours(mx.array([ids]))) - expected).max() <= TOLERANCE


# ---- mlx-lm -----------------------------------------------------------------------------------------

MLX_LM_QUANT = [(4, 64), (4, 32), (8, 64), (8, 32)]


@pytest.fixture
def fused_off():
    with moebench.fused_moe(False):
        yield


def assert_matches_mlx_lm(folder: Path, fused: bool = False) -> None:
    """Prompt logits, then 8 cached single-token steps of a decode Session, against mlx-lm's qwen2_moe on the
    same folder.

    With the fused switch off every MoE call runs gather_qmm; on, the decode steps run the fused path.
    """
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    reference, _ = load_model(folder)
    ours, _ = moebench.load(folder)
    ids = _prompt(3, ours.args.vocab_size)
    assert np.abs(np.array(ours(mx.array([ids]))) - np.array(reference(mx.array([ids])))).max() <= TOLERANCE

    moebench.set_fused_moe(fused)
    ref_cache, session = make_prompt_cache(reference), Session(ours)
    ref_step = reference(mx.array([ids]), cache=ref_cache)[0, -1]
    step = session.build(mx.array(ids, dtype=mx.uint32))
    for _ in range(8):
        session.take(step)
        assert np.abs(np.array(step.logits) - np.array(ref_step)).max() <= TOLERANCE
        tok = int(mx.argmax(ref_step))
        ref_step = reference(mx.array([[tok]]), cache=ref_cache)[0, -1]
        step = session.build(mx.array([tok], dtype=mx.uint32))
    session.take(step)
    assert np.abs(np.array(step.logits) - np.array(ref_step)).max() <= TOLERANCE
    moe_counts = moebench.dispatch(ours)["moe"]
    assert sorted(moe_counts) == sorted(ours.moe_blocks())
    for counts in moe_counts.values():
        assert sum(counts["fused"].values()) == (8 if fused else 0)
        assert counts["fallback"] == (1 if fused else 9)  # the prompt, and every step when off


@pytest.mark.parametrize("bits,group_size", MLX_LM_QUANT)
def test_quantized_logits_match_mlx_lm(make_checkpoint, fused_off, bits, group_size):
    folder = make_checkpoint(f"q{bits}g{group_size}", seed=bits + group_size, bits=bits, group_size=group_size)
    assert set(moebench.load(folder)[0].load_info.bits.values()) == {f"{bits}-bit g{group_size}"}
    assert_matches_mlx_lm(folder)


def test_fused_decode_path_matches_mlx_lm(quantized_checkpoint, fused_off):
    assert_matches_mlx_lm(quantized_checkpoint, fused=True)


def test_mixed_precision_matches_mlx_lm(make_checkpoint, fused_off):
    """8-bit routed down_proj under a 4-bit config: both loaders read each tensor's width from its shape."""
    folder = make_checkpoint("mixed", seed=9, bits=lambda name: 8 if ".experts." in name and "down_proj" in name else 4)
    assert moebench.load(folder)[0].load_info.bits["mlp.switch_mlp.down_proj"] == "8-bit g64"
    assert_matches_mlx_lm(folder)
