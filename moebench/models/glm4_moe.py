"""GLM-4.5 / 4.6 / 4.7 MoE (and GLM-4.5-Air): what differs from Qwen2-MoE, and nothing else.

- router: each expert's score is sigmoid(logit); the experts are chosen by score plus a learned selection bias
  (`e_score_correction_bias`, held in float32 beside the router's weight) among the best `topk_group` of
  `n_group` groups, and weighted by their unbiased scores, renormalised with norm_topk_prob, times
  `routed_scaling_factor` (moebench.models.declare.SIGMOID_GROUPED);
- shared experts: one MLP `shared_experts` of n_shared_experts * moe_intermediate_size, added as it is (no gate);
- dense first layers: the first `first_k_dense_replace` layers run a dense MLP of intermediate_size;
- attention: q/k/v biases with attention_bias (o_proj has none), an RMSNorm over each head of q and of k with
  use_qk_norm, rotary (rotate-half) on the first partial_rotary_factor (0.5) of each head;
- stored: the multi-token-prediction layers after the last (`num_nextn_predict_layers`) are left out; mlx-lm's
  conversions keep the router float (its MoEGate is no Linear) and so does make-random.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from ..errors import ConfigError
from . import qwen2_moe
from .args import ModelArgs
from .declare import ADDED, PER_HEAD, SIGMOID_GROUPED, AttentionSpec, MoeParts, MoeSpec
from .family import Family, Preset, StoredTensors
from .layers import Linear, RMSNorm

DEFAULT_ROTARY_FRACTION = 0.5  # transformers' Glm4MoeConfig default
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class RouterArgs:
    """The grouped sigmoid router's settings (config.json's routed_scaling_factor, n_group, topk_group)."""

    routed_scaling: float = 1.0
    n_group: int = 1
    topk_group: int = 1


@dataclass(frozen=True)
class GlmArgs:
    """What only GLM computes with: its router's settings and whether q and k are normed per head."""

    router: RouterArgs
    qk_norm: bool = False


def _count(cfg: dict[str, Any], key: str, source: str, default: int) -> int:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{source}: field {key!r} must be an integer >= 0, got {value!r}")
    return value


def moe_config_fields(cfg: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The fields GLM and DeepSeek-V3 name their own way: n_routed_experts, the shared experts' width
    (n_shared_experts of moe_intermediate_size), the dense first layers (first_k_dense_replace), and transformers'
    defaults (top-k renormalised)."""
    shared = _count(cfg, "n_shared_experts", source, 0)
    width = cfg.get("moe_intermediate_size")
    fields: dict[str, Any] = {"num_experts": cfg.get("n_routed_experts", cfg.get("num_experts")),
                              "shared_expert_intermediate_size": shared * width if isinstance(width, int) else width,
                              "norm_topk_prob": True if cfg.get("norm_topk_prob") is None else cfg["norm_topk_prob"]}
    first = _count(cfg, "first_k_dense_replace", source, 0)
    if isinstance(cfg.get("num_hidden_layers"), int):
        fields["mlp_only_layers"] = list(range(min(first, cfg["num_hidden_layers"])))
    return fields


def config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = cfg.get("attention_bias")
    return {**moe_config_fields(cfg), "qkv_bias": False if bias is None else bias}


def router_args(cfg: dict[str, Any], source: str) -> RouterArgs:
    """The grouped sigmoid router's settings, checked; a router that scores otherwise is refused by name."""
    for key, wanted in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(key, wanted) != wanted:
            raise ConfigError(f"{source}: field {key!r} is {cfg[key]!r}; moebench computes {wanted!r} routing")
    scaling = cfg.get("routed_scaling_factor", 1.0)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
        raise ConfigError(f"{source}: field 'routed_scaling_factor' must be a positive number, got {scaling!r}")
    groups, kept = _count(cfg, "n_group", source, 1), _count(cfg, "topk_group", source, 1)
    experts, top_k = cfg.get("num_experts"), cfg.get("num_experts_per_tok")
    try:  # the groups' rules, as the block declares them (MoeSpec checks them; the counts are checked later)
        if isinstance(experts, int) and isinstance(top_k, int) and experts > 0:
            MoeSpec(experts, top_k, SIGMOID_GROUPED, n_group=groups, topk_group=kept)
    except ValueError as e:
        raise ConfigError(f"{source}: fields 'n_group' {groups} / 'topk_group' {kept} with {experts} experts "
                          f"top-{top_k}: {e}") from e
    return RouterArgs(float(scaling), groups, kept)


def _rotary_fraction(cfg: dict[str, Any], source: str) -> float:
    """partial_rotary_factor at the top level or in rope_parameters (transformers 5), GLM's 0.5 when absent."""
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    fraction = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", DEFAULT_ROTARY_FRACTION))
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ConfigError(f"{source}: field 'partial_rotary_factor' must be a number in (0, 1], got {fraction!r}")
    return float(fraction)


def own_fields(cfg: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    qk_norm = cfg.get("use_qk_norm", False)
    if not isinstance(qk_norm, bool):
        raise ConfigError(f"{source}: field 'use_qk_norm' must be true or false, got {qk_norm!r}")
    return {"family_args": GlmArgs(router_args(cfg, source), qk_norm),
            "partial_rotary_factor": _rotary_fraction(cfg, source)}


def without_prediction_layers(store: StoredTensors, args: ModelArgs) -> ModelArgs:
    """The multi-token-prediction layers stored after the model's last layer, left out (and counted)."""
    for name in list(store.names()):
        if (m := LAYER.match(name)) is not None and int(m[1]) >= args.num_hidden_layers:
            store.skip(name, "multi-token prediction layer")
    return args


class Attention(qwen2_moe.Attention):
    """Attention with q/k/v biases (with attention_bias), an optional per-head q/k RMSNorm and partial rotary."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        if args.family_args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
            self.qk_norm = PER_HEAD
        self.rotary_fraction = args.partial_rotary_factor
        self.rotary_dims = int(self.head_dim * self.rotary_fraction)  # transformers' int(head_dim * factor)

    @property
    def spec(self) -> AttentionSpec:
        return replace(super().spec, rope_fraction=self.rotary_fraction)

    def heads(self, q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super().heads(q, k, v)
        return (self.q_norm(q), self.k_norm(k), v) if self.qk_norm else (q, k, v)

    def rope(self, x: mx.array, offset) -> mx.array:
        """Rotary on the first rotary_dims of each head only."""
        return mx.fast.rope(x, self.rotary_dims, traditional=False, base=self.rope_theta, scale=1.0, offset=offset)


class Router(Linear):
    """The router's weight [E, D] and, beside it, the selection bias [E] it chooses by (float32, as stored)."""

    float32_params = ("e_score_correction_bias",)

    def __init__(self, dims: int, experts: int):
        super().__init__(dims, experts)
        self.e_score_correction_bias = mx.zeros((experts,))


class SparseMoeBlock(qwen2_moe.SparseMoeBlock):
    """The grouped sigmoid router with its selection bias, the routed experts, and shared experts added as they
    are (GLM's and DeepSeek-V3's: their family_args carry the router's settings as `router`)."""

    def __init__(self, args: ModelArgs):
        super().__init__(replace(args, shared_expert_intermediate_size=0))
        self.router_args = args.family_args.router
        self.gate = Router(args.hidden_size, args.num_experts)
        if args.shared_expert_intermediate_size:
            self.shared_experts = qwen2_moe.MLP(args.hidden_size, args.shared_expert_intermediate_size)

    @property
    def spec(self) -> MoeSpec:
        r = self.router_args
        return MoeSpec(self.num_experts, self.top_k, SIGMOID_GROUPED, renormalize=self.norm_topk_prob,
                       shared=ADDED if "shared_experts" in self else None, selection_bias=True, n_group=r.n_group,
                       topk_group=r.topk_group, routed_scaling=r.routed_scaling)

    def parts(self) -> MoeParts:
        return MoeParts(self.gate, self.switch_mlp, self.gate["e_score_correction_bias"],
                        shared=self.get("shared_experts"))


class Model(qwen2_moe.Model):
    def __init__(self, args: ModelArgs, attention: type[qwen2_moe.Attention] = Attention):
        if not isinstance(args.family_args, GlmArgs):
            raise ConfigError(f"{args.model_type}: the router's settings are missing (moebench.checkpoint reads them "
                              "from config.json)")
        super().__init__(args, attention, SparseMoeBlock)


# zai-org/GLM-4.5-Air's config.json: 46 layers (the first dense), 96 query heads over 8 kv heads of 128 with q/k/v
# biases, rotary on half of each head, 128 experts top-8 of width 1408 plus one shared, one ungrouped router
GLM_4_5_AIR = {
    "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "vocab_size": 151552, "hidden_size": 4096,
    "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 1.0, "partial_rotary_factor": 0.5, "rope_theta": 1000000, "rope_scaling": None,
    "attention_bias": True, "use_qk_norm": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "hidden_act": "silu",
    "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329, "torch_dtype": "bfloat16",
}
# zai-org/GLM-4.6's config.json (GLM-4.7 has the same shapes): 92 layers (the first 3 dense), D 5120, q/k norm,
# 160 experts top-8 of width 1536 plus one shared, scaled by 2.5
GLM_4_6 = {
    **GLM_4_5_AIR, "hidden_size": 5120, "num_hidden_layers": 92, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "n_routed_experts": 160, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
    "use_qk_norm": True, "max_position_embeddings": 202752,
}
TINY = dict(vocab_size=256, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4,
            max_position_embeddings=4096, eos_token_id=None, pad_token_id=None, num_nextn_predict_layers=0)
FAMILY = Family(("glm4_moe",), Model, config_fields, own_fields, stored_layout=without_prediction_layers,
                unquantized=(".mlp.gate.weight",), presets=(
    Preset("glm-4.5-air", "GLM-4.5-Air: 46 layers (the first dense), D 4096, 96 query heads over 8 kv heads of 128, "
           "128 experts top-8 of width 1408 plus a shared one, vocab 151552 (106B parameters, 12B active; ~60 GB at "
           "4-bit)", GLM_4_5_AIR),
    Preset("glm-4.6", "GLM-4.6 / 4.7: 92 layers (the first 3 dense), D 5120, q/k norm, 160 experts top-8 of width "
           "1536 plus a shared one, routed scaling 2.5 (355B parameters, 32B active)", GLM_4_6),
    Preset("glm-4.5-air-2l", "GLM-4.5-Air's widths and vocabulary with 2 layers (one dense, one MoE): real "
           "per-layer shapes on a CPU", {**GLM_4_5_AIR, "num_hidden_layers": 2}),
    Preset("glm4-moe-tiny", "the glm4_moe family at the tiny preset's size: 3 layers (the first dense), D 128, GQA "
           "4/2 of 32 with q/k norm, 16 experts in 4 groups (2 kept) top-4 of width 64 plus a shared one, scaled "
           "by 1.5, vocab 256", {**GLM_4_6, **TINY, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5,
                                 "first_k_dense_replace": 1}),
))
