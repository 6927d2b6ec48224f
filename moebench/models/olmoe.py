"""OLMoE (OLMoE-1B-7B-0924 / -0125): what differs from Qwen2-MoE, and nothing else.

- attention: an RMSNorm over the whole q projection and the whole k projection (all heads together, before
  they are split into heads and rotated); biases on q/k/v and o only with attention_bias (off in the
  published models); q, k and v clamped to [-clip_qkv, clip_qkv] when the config sets clip_qkv;
- MoE block: no shared expert, softmax over all experts then top-k, renormalised only with norm_topk_prob
  (off in the published models). Routing, experts and recording are Qwen2-MoE's;
- config.json: `intermediate_size` is the experts' width (there is no moe_intermediate_size), and every
  layer is a MoE layer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx

from ..errors import ConfigError
from . import qwen2_moe
from .args import ModelArgs
from .declare import WHOLE_PROJECTION, AttentionSpec
from .layers import Linear, RMSNorm


def config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """OLMoE's config.json in the fields every family reads (moebench.checkpoint.config)."""
    if cfg.get("mlp_bias"):
        raise ConfigError("config.json: field 'mlp_bias' is set; OLMoE experts with biases are not supported")
    bias = cfg.get("attention_bias")
    return {"moe_intermediate_size": cfg.get("intermediate_size"), "qkv_bias": False if bias is None else bias,
            "clip_qkv": cfg.get("clip_qkv")}


class Attention(qwen2_moe.Attention):
    """Attention with one RMSNorm over all query heads and one over all key heads, and optional clamping."""

    qk_norm = WHOLE_PROJECTION

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.q_norm = RMSNorm(self.n_heads * self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.n_kv_heads * self.head_dim, args.rms_norm_eps)
        self.o_proj = Linear(self.n_heads * self.head_dim, args.hidden_size, bias=args.qkv_bias)
        self.clip = args.clip_qkv

    def heads(self, q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (mx.clip(t, -self.clip, self.clip) for t in (q, k, v))
        return super().heads(q, k, v)

    @property
    def spec(self) -> AttentionSpec:
        return replace(super().spec, clip_qkv=self.clip)


class Model(qwen2_moe.Model):
    def __init__(self, args: ModelArgs):
        if args.shared_expert_intermediate_size:
            raise ConfigError("olmoe config sets shared_expert_intermediate_size, but OLMoE has no shared expert")
        super().__init__(args, Attention)
