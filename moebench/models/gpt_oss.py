"""gpt-oss (gpt-oss-20b / -120b): what differs from Qwen2-MoE, and nothing else.

- router: a Linear with a bias; the top-k logits, then a softmax over those k. Computed as the softmax over all
  experts renormalised over the k selected (the same numbers: exp(l_i) / sum over the k of exp(l_j)), so
  `router_probs` is the softmax over all experts and interventions act as on every family. The recorded
  `router_logits` are the bias-added logits (what the top-k is taken of);
- experts: gate, up and down with a bias each, and the clamped SwiGLU: g = min(gate, limit), u = clip(up, -limit,
  limit), out = (u + 1) * g * sigmoid(alpha * g) (config `swiglu_limit`, `swiglu_alpha`); no shared expert.
  `expert_out` is each expert's output with its down bias;
- attention: biases on q, k, v and o; a learned logit per head (`sinks`) that joins each softmax's denominator
  and attends to nothing; on the layers config `layer_types` marks 'sliding_attention', a window of
  `sliding_window` positions (the token's own included); YaRN rotary (config `rope_parameters` / `rope_scaling`,
  as transformers computes its frequencies and attention factor). A windowed layer keeps its whole cache and masks
  what lies outside the window: exact, and every cache moebench has works unchanged;
- config.json: `intermediate_size` is the experts' width, `num_local_experts` their count.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx

from ..errors import ConfigError
from . import qwen2_moe
from .args import ModelArgs
from .declare import CLAMPED_SWIGLU, TOPK_THEN_SOFTMAX, AttentionParts, AttentionSpec, MoeSpec
from .family import Family, Preset
from .gpt_oss_layouts import to_moebench_names
from .layers import ColumnShard, Linear
from .rotary import yarn
from .switch import BiasedSwitchLinear, ExpertShard, SwitchGLU

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (FULL, SLIDING)  # what moebench.checkpoint.config accepts in `layer_types` for this family
ROPE_TYPES = ("default", "yarn")  # and as rope_type
# transformers' GptOssConfig defaults, for a config.json that leaves them out
DEFAULTS = {"rope_theta": 150_000.0, "swiglu_limit": 7.0, "swiglu_alpha": 1.702}
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's config.json in the fields every family reads (moebench.checkpoint.config)."""
    bias = cfg.get("attention_bias")
    fields = {"moe_intermediate_size": cfg.get("intermediate_size"), "qkv_bias": True if bias is None else bias,
              "norm_topk_prob": True}  # the softmax over the k selected logits: the top-k probabilities renormalised
    ropes = [r for r in (cfg.get("rope_parameters"), cfg.get("rope_scaling")) if isinstance(r, dict)]
    if not ropes:
        fields["rope_parameters"] = DEFAULT_ROPE
    for key, default in DEFAULTS.items():
        given = cfg.get(key)
        if key == "rope_theta" and given is None:  # transformers 5 writes it inside rope_parameters
            given = next((r["rope_theta"] for r in ropes if r.get("rope_theta") is not None), None)
        fields[key] = default if given is None else given
    if cfg.get("layer_types") is None and isinstance(cfg.get("num_hidden_layers"), int):
        fields["layer_types"] = [SLIDING if i % 2 == 0 else FULL for i in range(cfg["num_hidden_layers"])]
    return fields


class Attention(qwen2_moe.Attention):
    """Attention with biases everywhere, per-head sinks, an optional sliding window and YaRN rotary."""

    def __init__(self, args: ModelArgs, window: int | None = None):
        super().__init__(args)
        self.o_proj = Linear(self.n_heads * self.head_dim, args.hidden_size, bias=args.qkv_bias)
        self.sinks = mx.zeros((self.n_heads,))
        self.window = window
        if args.rope_scaling is None:
            self._rope_freqs, self.rope_factor = None, 1.0
        else:
            inv_freq, self.rope_factor = yarn(self.head_dim, args.rope_theta, args.rope_scaling)
            self._rope_freqs = 1.0 / inv_freq  # mx.fast.rope's freqs (wavelength / 2 pi); "_": not a parameter

    @property
    def spec(self) -> AttentionSpec:
        return replace(super().spec, window=self.window, sinks=True, scaled_rope=self._rope_freqs is not None)

    def parts(self) -> AttentionParts:
        """The projections, the sinks of the heads this process computes and, with YaRN, its rotation speeds (the
        reciprocals of the wavelengths handed to mx.fast.rope, which turns by their reciprocals too) and attention
        factor."""
        scaled = None if self._rope_freqs is None else 1.0 / self._rope_freqs.astype(mx.float32)
        return replace(super().parts(), scaled_frequencies=scaled, rope_factor=self.rope_factor,
                       sinks=self.head_sinks())

    def head_sinks(self) -> mx.array:
        """The sinks of the heads this process computes: all of them, or under tensor parallelism (o_proj a
        ColumnShard over this rank's heads) this rank's span; every rank loads the whole [n_heads] vector."""
        sinks = self["sinks"]
        if not isinstance(self.o_proj, ColumnShard):
            return sinks
        first = self.o_proj.first // self.head_dim
        return sinks[first:first + self.n_heads]

    def rope(self, x: mx.array, offset) -> mx.array:
        if self.rope_factor != 1.0:  # transformers scales cos and sin: q and k each by the factor
            x = x * self.rope_factor
        base = self.rope_theta if self._rope_freqs is None else None
        return mx.fast.rope(x, self.head_dim, traditional=False, base=base, scale=1.0, offset=offset,
                            freqs=self._rope_freqs)

    def mask(self, length: int, keys: int, offset, cache) -> mx.array | str | None:
        """Full layers: causal (the cache's own mask). Windowed ones: query i, at position offset + i, sees the
        cache slots p (slot p holds position p) with offset + i - window < p <= offset + i."""
        if self.window is None:
            return super().mask(length, keys, offset, cache)
        query = offset + mx.arange(length, dtype=mx.int32)[:, None]
        slot = mx.arange(keys, dtype=mx.int32)[None, :]
        return (slot <= query) & (slot > query - self.window)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask,
                                                   sinks=self.head_sinks().astype(q.dtype))


def clamped_swiglu(gate: mx.array, up: mx.array, limit: float, alpha: float) -> mx.array:
    """gpt-oss's activation: gate clamped above, up clamped both sides at `limit`, (up + 1) * gate *
    sigmoid(alpha * gate)."""
    gate = mx.minimum(gate, limit)
    up = mx.clip(up, -limit, limit)
    return (up + 1) * gate * mx.sigmoid(alpha * gate)


def _biased(experts: SwitchGLU, in_features: int, hidden_features: int, num_experts: int) -> None:
    experts.gate_proj = BiasedSwitchLinear(in_features, hidden_features, num_experts)
    experts.up_proj = BiasedSwitchLinear(in_features, hidden_features, num_experts)
    experts.down_proj = BiasedSwitchLinear(hidden_features, in_features, num_experts)


class Experts(SwitchGLU):
    """Experts with biases on gate, up and down and the clamped SwiGLU."""

    def __init__(self, in_features: int, hidden_features: int, num_experts: int, limit: float, alpha: float):
        super().__init__(in_features, hidden_features, num_experts)
        _biased(self, in_features, hidden_features, num_experts)
        self.limit, self.alpha = limit, alpha

    @property
    def clamp(self) -> tuple[float, float]:
        return float(self.limit), float(self.alpha)

    def activate(self, gate: mx.array, up: mx.array) -> mx.array:
        return clamped_swiglu(gate, up, self.limit, self.alpha)

    def sharded(self, first: int, held: int, group: mx.distributed.Group) -> ExpertsShard:
        """This rank's span of these experts (moebench.models.sharding), biases and clamp kept."""
        total, hidden, dims = self.gate_proj.shape
        return ExpertsShard(dims, hidden, total, first, held, group, self.limit, self.alpha)


class ExpertsShard(ExpertShard):
    """A rank's span of gpt-oss experts: each slot's output (its down bias included) is computed on the one rank
    holding its expert and zero elsewhere, so the all_sum adds every bias once."""

    def __init__(self, in_features: int, hidden_features: int, total: int, first: int, held: int,
                 group: mx.distributed.Group, limit: float, alpha: float):
        super().__init__(in_features, hidden_features, total, first, held, group)
        _biased(self, in_features, hidden_features, held)
        self.limit, self.alpha = limit, alpha

    @property
    def clamp(self) -> tuple[float, float]:
        return float(self.limit), float(self.alpha)

    def activate(self, gate: mx.array, up: mx.array) -> mx.array:
        return clamped_swiglu(gate, up, self.limit, self.alpha)


class SparseMoeBlock(qwen2_moe.SparseMoeBlock):
    """Router with a bias, top-k logits then softmax over the k (see the module docstring), biased experts."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.gate = Linear(args.hidden_size, args.num_experts, bias=True)
        self.switch_mlp = Experts(args.hidden_size, args.moe_intermediate_size, args.num_experts,
                                  args.swiglu_limit, args.swiglu_alpha)

    @property
    def spec(self) -> MoeSpec:
        return MoeSpec(self.num_experts, self.top_k, scoring=TOPK_THEN_SOFTMAX, router_bias=True,
                       activation=CLAMPED_SWIGLU, expert_bias=True)


class Model(qwen2_moe.Model):
    def __init__(self, args: ModelArgs):
        if args.shared_expert_intermediate_size:
            raise ConfigError("gpt_oss config sets shared_expert_intermediate_size, but gpt-oss has no shared expert")
        if args.swiglu_limit is None or args.swiglu_alpha is None:
            raise ConfigError("gpt_oss config: swiglu_limit and swiglu_alpha are needed (moebench.checkpoint fills "
                              "transformers' defaults)")
        super().__init__(args)
        types = args.layer_types or (FULL,) * args.num_hidden_layers
        for i, (layer, kind) in enumerate(zip(self.layers, types, strict=True)):
            if not layer.is_moe:
                raise ConfigError(f"gpt_oss config makes layer {i} a dense MLP layer; every gpt-oss layer is MoE")
            layer.self_attn = Attention(args, args.sliding_window if kind == SLIDING else None)
            layer.mlp = SparseMoeBlock(args)


# openai/gpt-oss-20b's config.json: experts of width `intermediate_size` (2880, D too) with biases and the clamped
# SwiGLU, router with a bias (top-4 logits then softmax), 64 query / 8 kv heads of 64 with biases and sinks, a
# 128-position window on every other layer (sliding first), YaRN rotary (factor 32 over 4096, not truncated).
# make-random writes it as mlx-lm's convert and the published MLX conversions do (writer.gpt_oss_mlx_lm_tensors):
# mlp.router in 8 bits, experts stacked at mlp.experts.* in mxfp4, the rest at the affine bits asked for
GPT_OSS_20B = {
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "hidden_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
    "router_aux_loss_coef": 0.9, "output_router_logits": False, "use_cache": True, "eos_token_id": 200002,
    "pad_token_id": 199999, "torch_dtype": "bfloat16",
}
FAMILY = Family(("gpt_oss",), Model, config_fields, layer_types=LAYER_TYPES, rope_types=ROPE_TYPES,
                stored_layout=to_moebench_names, presets=(
    Preset("gpt-oss-20b", "gpt-oss-20b: 24 layers, D 2880, 64 query heads over 8 kv heads of 64 with sinks, a "
           "128-position window on alternate layers, 32 experts top-4 of width 2880 with biases and the clamped "
           "SwiGLU, vocab 201088 (20.9B parameters, 4.2B active with the embeddings)", GPT_OSS_20B),
    Preset("gpt-oss-tiny", "the gpt_oss family at the tiny preset's size: 2 layers (windowed, then full), D 128, "
           "GQA 4/2 of 32 with sinks, window 4, 8 experts top-2 of width 128, vocab 256", {
               **GPT_OSS_20B, "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128,
               "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 4,
               "layer_types": ["sliding_attention", "full_attention"], "eos_token_id": None, "pad_token_id": None}),
))
