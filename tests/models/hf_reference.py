"""Tiny random checkpoints saved by HF transformers itself, for parity tests of every family."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np


def save_hf_checkpoint(folder: Path, config_cls, model_cls, config: dict, seed: int = 0) -> Path:
    """Build `model_cls(config_cls(**config))` with weights of useful size (std 1/sqrt(fan_in)), a router's selection
    bias (a buffer, zero at init) random too, and save_pretrained."""
    import torch

    cfg = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim == 1:  # biases are zero at init: make them matter
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change which experts are chosen
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(folder)
    return folder


def save_hub_mxfp4(float_folder: Path, folder: Path) -> Path:
    """A gpt-oss float folder saved by transformers, rewritten as openai/gpt-oss-* publish it: each expert matrix in
    [E, rows, in] orientation (gate_up's rows interleaved) quantized to mxfp4 as `_blocks` (uint8 [E, rows, in / 32,
    16]) and `_scales` (uint8 e8m0 [E, rows, in / 32]); the RoPE settings under `rope_scaling` / `rope_theta`
    and `quantization_config` {quant_method: mxfp4}, as the hub's config.json writes them. Tokenizer files copied."""
    import json
    import shutil

    import mlx.core as mx
    import numpy as np
    from safetensors.numpy import load_file, save_file

    folder.mkdir(parents=True)
    tensors = load_file(float_folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = mx.array(tensors.pop(name)).swapaxes(1, 2)  # transformers' x @ W [E, in, rows] -> [E, rows, in]
        words, scales = mx.quantize(rows, group_size=32, bits=4, mode="mxfp4")
        blocks = np.array(mx.view(words, mx.uint8)).reshape(*rows.shape[:2], -1, 16)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, np.array(scales)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((float_folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for extra in float_folder.iterdir():
        if extra.name not in ("model.safetensors", "config.json"):
            shutil.copy(extra, folder / extra.name)
    return folder


def max_error(a, b) -> float:
    """max |a - b| in float32, for MLX or numpy arrays (or lists of them)."""
    return float(np.abs(np.array(a, dtype=np.float32) - np.array(b, dtype=np.float32)).max())


def session_matches(model, ids: list[int], tokens: list[int], expected, what: str, tolerance: float,
                    fused: tuple[bool, ...] = (True, False)) -> None:
    """moebench's decode loop (a Session, under each `fused` setting) fed the prompt `ids`, then `tokens` one at a
    time: each step's logits within `tolerance` of `expected` [len(tokens) + 1, V]."""
    import moebench
    from moebench.decode.loop import Session

    for on in fused:
        with moebench.fused_moe(on, model):
            session = Session(model)
            step = session.build(mx.array(ids, dtype=mx.uint32))
            for n, want in enumerate(expected):
                session.take(step)
                error = max_error(step.logits, want)
                assert error <= tolerance, f"{what}: decode step {n} (fused {on}): {error:.3g}"
                if n < len(tokens):
                    step = session.build(mx.array([tokens[n]], dtype=mx.uint32))


def mlx_lm_cached_steps(reference, ids: list[int], steps: int) -> tuple[np.ndarray, list[int]]:
    """mlx-lm's model `reference` fed the prompt `ids`, then `steps` of its own greedy tokens one at a time over its
    cache: (its float32 logits after the prompt and after each token [steps + 1, V], the tokens fed)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(reference)
    step = reference(mx.array([ids]), cache=cache)[0, -1]
    expected, tokens = [np.array(step.astype(mx.float32))], []
    for _ in range(steps):
        tokens.append(int(mx.argmax(step)))
        step = reference(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
        expected.append(np.array(step.astype(mx.float32)))
    return np.stack(expected), tokens


def model_call_matches(model, ids: list[int], tokens: list[int], expected, what: str, tolerance: float) -> None:
    """moebench's model called directly over make_cache (no decode loop, no kernels) with the prompt `ids`, then
    `tokens` one at a time: each step's last logits within `tolerance` of `expected` [len(tokens) + 1, V]."""
    from moebench.decode.cache import make_cache

    cache = make_cache(len(model.layers))
    step = model(mx.array([ids]), cache)[0, -1]
    for n, want in enumerate(expected):
        error = max_error(step, want)
        assert error <= tolerance, f"{what}: cached step {n}: max |moebench - reference| = {error:.3g}"
        if n < len(tokens):
            step = model(mx.array([[tokens[n]]]), cache)[0, -1]
