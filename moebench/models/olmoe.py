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
from .family import Family, Preset
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


# allenai/OLMoE-1B-7B-0924's config.json (the -0125 release computes the same): `intermediate_size` is the expert
# width (OLMoE has no moe_intermediate_size and no shared expert); the top-8 probabilities are not renormalised;
# q_norm / k_norm are RMSNorms over the whole q and k projections
OLMOE_1B_7B = {
    "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "vocab_size": 50304, "hidden_size": 2048,
    "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 1024,
    "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "rope_theta": 10000.0,
    "rope_scaling": None, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None, "hidden_act": "silu",
    "initializer_range": 0.02, "bos_token_id": None, "eos_token_id": 50279, "pad_token_id": 1,
    "output_router_logits": False, "router_aux_loss_coef": 0.01, "torch_dtype": "bfloat16", "use_cache": True,
}
FAMILY = Family(("olmoe",), Model, config_fields, presets=(
    Preset("olmoe-1b-7b", "OLMoE-1B-7B: 16 layers, D 2048, 16 heads (MHA, head_dim 128), 64 experts top-8 of width "
           "1024 not renormalised, no shared expert, vocab 50304 (6.9B parameters, 1.3B active; ~3.9 GB at 4-bit)",
           OLMOE_1B_7B),
    Preset("olmoe-tiny", "the olmoe family at the tiny preset's size: 2 layers, D 128, GQA 4/2 with q/k norm over "
           "the whole projections, 8 experts top-2 of width 128 not renormalised, vocab 256", {
               **OLMOE_1B_7B, "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "num_experts": 8,
               "num_experts_per_tok": 2, "eos_token_id": None, "pad_token_id": None}),
))
