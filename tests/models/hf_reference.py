"""Tiny random checkpoints saved by HF transformers itself, for parity tests of every family."""

from __future__ import annotations

from pathlib import Path


def save_hf_checkpoint(folder: Path, config_cls, model_cls, config: dict, seed: int = 0) -> Path:
    """Build `model_cls(config_cls(**config))` with weights of useful size (std 1/sqrt(fan_in)) and save_pretrained."""
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
    model.save_pretrained(folder)
    return folder
