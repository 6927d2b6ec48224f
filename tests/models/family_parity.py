"""The checks every family's tests run against the references users trust: transformers on the float folders it
saved itself, mlx-lm on the folders its own `convert` wrote from them, and moebench's fused kernels on every
decode step of a quantized folder. Each compares float32 logits over a whole prompt and then token by token over
the cache."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from hf_reference import max_error, mlx_lm_cached_steps, model_call_matches, session_matches

import moebench
from moebench.decode.loop import generate

TOLERANCE = 1e-4
STEPS = 24  # decode steps over the cache


def prompt(seed: int, vocab: int, length: int = 12) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


def convert(hf: Path, out: Path, recipe: dict) -> Path:
    """`mlx_lm.convert` of a transformers folder with `recipe` (its keyword arguments: q_bits, quant_predicate...)."""
    from mlx_lm.convert import convert as mlx_lm_convert

    mlx_lm_convert(str(hf), str(out), quantize=bool(recipe), **recipe)
    return out


def matches_transformers(folder: Path, model_cls, ids: list[int], steps: int = STEPS) -> None:
    """moebench's logits on `folder` equal transformers' within TOLERANCE over the whole prompt, its greedy tokens
    are transformers', and fed those tokens one at a time over its cache (the model call, then the decode loop
    fused and not) every step's logits equal transformers'."""
    import torch

    hf = model_cls.from_pretrained(folder, dtype="float32").eval()
    ours, _ = moebench.load(folder, dtype=mx.float32)
    with torch.no_grad():
        whole = hf(torch.tensor([ids])).logits.numpy()
        out = hf.generate(torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                          pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    assert np.abs(whole).max() > 0.5  # not two near-zero tensors
    assert max_error(ours(mx.array([ids])), whole) <= TOLERANCE, f"{folder}: whole prompt vs transformers"
    tokens = out.sequences[0, len(ids):].tolist()
    assert len(set(tokens)) > 1  # a degenerate repeat would prove little
    assert generate(ours, ids, steps).token_ids == tokens
    expected = torch.stack(out.logits, dim=1)[0].numpy()  # after the prompt, then after each token but the last
    model_call_matches(ours, ids, tokens[:-1], expected, f"{folder} vs transformers", TOLERANCE)
    session_matches(ours, ids, tokens[:-1], expected, f"{folder} vs transformers", TOLERANCE)


def matches_mlx_lm(folder: Path, ids: list[int], steps: int = STEPS) -> None:
    """moebench's float32 logits on `folder` equal mlx-lm's over the whole prompt, then token by token over both
    caches (the model call, and the decode loop with the fused kernels on)."""
    from mlx_lm.utils import load_model

    reference, _ = load_model(folder)
    ours, _ = moebench.load(folder, dtype=mx.float32)
    whole = reference(mx.array([ids])).astype(mx.float32)
    assert float(mx.abs(whole).max()) > 0.5
    assert max_error(ours(mx.array([ids])), whole) <= TOLERANCE, f"{folder}: whole prompt vs mlx-lm"
    expected, tokens = mlx_lm_cached_steps(reference, ids, steps)
    assert len(set(tokens)) > 1
    model_call_matches(ours, ids, tokens, expected, f"{folder} vs mlx-lm", TOLERANCE)
    session_matches(ours, ids, tokens, expected, f"{folder} vs mlx-lm", TOLERANCE, fused=(True,))


def fused_on_every_decode_step(folder: Path, ids: list[int], steps: int = 8) -> dict:
    """generate() on `folder` with the fused kernels on: every MoE layer ran the kernel pair on each decode step
    (the prompt, many tokens, falls back and says so), and the tokens are the fallback's. Returns the dispatch."""
    ours, _ = moebench.load(folder, dtype=mx.float32)
    backend = moebench.available_backend()
    with moebench.fused_moe(True, ours):
        fused = generate(ours, ids, steps)
    found = moebench.dispatch(ours)
    assert sorted(found["moe"]) == sorted(ours.moe_blocks())
    for layer, counts in found["moe"].items():
        assert counts["fused"] == {backend: steps - 1}, (folder, layer, counts)
        assert counts["fallback"] == 1, (folder, layer, counts)
    with moebench.fused_moe(False, ours):
        assert generate(ours, ids, steps).token_ids == fused.token_ids
    return found
