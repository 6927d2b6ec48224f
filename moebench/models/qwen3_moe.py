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
from .family import Family, Preset
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


QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "qkv_bias": False, "max_position_embeddings": 40960, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}

# the largest of either family: more than one device holds them (moebench.models.sharding)
QWEN3_235B_A22B = {**QWEN3_30B_A3B, "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
                   "intermediate_size": 12288, "moe_intermediate_size": 1536}
FAMILY = Family(("qwen3_moe",), Model, config_fields, presets=(
    Preset("qwen3-30b-a3b", "Qwen3-30B-A3B: 48 layers, D 2048, 128 experts top-8 of width 768, no shared expert "
           "(qwen3_moe family; ~17 GB at 4-bit)", QWEN3_30B_A3B),
    Preset("qwen3-30b-a3b-2l", "Qwen3-30B-A3B's widths and vocabulary with 2 layers: real per-layer shapes on a "
           "CPU", {**QWEN3_30B_A3B, "num_hidden_layers": 2}),
    Preset("qwen3-235b-a22b", "Qwen3-235B-A22B: 94 layers, D 4096, 64 query heads over 4 kv heads, 128 experts "
           "top-8 of width 1536 (~130 GB at 4-bit: for sharding over devices)", QWEN3_235B_A22B),
    Preset("qwen3-tiny", "the qwen3_moe family at the tiny preset's size: 2 layers, D 128, GQA 4/2 with q/k norm, "
           "8 experts top-2 of width 128 renormalised, vocab 256", {
               **QWEN3_30B_A3B, "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
               "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
               "max_position_embeddings": 4096, "bos_token_id": None, "eos_token_id": None}),
))
