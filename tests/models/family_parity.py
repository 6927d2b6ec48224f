"""The checks every family's tests run against the references users trust: transformers on the float folders it
saved itself, mlx-lm on the folders its own `convert` wrote from them, and moebench's fused kernels on every
decode step of a quantized folder. Each compares float32 logits over a whole prompt and then token by token over
the cache."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
from byte_tokenizer import write_byte_tokenizer
from hf_reference import max_error, mlx_lm_cached_steps, model_call_matches, save_hf_checkpoint, session_matches

import moebench
from moebench.decode.loop import generate

TOLERANCE = 1e-4
STEPS = 24  # decode steps over the cache


def recipes(group_size: int = 64) -> dict[str, dict]:
    """The mlx_lm.convert recipes the issue names (4-, 6- and 3-bit, mixed_3_6) at one group size."""
    return {"4bit": dict(q_bits=4, q_group_size=group_size), "6bit": dict(q_bits=6, q_group_size=group_size),
            "3bit": dict(q_bits=3, q_group_size=group_size),
            "mixed_3_6": dict(quant_predicate="mixed_3_6", q_group_size=group_size)}


def prompt(seed: int, vocab: int, length: int = 12) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


def made_once(make: Callable[[str], Path]) -> Callable[[str], Path]:
    """make(key), made once a key: a module fixture's read-only folders."""
    made: dict[str, Path] = {}

    def get(key: str) -> Path:
        if key not in made:
            made[key] = make(key)
        return made[key]

    return get


def save_published(folder: Path, config_cls, model_cls, config: dict) -> Path:
    """transformers' tiny model saved (hf_reference.save_hf_checkpoint) with the byte tokenizer, its rotary settings
    at the top level as the published config.json files write them (transformers 5 writes them inside
    `rope_parameters`; mlx-lm 0.32 reads them at the top level)."""
    save_hf_checkpoint(folder, config_cls, model_cls, config)
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = dict(cfg["rope_parameters"])
    cfg["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        cfg["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    kind = rope.pop("rope_type", "default")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    path.write_text(json.dumps(cfg, indent=2))
    write_byte_tokenizer(folder)
    return folder


def published(tmp, tag: str, config_cls, model_cls, base: dict, configs: dict[str, dict]) -> Callable[[str], Path]:
    """Each of `configs` (changes to `base`) saved by transformers as published (save_published) on first use, in a
    folder of `tmp` (a tmp_path_factory) named after `tag`: its folder by the config's name."""
    return made_once(lambda name: save_published(tmp.mktemp(f"{tag}-{name}") / "hf", config_cls, model_cls,
                                                 {**base, **configs[name]}))


def conversions(tmp, tag: str, source: Callable[[], Path], recipes: dict[str, dict]) -> Callable[[str], Path]:
    """`mlx_lm.convert` of the folder `source()` gives by each of `recipes` on first use: its folder by recipe."""
    return made_once(lambda recipe: convert(source(), tmp.mktemp(f"{tag}-{recipe}") / "mlx", recipes[recipe]))


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


def matches_mlx_lm(folder: Path, ids: list[int], steps: int = STEPS):
    """moebench's float32 logits on `folder` equal mlx-lm's over the whole prompt, then token by token over both
    caches (the model call, and the decode loop with the fused kernels on); returns moebench's model, its dispatch
    counts holding those steps."""
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
    return ours


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


def converted_matches_and_runs_fused(folder: Path, vocab: int) -> dict:
    """An mlx_lm.convert folder: mlx-lm's logits, and the fused MoE kernels on every decode step."""
    ids = prompt(1, vocab)
    matches_mlx_lm(folder, ids)
    return fused_on_every_decode_step(folder, ids)


def make_random_loads_in_mlx_lm(folder: Path, preset: str, vocab: int, group_size: int = 64) -> None:
    """make-random's tiny preset is mlx-lm's layout: mlx-lm loads it and computes moebench's logits."""
    from moebench.tools.presets import write_random

    write_random(folder, preset, bits=4, group_size=group_size, dtype="float32", progress=False)
    matches_mlx_lm(folder, prompt(2, vocab), steps=4)
