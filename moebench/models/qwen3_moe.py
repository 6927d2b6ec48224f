"""Qwen3-MoE (Qwen3-30B-A3B and relatives): what differs from Qwen2-MoE, and nothing else.

- attention: no q/k/v bias (unless attention_bias), an RMSNorm over each head of q and of k before
  RoPE, and an explicit head_dim;
- MoE block: no shared expert; the top-k probabilities are renormalised when norm_topk_prob (true for
  Qwen3-30B-A3B). Routing, experts and recording are Qwen2-MoE's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..errors import ConfigError
from . import qwen2_moe
from .args import ModelArgs
from .declare import PER_HEAD
from .layers import RMSNorm


def config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fields this family's config.json may leave out, as transformers' Qwen3MoeConfig defaults them."""
    return {"qkv_bias": False if cfg.get("attention_bias") is None else cfg["attention_bias"]}


class Attention(qwen2_moe.Attention):
    """Attention with per-head RMSNorm on q and k."""

    qk_norm = PER_HEAD

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def heads(self, q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super().heads(q, k, v)
        return self.q_norm(q), self.k_norm(k), v


class Model(qwen2_moe.Model):
    def __init__(self, args: ModelArgs):
        if args.shared_expert_intermediate_size:
            raise ConfigError("qwen3_moe config sets shared_expert_intermediate_size, but Qwen3-MoE has no shared "
                              "expert")
        super().__init__(args, Attention)
