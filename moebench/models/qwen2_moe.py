"""Qwen2-MoE (Qwen1.5-MoE-A2.7B and relatives): what the model computes, top to bottom.

Decoder layer (pre-norm): h = x + attn(norm(x)); out = h + moe(norm(h)), where moe is the sparse MoE
block (router softmax over all experts in float32, top-k, routed SwiGLU experts, plus a sigmoid-gated
shared expert) or, per decoder_sparse_step / mlp_only_layers, a dense SwiGLU MLP.

Modules are built from ModelArgs with placeholder weights; moebench.checkpoint fills them, and their
paths are the checkpoint's tensor names. Each attention and MoE block declares what it computes (`spec`,
in moebench.models.declare's words). How a decode token runs (a fused kernel or these modules, and why)
is moebench.execution's business: it reads the declarations and hands the forward a LayerRun per layer
(moebench.models.run); nothing here knows about kernels. A forward pass given a Record hands it the
internals named in moebench.models.hooks.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import DecodeError
from . import hooks
from .args import ModelArgs
from .declare import SIGMOID_GATED, AttentionParts, AttentionSpec, MoeParts, MoeSpec
from .family import Family, Preset
from .hooks import Record
from .layers import Embedding, Linear, RMSNorm
from .routing import Intervention, InterventionError, recorded_choice, route, shared_takes_part
from .run import MODULES, LayerRun
from .switch import SwitchGLU, swiglu, weighted_sum


def config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fields this family's config.json may leave out, as transformers' Qwen2MoeConfig defaults them."""
    return {"qkv_bias": True if cfg.get("qkv_bias") is None else cfg["qkv_bias"]}


class Attention(nn.Module):
    """Multi-head (or grouped-query) attention with q/k/v bias and rotate-half RoPE."""

    qk_norm: str | None = None  # where a family normalises q and k (moebench.models.declare)

    def __init__(self, args: ModelArgs):
        super().__init__()
        d, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, hd
        self.q_proj = Linear(d, self.n_heads * hd, bias=args.qkv_bias)
        self.k_proj = Linear(d, self.n_kv_heads * hd, bias=args.qkv_bias)
        self.v_proj = Linear(d, self.n_kv_heads * hd, bias=args.qkv_bias)
        self.o_proj = Linear(self.n_heads * hd, d)
        self.rope_theta = args.rope_theta
        self.scale = hd**-0.5

    @property
    def spec(self) -> AttentionSpec:
        """What this layer computes, for the execution layer (the heads this process holds)."""
        return AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, qkv_bias="bias" in self.q_proj,
                             qk_norm=self.qk_norm)

    def parts(self) -> AttentionParts:
        """What a fused step reads of this layer (moebench.models.declare)."""
        norms = (self.q_norm, self.k_norm) if self.qk_norm is not None else (None, None)
        return AttentionParts(self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.rope_theta, *norms)

    def heads(self, q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """[B, L, heads * hd] projections -> [B, heads, L, hd] (a family that normalises q and k does it here)."""
        b, length, _ = q.shape
        return tuple(t.reshape(b, length, n, self.head_dim).transpose(0, 2, 1, 3)
                     for t, n in ((q, self.n_heads), (k, self.n_kv_heads), (v, self.n_kv_heads)))

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
        """x [B, L, D] -> q, k, v [B, heads, L, hd] and an output gate (None: the family has none)."""
        return (*self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x)), None)

    def rope(self, x: mx.array, offset) -> mx.array:
        """Rotate-half RoPE of every dim at rope_theta, from position `offset`."""
        return mx.fast.rope(x, self.head_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=offset)

    def mask(self, length: int, keys: int, offset, cache) -> mx.array | str | None:
        """Causal: the cache's own mask for `length` new queries over `keys` slots."""
        return cache.attention_mask(length) if cache is not None else ("causal" if length > 1 else None)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask) -> mx.array:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)

    def gated(self, out: mx.array, gate: mx.array | None, record: Record | None) -> mx.array:
        """The heads' output [B, L, heads * hd] before o_proj, times the output gate where the family has one."""
        return out

    def __call__(self, x: mx.array, cache=None, record: Record | None = None) -> mx.array:
        """One forward for every family's attention: the steps above are what a family changes. `record`: where
        the steps record what the family declares beyond attention (an output gate)."""
        b, length, _ = x.shape
        q, k, v, gate = self.project(x)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset), self.rope(k, offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = self.attend(q, k, v, self.mask(length, k.shape[2], offset, cache))
        return self.o_proj(self.gated(out.transpose(0, 2, 1, 3).reshape(b, length, -1), gate, record))


class MLP(nn.Module):
    """Dense SwiGLU: down(silu(gate(x)) * up(x)); also the shared expert."""

    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = Linear(dims, hidden), Linear(dims, hidden), Linear(hidden, dims)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router top-k over the routed experts plus a sigmoid-gated shared expert, as mlx-lm computes it.

    `intervention` (moebench.Intervention, checked against this block when set) changes the routing or
    the shared expert for every following call, until set back to None.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        d = args.hidden_size
        self.num_experts, self.top_k = args.num_experts, args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = Linear(d, args.num_experts)
        self.switch_mlp = SwitchGLU(d, args.moe_intermediate_size, args.num_experts)
        if args.shared_expert_intermediate_size:
            self.shared_expert = MLP(d, args.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(d, 1)
        self._intervention: Intervention | None = None

    @property
    def intervention(self) -> Intervention | None:
        return self._intervention

    @intervention.setter
    def intervention(self, value: Intervention | None) -> None:
        """Checked against this block (expert ids, top_k) before it is set: a bad one leaves the old in place."""
        if value is not None:
            if not isinstance(value, Intervention):
                raise InterventionError(f"expected a moebench.Intervention or None, got {type(value).__name__}")
            value.validate(self.num_experts, self.top_k)
        self._intervention = value

    def __setattr__(self, name: str, value: object) -> None:
        if name == "intervention":  # nn.Module would store a dict, list or array as a child, past the setter
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def spec(self) -> MoeSpec:
        """What this block computes, for the execution layer."""
        return MoeSpec(self.num_experts, self.top_k, renormalize=self.norm_topk_prob,
                       shared=SIGMOID_GATED if "shared_expert" in self else None)

    def parts(self) -> MoeParts:
        """What a fused step reads of this block (moebench.models.declare)."""
        if "shared_expert" not in self:
            return MoeParts(self.gate, self.switch_mlp)
        return MoeParts(self.gate, self.switch_mlp, shared=self.shared_expert, shared_gate=self.shared_expert_gate)

    @property
    def shared_on(self) -> bool:
        """Whether the shared expert takes part (the family has one and no intervention switched it off)."""
        return shared_takes_part(self.spec, self._intervention)

    def shared_scale(self, x: mx.array) -> mx.array:
        """The factor the shared expert joins the routed sum by: sigmoid(x W_sg^T) (1 for a shared expert added as
        it is), times an intervention's shared_gate_scale."""
        gate = mx.sigmoid(self.shared_expert_gate(x)) if self.spec.shared == SIGMOID_GATED else \
            mx.ones((*x.shape[:-1], 1), x.dtype)
        if self._intervention is not None and self._intervention.shared_gate_scale != 1.0:
            gate = gate * self._intervention.shared_gate_scale
        return gate

    def __call__(self, x: mx.array, record: Record | None = None) -> mx.array:
        shape, parts = x.shape, self.parts()
        x = x.reshape(-1, shape[-1])
        logits = parts.router(x)
        probs, inds, scores = route(logits, self.spec, self._intervention, selection_bias=parts.selection_bias)
        expert_out = parts.experts(x, inds)
        out = routed = weighted_sum(expert_out, scores)
        shared = gate = None
        if self.shared_on:
            shared, gate = parts.shared(x), self.shared_scale(x)
            out = out + gate * shared
        if record is not None:
            hooks.record_moe(record, logits, probs, inds, scores, expert_out, routed, shared, gate, out,
                             recorded_choice(probs, self.spec, parts.selection_bias))
        return out.reshape(shape)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, attention: type[Attention] = Attention,
                 block: type[SparseMoeBlock] = SparseMoeBlock):
        super().__init__()
        self.self_attn = attention(args)
        self.is_moe = args.is_moe_layer(layer)
        self.mlp = block(args) if self.is_moe else MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        """This layer's token mixing: its attention (a hybrid family's layers name theirs)."""
        return self.self_attn

    @property
    def ffn_norm(self) -> nn.Module:
        """The norm before this layer's MLP or MoE block."""
        return self.post_attention_layernorm

    def __call__(self, x: mx.array, cache=None, record: Record | None = None, run: LayerRun = MODULES) -> mx.array:
        h = run.attend(self.mixer, self.input_layernorm, x, cache)
        inner = hooks.scope(record, hooks.MOE) if self.is_moe else None
        out = run.feed_forward(self.mlp, self.post_attention_layernorm, h, inner)
        if record is not None:
            hooks.record_residuals(record, x, h, out)
        return out


class Qwen2MoeModel(nn.Module):
    def __init__(self, args: ModelArgs, attention: type[Attention] = Attention,
                 block: type[SparseMoeBlock] = SparseMoeBlock, layer: type[DecoderLayer] = DecoderLayer):
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [layer(args, i, attention, block) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, tokens: mx.array, cache=None, record: Record | None = None,
                 runs: tuple[LayerRun, ...] | None = None) -> mx.array:
        """The final-normed hidden states [B, L, D]; `runs`: what runs each layer's parts (default: its modules)."""
        # in the activation dtype (the norms'): a microscaled table dequantizes to float32, its values exact in any
        x = self.embed_tokens(tokens).astype(self.norm["weight"].dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cache[i] if cache is not None else None, hooks.scope(record, hooks.layer_scope(i)),
                      runs[i] if runs is not None else MODULES)
        return self.norm(x)


def check_token_ids(tokens: mx.array, vocab: int) -> None:
    """A direct call's tokens: an integer array [B, L] of ids inside the vocabulary. MLX does not bounds-check the
    embedding lookup (an id past the table reads other memory, or crashes the process), so a bad id is a
    DecodeError; this reads the ids' range (one small evaluation per call; the decode loops check their prompts
    once instead and call the executor)."""
    if not isinstance(tokens, mx.array) or tokens.ndim != 2 or not mx.issubdtype(tokens.dtype, mx.integer):
        kind = f"{tokens.dtype} array of shape {tuple(tokens.shape)}" if isinstance(tokens, mx.array) else \
            type(tokens).__name__
        raise DecodeError(f"model call: tokens must be an integer mx.array [batch, length], got {kind}")
    if tokens.size == 0:
        raise DecodeError("model call: no tokens")
    bounds = mx.stack([mx.min(tokens), mx.max(tokens)]).tolist()  # one evaluation
    low, high = bounds
    if low < 0 or high >= vocab:
        raise DecodeError(f"model call: token id {low if low < 0 else high} is outside the model's vocabulary of "
                          f"{vocab} (ids 0..{vocab - 1})")


class Model(nn.Module):
    """tokens [B, L] -> logits [B, L, vocab]; with a cache (moebench.decode.cache) it continues a sequence."""

    def __init__(self, args: ModelArgs, attention: type[Attention] = Attention,
                 block: type[SparseMoeBlock] = SparseMoeBlock, layer: type[DecoderLayer] = DecoderLayer):
        """A family passes its own attention, MoE block and decoder layer where they differ from these."""
        super().__init__()
        self.args = args
        self.model = Qwen2MoeModel(args, attention, block, layer)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size)

    def __call__(self, tokens: mx.array, cache=None, record: Record | None = None) -> mx.array:
        check_token_ids(tokens, self.args.vocab_size)
        return self.unembed(self.model(tokens, cache, record))

    def unembed(self, h: mx.array) -> mx.array:
        return self.lm_head(h) if "lm_head" in self else self.model.embed_tokens.as_linear(h)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    @property
    def dtype(self) -> mx.Dtype:
        """The activation dtype (the norms' weights are held in it)."""
        return self.model.norm.weight.dtype

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        return {i: layer.mlp for i, layer in enumerate(self.layers) if isinstance(layer.mlp, SparseMoeBlock)}


# A tiny config of every field the family computes with (tests and the `tiny` preset build on it).
TINY_CONFIG = {
    "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 256, "hidden_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
    "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "qkv_bias": True, "hidden_act": "silu",
}

QWEN15_MOE_A27B = dict(
    TINY_CONFIG,
    vocab_size=151936, hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
    intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
    num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True, max_position_embeddings=8192,
    bos_token_id=151643, eos_token_id=151643, torch_dtype="bfloat16", use_sliding_window=False,
    sliding_window=32768, max_window_layers=21, attention_dropout=0.0, router_aux_loss_coef=0.001,
)
QWEN2_57B_A14B = {**QWEN15_MOE_A27B, "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                  "num_key_value_heads": 4, "intermediate_size": 18944, "moe_intermediate_size": 2560,
                  "shared_expert_intermediate_size": 20480, "num_experts": 64, "num_experts_per_tok": 8,
                  "max_position_embeddings": 32768, "max_window_layers": 28}
# Qwen1.5-MoE's MLX conversions (mlx-community's) keep the experts one by one (experts.{i})
FAMILY = Family(("qwen2_moe",), Model, config_fields, expert_layout="per-expert", presets=(
    Preset("qwen1.5-moe-a2.7b", "Qwen1.5-MoE-A2.7B: 24 layers, D 2048, 60 experts top-4 of width 1408, shared "
           "expert 5632, vocab 151936 (14.3B parameters, 2.7B active; ~8 GB at 4-bit)", QWEN15_MOE_A27B),
    Preset("qwen1.5-moe-a2.7b-2l", "Qwen1.5-MoE-A2.7B's widths and vocabulary with 2 layers: real per-layer "
           "shapes on a CPU", {**QWEN15_MOE_A27B, "num_hidden_layers": 2}),
    Preset("qwen2-57b-a14b", "Qwen2-57B-A14B: 28 layers, D 3584, 28 query heads over 4 kv heads, 64 experts top-8 "
           "of width 2560, shared expert 20480 (~32 GB at 4-bit)", QWEN2_57B_A14B),
    Preset("small", "a small Qwen2-MoE for quick runs: 4 layers, D 256, GQA 4/2, 16 experts top-4 of width 256, "
           "shared expert 512, vocab 8192", dict(
               TINY_CONFIG, vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=512, moe_intermediate_size=256,
               shared_expert_intermediate_size=512, num_experts=16, num_experts_per_tok=4)),
    Preset("tiny", "the tests' shape (TINY_CONFIG): 2 layers, D 128, 8 experts top-2, vocab 256",
           TINY_CONFIG),
))
