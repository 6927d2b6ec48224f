"""Qwen3-Next (Qwen3-Next-80B-A3B) and Qwen3.5 / 3.6 MoE (text model): the hybrids, as what differs from Qwen2-MoE.

- token mixing per layer, as config `layer_types` says (else every `full_attention_interval`-th layer full):
  'linear_attention' layers run Gated DeltaNet (moebench.models.gated_delta; its state in a
  moebench.decode.state.LinearAttentionState), 'full_attention' layers run GatedAttention: q_proj twice as wide
  (per head its queries, then an output gate), an RMSNorm over each head of q and of k, rotary on the first
  `partial_rotary_factor` of each head (rotate-half), and the attention output times sigmoid(gate) before o_proj;
- MoE block: Qwen2-MoE's (routed experts plus a sigmoid-gated shared expert), top-k renormalised (Qwen3.5 always,
  Qwen3-Next per norm_topk_prob). Routing, experts and recording are Qwen2-MoE's;
- norms: transformers stores the decoder norms, the final norm and q/k norms as offsets from 1 (it computes
  x_normed * (1 + w)); these modules hold 1 + w, as mlx-lm's conversions store them (a loader reading a
  transformers folder adds the 1). The gated norm inside the linear attention is stored as is in both;
- Qwen3.5 vs Qwen3-Next: only the linear attention's projections are stored differently (gated_delta.LAYOUTS);
  Qwen3.5's multimodal rotary (mrope) gives a text token the same position in every section: plain rotary.

ModelArgs holds the linear-attention sizes and the rotary fraction (model_fields reads them from config.json);
HybridArgs gathers them with the projection layout the model_type implies. A recorded forward also records each
layer's kind and its token mixing's gates and state norms (moebench.models.hooks' `mixer` names).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError
from . import hooks, qwen2_moe, qwen3_moe
from .args import ModelArgs
from .declare import AttentionSpec
from .family import Family, Preset
from .gated_delta import FUSED_QKVZ, SPLIT_QKV_Z_B_A, GatedDeltaNet, LinearAttentionArgs
from .hooks import Record
from .layers import Embedding, Linear, RMSNorm
from .qwen3_next_layouts import to_moebench_names
from .run import MODULES, LayerRun

LINEAR, FULL = "linear_attention", "full_attention"
LAYER_TYPES = (LINEAR, FULL)  # what config `layer_types` may hold for these families
QWEN3_5 = ("qwen3_5_moe", "qwen3_5_moe_text")  # the multimodal folder's model_type and its text_config's
LAYOUT = {"qwen3_next": FUSED_QKVZ, **dict.fromkeys(QWEN3_5, SPLIT_QKV_Z_B_A)}
DEFAULT_ROTARY_FRACTION = 0.25  # transformers' partial_rotary_factor default for both
DEFAULT_FULL_ATTENTION_INTERVAL = 4


@dataclass(frozen=True)
class HybridArgs:
    """What a hybrid computes beyond ModelArgs: the linear-attention layers' sizes and layout, and the fraction of
    each full-attention head that is rotated."""

    linear: LinearAttentionArgs
    rotary_fraction: float = DEFAULT_ROTARY_FRACTION


def _rope_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes rope_theta and partial_rotary_factor inside `rope_parameters`; older files and mlx-lm's
    conversions at the top level (or under `rope_scaling`)."""
    merged: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(cfg.get(key), dict):
            merged.update({k: v for k, v in cfg[key].items() if v is not None})
    merged.update({k: cfg[k] for k in ("rope_theta", "partial_rotary_factor") if cfg.get(k) is not None})
    return merged


def config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fields these families' config.json leaves out or names its own way, as transformers' Qwen3NextConfig and
    Qwen3_5MoeTextConfig default them: no attention bias, the layer types from full_attention_interval, and for
    Qwen3.5 every layer a MoE layer with its top-k renormalised (it has no dense MLP width either)."""
    bias = cfg.get("attention_bias")
    fields: dict[str, Any] = {"qkv_bias": False if bias is None else bias}
    layers = cfg.get("num_hidden_layers")
    if cfg.get("layer_types") is None and isinstance(layers, int):
        every = cfg.get("full_attention_interval") or DEFAULT_FULL_ATTENTION_INTERVAL
        fields["layer_types"] = [FULL if (i + 1) % every == 0 else LINEAR for i in range(layers)]
    if cfg.get("model_type") in QWEN3_5:
        fields.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      intermediate_size=cfg.get("intermediate_size") or cfg.get("moe_intermediate_size"))
    elif cfg.get("norm_topk_prob") is None:
        fields["norm_topk_prob"] = True
    return fields


def hybrid_args(cfg: dict[str, Any], source: str = "config.json") -> HybridArgs:
    """HybridArgs from a parsed config.json (the text model's); a missing or invalid field is a ConfigError naming
    it."""
    model_type = cfg.get("model_type")
    if model_type not in LAYOUT:
        raise ConfigError(f"{source}: model_type {model_type!r} is not a hybrid (one of {sorted(LAYOUT)})")

    def size(key: str) -> int:
        value = cfg.get(key)
        if value is None:
            raise ConfigError(f"{source}: required field {key!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
        return value

    fraction = _rope_settings(cfg).get("partial_rotary_factor", DEFAULT_ROTARY_FRACTION)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ConfigError(f"{source}: field 'partial_rotary_factor' must be a number in (0, 1], got {fraction!r}")
    linear = LinearAttentionArgs(size("linear_num_key_heads"), size("linear_num_value_heads"),
                                 size("linear_key_head_dim"), size("linear_value_head_dim"),
                                 size("linear_conv_kernel_dim"), LAYOUT[model_type])
    return HybridArgs(linear, float(fraction))


def model_fields(cfg: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The ModelArgs fields only these families have (moebench.checkpoint.config asks every family): the
    linear-attention sizes and the rotary fraction, checked by hybrid_args."""
    hybrid = hybrid_args(cfg, source)
    lin = hybrid.linear
    return dict(linear_num_key_heads=lin.num_key_heads, linear_num_value_heads=lin.num_value_heads,
                linear_key_head_dim=lin.key_head_dim, linear_value_head_dim=lin.value_head_dim,
                linear_conv_kernel_dim=lin.conv_kernel, partial_rotary_factor=hybrid.rotary_fraction)


def args_hybrid(args: ModelArgs) -> HybridArgs:
    """HybridArgs from ModelArgs' fields (as model_fields filled them), the layout from the model_type."""
    if args.model_type not in LAYOUT:
        raise ConfigError(f"model_type {args.model_type!r} is not a hybrid (one of {sorted(LAYOUT)})")
    linear = LinearAttentionArgs(args.linear_num_key_heads, args.linear_num_value_heads, args.linear_key_head_dim,
                                 args.linear_value_head_dim, args.linear_conv_kernel_dim, LAYOUT[args.model_type])
    return HybridArgs(linear, args.partial_rotary_factor)


def layer_type(args: ModelArgs, layer: int) -> str:
    """'linear_attention' or 'full_attention' for layer `layer` (ModelArgs.layer_types, one per layer; none given:
    every layer full)."""
    types = args.layer_types or (FULL,) * args.num_hidden_layers
    if len(types) != args.num_hidden_layers or not set(types) <= set(LAYER_TYPES):
        raise ConfigError(f"{args.model_type}: layer_types must give one of {list(LAYER_TYPES)} for each of the "
                          f"{args.num_hidden_layers} layers, got {list(types)!r}")
    return types[layer]


class GatedAttention(qwen3_moe.Attention):
    """Attention with per-head q/k RMSNorm, partial rotary and a sigmoid output gate from the second half of each
    head's q_proj rows."""

    def __init__(self, args: ModelArgs, rotary_fraction: float):
        super().__init__(args)
        d, hd = args.hidden_size, self.head_dim
        self.q_proj = Linear(d, 2 * self.n_heads * hd, bias=args.qkv_bias)
        self.o_proj = Linear(self.n_heads * hd, d, bias=args.qkv_bias)
        self.rotary_fraction = rotary_fraction
        self.rotary_dims = int(hd * rotary_fraction)  # transformers' int(head_dim * partial_rotary_factor)

    @property
    def spec(self) -> AttentionSpec:
        return replace(super().spec, rope_fraction=self.rotary_fraction, output_gate=True)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Each head's q_proj rows: its queries, then its output gate."""
        b, length, _ = x.shape
        queries, gate = mx.split(self.q_proj(x).reshape(b, length, self.n_heads, 2 * self.head_dim), 2, axis=-1)
        return (*self.heads(queries.reshape(b, length, -1), self.k_proj(x), self.v_proj(x)), gate)

    def rope(self, x: mx.array, offset) -> mx.array:
        """Rotary on the first rotary_dims of each head only."""
        return mx.fast.rope(x, self.rotary_dims, traditional=False, base=self.rope_theta, scale=1.0, offset=offset)

    def gated(self, out: mx.array, gate: mx.array, record: Record | None) -> mx.array:
        """out times sigmoid(gate); with `record`, hands it sigmoid(gate) per head (hooks.OUTPUT_GATE)."""
        gate = mx.sigmoid(gate)
        if record is not None:
            record(hooks.OUTPUT_GATE, gate.astype(mx.float32).reshape(-1, self.n_heads, self.head_dim))
        return out * gate.reshape(out.shape)


class DecoderLayer(qwen2_moe.DecoderLayer):
    """Qwen2-MoE's pre-norm layer with the token mixing its layer type names: `linear_attn` (GatedDeltaNet, its
    cache a LinearAttentionState) or `self_attn` (GatedAttention, its cache a KVCache)."""

    def __init__(self, args: ModelArgs, hybrid: HybridArgs, layer: int):
        nn.Module.__init__(self)  # not Qwen2-MoE's: it would build its attention
        self.layer_type = layer_type(args, layer)
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(args, hybrid.linear)
        else:
            self.self_attn = GatedAttention(args, hybrid.rotary_fraction)
        self.is_moe = args.is_moe_layer(layer)
        self.mlp = qwen2_moe.SparseMoeBlock(args) if self.is_moe else \
            qwen2_moe.MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    @property
    def mixer(self) -> GatedDeltaNet | GatedAttention:
        """This layer's token mixing module."""
        return self["linear_attn"] if self.layer_type == LINEAR else self["self_attn"]

    def __call__(self, x: mx.array, cache=None, record: Record | None = None, run: LayerRun = MODULES) -> mx.array:
        """Qwen2-MoE's forward; with `record`, the layer's kind and what its token mixing records as well."""
        if record is not None:
            record(hooks.MIXER_KIND, self.layer_type)
            run = RecordedMixing(run, record.scope(hooks.MIXER))
        return super().__call__(x, cache, record, run)


@dataclass(frozen=True)
class RecordedMixing:
    """A LayerRun that hands the token mixing a record: the module, or the kernel step taking its place, records
    into it."""

    run: LayerRun
    record: Record

    def attend(self, attn, norm, residual: mx.array, cache) -> mx.array:
        return self.run.attend(attn, norm, residual, cache, self.record)

    def feed_forward(self, mlp, norm, residual: mx.array, record: Record | None) -> mx.array:
        return self.run.feed_forward(mlp, norm, residual, record)


class HybridModel(qwen2_moe.Qwen2MoeModel):
    """Embedding, the hybrid layers, the final norm; the forward is Qwen2-MoE's (each layer its own cache)."""

    def __init__(self, args: ModelArgs, hybrid: HybridArgs):
        nn.Module.__init__(self)  # not Qwen2MoeModel's: it would build Qwen2-MoE layers
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, hybrid, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(qwen2_moe.Model):
    """tokens [B, L] -> logits [B, L, vocab]; with a cache (per layer a LinearAttentionState or a KVCache, as its
    layer_type says) it continues a sequence."""

    def __init__(self, args: ModelArgs, hybrid: HybridArgs | None = None):
        """`hybrid`: None reads it from args (args_hybrid), as the loader builds the model."""
        nn.Module.__init__(self)  # not qwen2_moe.Model's: it would build Qwen2-MoE layers
        hybrid = args_hybrid(args) if hybrid is None else hybrid
        if not args.shared_expert_intermediate_size and args.num_experts:
            raise ConfigError(f"{args.model_type} config gives no shared_expert_intermediate_size: the hybrids' MoE "
                              "blocks have a shared expert")
        self.args, self.hybrid = args, hybrid
        self.model = HybridModel(args, hybrid)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size)


# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (transformers' Qwen3NextConfig defaults but for experts 512 top-10,
# rope_theta 1e7, 262144 positions): 48 hybrid layers, every 4th full attention (16 query / 2 kv heads of 256, an
# output gate, rotary on a quarter of each head), the others Gated DeltaNet (16 key / 32 value heads of 128, conv 4);
# every layer a MoE block of 512 experts top-10 of width 512 plus a shared expert of 512
QWEN3_NEXT_80B_A3B = {
    "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
    "num_hidden_layers": 48, "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "intermediate_size": 5120, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "bos_token_id": 151643,
    "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
# Qwen/Qwen3.5-35B-A3B's text model (its text_config, transformers' Qwen3_5MoeTextConfig defaults but rope_theta 1e7
# and 262144 positions), flat as mlx-lm reads it: 40 hybrid layers as Qwen3-Next's, 256 experts top-8 of width 512
# plus a shared expert of 512, vocab 248320; its Gated DeltaNet projections stored apart (in_proj_qkv, _z, _b, _a);
# the rotary settings inside rope_parameters (the only place mlx-lm's qwen3_5 reads them; its mrope sections give a
# text token one position in every section)
QWEN3_5_35B_A3B = {
    **{k: v for k, v in QWEN3_NEXT_80B_A3B.items() if k not in (
        "intermediate_size", "bos_token_id", "eos_token_id", "rope_theta", "partial_rotary_factor")},
    "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"], "vocab_size": 248320,
    "num_hidden_layers": 40, "num_experts": 256, "num_experts_per_tok": 8,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}
HYBRID_TINY = dict(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, intermediate_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                   num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=4096, bos_token_id=None,
                   eos_token_id=None)
FAMILY = Family(("qwen3_next", *QWEN3_5), Model, config_fields, model_fields, layer_types=LAYER_TYPES,
                stored_layout=to_moebench_names, presets=(
    Preset("qwen3-next-80b-a3b", "Qwen3-Next-80B-A3B: 48 layers (3 of 4 Gated DeltaNet, every 4th gated full "
           "attention), D 2048, 512 experts top-10 of width 512, shared expert 512, vocab 151936", QWEN3_NEXT_80B_A3B),
    Preset("qwen3.5-35b-a3b", "Qwen3.5-35B-A3B's text model: 40 layers (3 of 4 Gated DeltaNet, every 4th gated full "
           "attention), D 2048, 256 experts top-8 of width 512, shared expert 512, vocab 248320", QWEN3_5_35B_A3B),
    Preset("qwen3-next-tiny", "the qwen3_next family at the tiny preset's size: 4 layers (3 Gated DeltaNet, then "
           "gated full attention), D 128, GQA 4/2 of 32, 8 experts top-2 of width 128, shared expert 128, vocab 256",
           {**QWEN3_NEXT_80B_A3B, **HYBRID_TINY}),
    Preset("qwen3.5-moe-tiny", "the qwen3_5_moe family at the tiny preset's size: as qwen3-next-tiny, its linear "
           "projections stored apart", {**QWEN3_5_35B_A3B, **HYBRID_TINY}),
))
