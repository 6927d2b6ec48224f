"""DeepSeek-V3 / V3.1 and Kimi-K2 (`deepseek_v3`): what differs from GLM-4.x MoE, and nothing else.

- attention: multi-head latent attention. q through a low-rank q_a_proj, its RMSNorm and q_b_proj (or one q_proj
  without q_lora_rank); each head's query is qk_nope_head_dim unrotated dims and qk_rope_head_dim rotated ones. One
  projection kv_a_proj_with_mqa gives a compressed latent of kv_lora_rank (RMS-normed) and one rotary key shared
  by every head; the cache holds those two, not per-head keys and values. A head's key and value come from the
  latent through kv_b_proj, held here as mlx-lm holds it, split and absorbed: `embed_q` [H, rank, nope] maps a
  query into the latent space, `unembed_out` [H, v, rank] maps the attended latent to the head's value. A decode
  step attends in the latent space (q_nope embedded, keys and values the latent itself), a prompt with each
  head's keys and values expanded: the same sums in another order. Rotary interleaved (rope_interleave) with YaRN,
  and the softmax scale (nope + rope)^-0.5 times YaRN's mscale(mscale_all_dim) squared;
- Kimi-K2 (`kimi_k2`) is this architecture under its own model_type, as mlx-lm reads it;
- router, routed and shared experts, dense first layers: GLM's (moebench.models.glm4_moe), with DeepSeek-V3's
  groups (8 groups, the best 4 kept);
- stored: the hub's and transformers' folders keep kv_b_proj whole ([H (nope + v), rank], split here, a quantized
  one requantized as mlx-lm does); mlx-lm's conversions store embed_q and unembed_out; the multi-token-prediction
  layer after the last is left out.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import CheckpointError, ConfigError
from . import glm4_moe, qwen2_moe
from .args import ModelArgs
from .declare import LatentAttentionSpec
from .family import Family, Preset, StoredTensors
from .hooks import Record
from .layers import HeadLinear, Linear, RMSNorm
from .rotary import yarn

LORA_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's epsilon (transformers' and mlx-lm's default)
KV_B = re.compile(r"^(?P<at>model\.layers\.\d+\.self_attn)\.kv_b_proj\.(?P<part>weight|scales|biases)$")


@dataclass(frozen=True)
class LatentArgs:
    """What only DeepSeek-V3 computes with: its router's settings and its latent attention's widths."""

    router: glm4_moe.RouterArgs
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True


def config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """GLM's MoE fields, attention_bias for the latent projections and o_proj, and the rotary width as head_dim."""
    bias = cfg.get("attention_bias")
    return {**glm4_moe.moe_config_fields(cfg), "qkv_bias": False if bias is None else bias,
            "head_dim": cfg.get("qk_rope_head_dim")}


def own_fields(cfg: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    def width(key: str, optional: bool = False) -> int | None:
        value = cfg.get(key)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
        return value

    if cfg.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"{source}: field 'moe_layer_freq' is {cfg['moe_layer_freq']!r}; DeepSeek-V3 makes every "
                          "layer after the dense ones MoE (1)")
    interleave = cfg.get("rope_interleave", True)
    if not isinstance(interleave, bool):
        raise ConfigError(f"{source}: field 'rope_interleave' must be true or false, got {interleave!r}")
    rope = width("qk_rope_head_dim")
    if rope % 2:
        raise ConfigError(f"{source}: field 'qk_rope_head_dim' must be even for rotary embeddings, got {rope}")
    latent = LatentArgs(glm4_moe.router_args(cfg, source), width("kv_lora_rank"), width("q_lora_rank", True),
                        width("qk_nope_head_dim"), rope, width("v_head_dim"), interleave)
    return {"family_args": latent}


def kv_b_split(store: StoredTensors, args: ModelArgs) -> ModelArgs:
    """Each layer's kv_b_proj [H (nope + v), rank] as embed_q [H, rank, nope] and unembed_out [H, v, rank]; a
    quantized one dequantized, split and requantized at its own bits and group size, as mlx-lm's sanitize does;
    the prediction layers after the last left out. A kv_b_proj of the wrong shape is a CheckpointError naming it."""
    args = glm4_moe.without_prediction_layers(store, args)
    mla = args.family_args
    heads, nope, v_dim, rank = args.num_attention_heads, mla.qk_nope_head_dim, mla.v_head_dim, mla.kv_lora_rank
    stored = {}
    for name in store.names():
        if (m := KV_B.match(name)) is not None:
            stored.setdefault(m["at"], {})[m["part"]] = name
    for at, parts in stored.items():
        where = store.where(parts["weight"])
        w = store.take(parts["weight"])
        quant = None
        if "scales" in parts:
            scales, biases = store.take(parts["scales"]), store.take(parts["biases"]) if "biases" in parts else None
            bits, group = w.shape[-1] * 32 // rank, rank // scales.shape[-1]
            w, quant = mx.dequantize(w, scales, biases, group_size=group, bits=bits), (group, bits)
        if tuple(w.shape) != (heads * (nope + v_dim), rank):
            raise CheckpointError(f"{where}: {at}.kv_b_proj.weight has shape {tuple(w.shape)}, expected "
                                  f"{(heads * (nope + v_dim), rank)} (heads x (qk_nope_head_dim + v_head_dim), "
                                  "kv_lora_rank)")
        w = w.reshape(heads, nope + v_dim, rank)
        for module, matrix in (("embed_q", w[:, :nope].swapaxes(-1, -2)), ("unembed_out", w[:, nope:])):
            matrix = mx.contiguous(matrix)
            if quant is None:
                store.put(f"{at}.{module}.weight", matrix, where)
                continue
            for part, value in zip(("weight", "scales", "biases"), mx.quantize(matrix, *quant), strict=True):
                store.put(f"{at}.{module}.{part}", value, where)
    return args


class Attention(nn.Module):
    """Multi-head latent attention (see the module docstring)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        mla, d, h = args.family_args, args.hidden_size, args.num_attention_heads
        self.n_heads, self.latent = h, mla
        q_width = h * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        if mla.q_lora_rank is None:
            self.q_proj = Linear(d, q_width)
        else:
            self.q_a_proj = Linear(d, mla.q_lora_rank, bias=args.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_width)
        self.kv_a_proj_with_mqa = Linear(d, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=args.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_EPS)
        self.embed_q = HeadLinear(mla.qk_nope_head_dim, mla.kv_lora_rank, h)
        self.unembed_out = HeadLinear(mla.kv_lora_rank, mla.v_head_dim, h)
        self.o_proj = Linear(h * mla.v_head_dim, d, bias=args.qkv_bias)
        self.scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
        self.rope_theta, self.rope_factor, self._rope_freqs = args.rope_theta, 1.0, None
        scaling = args.rope_scaling
        if scaling is not None:
            inv_freq, self.rope_factor = yarn(mla.qk_rope_head_dim, args.rope_theta, scaling)
            self._rope_freqs = 1.0 / inv_freq  # mx.fast.rope's wavelengths; "_": not a parameter
            if scaling.mscale_all_dim and scaling.factor > 1:  # YaRN's softmax temperature (transformers, mlx-lm)
                self.scale *= (0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0) ** 2

    @property
    def spec(self) -> LatentAttentionSpec:
        m = self.latent
        return LatentAttentionSpec(self.n_heads, m.kv_lora_rank, m.q_lora_rank, m.qk_nope_head_dim,
                                   m.qk_rope_head_dim, m.v_head_dim)

    def rope(self, x: mx.array, offset) -> mx.array:
        if self.rope_factor != 1.0:  # YaRN's attention factor scales the rotated dims
            x = x * self.rope_factor
        return mx.fast.rope(x, self.latent.qk_rope_head_dim, traditional=self.latent.rope_interleave,
                            base=self.rope_theta if self._rope_freqs is None else None, scale=1.0, offset=offset,
                            freqs=self._rope_freqs)

    def __call__(self, x: mx.array, cache=None, record: Record | None = None) -> mx.array:
        b, length, _ = x.shape
        m = self.latent
        q = self.q_proj(x) if "q_proj" in self else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = mx.split(q.reshape(b, length, self.n_heads, -1).transpose(0, 2, 1, 3), [m.qk_nope_head_dim],
                                axis=-1)
        latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [m.kv_lora_rank], axis=-1)
        latent = mx.expand_dims(self.kv_a_layernorm(latent), 1)  # [B, 1, L, rank]
        k_pe = k_pe.reshape(b, length, 1, m.qk_rope_head_dim).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q_pe, k_pe = self.rope(q_pe, offset), self.rope(k_pe, offset)
        if cache is not None:
            latent, k_pe = cache.update_and_fetch(latent, k_pe)
        scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)  # the rotary part of every head's scores
        visible = self.visible(length, latent.shape[2], cache)
        if visible is not None:
            scores = mx.where(visible, scores, mx.finfo(scores.dtype).min)
        if length == 1:  # in the latent space: keys and values the latent itself
            out = mx.fast.scaled_dot_product_attention(self.embed_q(q_nope), latent, latent, scale=self.scale,
                                                       mask=scores)
            out = self.unembed_out(out)
        else:
            keys, values = self.embed_q(latent, transpose=False), self.unembed_out(latent)
            out = mx.fast.scaled_dot_product_attention(q_nope, keys, values, scale=self.scale, mask=scores)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))

    @staticmethod
    def visible(length: int, keys: int, cache) -> mx.array | None:
        """Which of `keys` cached slots each of `length` new queries sees: the cache's own mask, or causal with
        the queries last (None: every slot)."""
        mask = cache.attention_mask(length) if cache is not None else ("causal" if length > 1 else None)
        if not isinstance(mask, str):
            return mask
        queries = keys - length + mx.arange(length, dtype=mx.int32)
        return mx.arange(keys, dtype=mx.int32)[None, :] <= queries[:, None]


class Model(qwen2_moe.Model):
    def __init__(self, args: ModelArgs):
        if not isinstance(args.family_args, LatentArgs):
            raise ConfigError(f"{args.model_type}: the latent attention's widths are missing (moebench.checkpoint "
                              "reads them from config.json)")
        super().__init__(args, Attention, glm4_moe.SparseMoeBlock)


# deepseek-ai/DeepSeek-V3's config.json (V3.1 has the same shapes): 61 layers (the first 3 dense), D 7168, 128
# heads of latent attention (q rank 1536, kv rank 512, 128 + 64 dims a query, values of 128), 256 experts in 8
# groups (4 kept) top-8 of width 2048 plus a shared one, scaled by 2.5, YaRN over 4096 positions by 40
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280,
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "attention_bias": False, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}
# moonshotai/Kimi-K2-Instruct's config.json: DeepSeek-V3's architecture with 64 heads, 384 experts in one group,
# the first layer dense, scaled by 2.827, YaRN by 32 and a vocabulary of 163840
KIMI_K2 = {
    **DEEPSEEK_V3, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
    "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
    "first_k_dense_replace": 1, "vocab_size": 163840, "rope_theta": 50000.0,
    "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "factor": 32.0}, "max_position_embeddings": 131072,
    "num_nextn_predict_layers": 0, "bos_token_id": 163584, "eos_token_id": 163585,
}
FAMILY = Family(("deepseek_v3", "kimi_k2"), Model, config_fields, own_fields, rope_types=("default", "yarn"),
                stored_layout=kv_b_split, unquantized=(".mlp.gate.weight",), presets=(
    Preset("deepseek-v3", "DeepSeek-V3 / V3.1: 61 layers (the first 3 dense), D 7168, 128 heads of latent "
           "attention, 256 experts in 8 groups top-8 of width 2048 plus a shared one (671B parameters, 37B active)",
           DEEPSEEK_V3),
    Preset("deepseek-v3-12l", "DeepSeek-V3's shapes cut to 12 layers (the first 3 dense): one H200 holds it at "
           "4-bit (~70 GB)", {**DEEPSEEK_V3, "num_hidden_layers": 12}),
    Preset("kimi-k2", "Kimi-K2: DeepSeek-V3's architecture, 61 layers (the first dense), 64 heads of latent "
           "attention, 384 experts top-8 plus a shared one, vocab 163840 (1.0T parameters, 32B active)", KIMI_K2),
    Preset("deepseek-v3-tiny", "the deepseek_v3 family at the tiny preset's size: 3 layers (the first dense), D "
           "128, 4 heads of latent attention (q rank 64, kv rank 64, 32 + 16 dims a query, values of 32), 16 "
           "experts in 4 groups (2 kept) top-4 of width 64 plus a shared one, YaRN, vocab 256", {
               **DEEPSEEK_V3, "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 3,
               "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 256,
               "moe_intermediate_size": 64, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4,
               "topk_group": 2, "first_k_dense_replace": 1, "kv_lora_rank": 64, "q_lora_rank": 64,
               "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "max_position_embeddings": 4096,
               "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "factor": 4.0, "original_max_position_embeddings": 64},
               "num_nextn_predict_layers": 0, "bos_token_id": None, "eos_token_id": None}),
))
