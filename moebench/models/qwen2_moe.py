"""Qwen2-MoE (Qwen1.5-MoE-A2.7B and relatives), top to bottom.

Decoder layer (pre-norm): h = x + Attn(RMSNorm(x)); out = h + Block(RMSNorm(h)), where Block is the
sparse MoE block (router softmax over all experts in float32, top-k, routed SwiGLU experts, plus a
sigmoid-gated shared expert) or, per decoder_sparse_step / mlp_only_layers, a dense SwiGLU MLP.

Internals are recorded only when a recorder is attached (`model.recorder`), under the names of
moebench.inspect.hooks; with none attached the forward pass does no extra work.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn

from ..checkpoint.config import ModelArgs
from ..decode.cache import KVCache
from ..errors import CheckpointError
from ..execution import attention as attention_kernel
from ..execution import moe as fused_kernel
from ..execution import norms as norm_kernels
from ..execution.attention import Heads, rope_frequencies
from ..execution.dispatch import Decision, DispatchCounter, RowsSupport
from ..inspect import hooks
from .layers import Embedding, Linear, RowStack, load_linear
from .routing import Intervention, route
from .switch import SwitchGLU, load_switch_glu, swiglu, weighted_sum

Recorder = Callable[[str, object], None]
# What a MoE block records, in the order its paths return them.
MOE_PARTS = (hooks.ROUTER_LOGITS, hooks.ROUTER_PROBS, hooks.TOPK_IDS, hooks.TOPK_SCORES, hooks.EXPERT_OUT,
             hooks.ROUTED_OUT, hooks.SHARED_OUT, hooks.SHARED_GATE)


class RMSNorm(nn.Module):
    def __init__(self, weight: mx.array, eps: float):
        super().__init__()
        self.weight, self.eps = weight, eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Multi-head (or grouped-query) attention with q/k/v bias and rotate-half RoPE.

    With a KV cache (inference), q, k and v come out of one matmul over their stacked rows
    (layers.RowStack): at decode every operation is a launch or a graph node. For one new token with
    the fused switch on, the decode-attention kernel (moebench.execution.attention) then does the bias,
    RoPE and the attention over the cache in one launch, and the layer writes the new key and value into
    the cache (or the kernel stores them in place, where the cache allows it). Otherwise (prefill, switch
    off, a shape the kernel declines, a context past attention_kernel.MAX_POSITIONS, with the reason
    counted in `dispatch`) MLX's rope and scaled_dot_product_attention run. Without a cache (training, a
    full forward) the separate projections run, so gradients reach the model's parameters, which stay the
    separate projections.
    """

    # Why the decode kernel cannot run this family's attention, or None; a family that adds a step
    # between the projection and RoPE says so here.
    kernel_decline: str | None = None

    def __init__(self, args: ModelArgs, q_proj: Linear, k_proj: Linear, v_proj: Linear, o_proj: Linear):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.qkv = RowStack(q_proj, k_proj, v_proj)
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.heads = Heads(self.n_heads, self.n_kv_heads, self.head_dim)
        self.rope_theta = args.rope_theta
        self.scale = args.head_dim**-0.5
        self.dispatch = DispatchCounter()
        self._projection_support = RowsSupport()

    def project(self, x: mx.array, stack: bool) -> tuple[mx.array, mx.array, mx.array]:
        """q, k, v as [B, heads, L, head_dim], from the stacked projection when `stack` (families that
        normalise q and k override this)."""
        b, length, _ = x.shape
        h, kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        stacked = self.qkv.get() if stack else None
        if stacked is None:  # no cache, or q, k and v stored differently: three matmuls
            return tuple(p(x).reshape(b, length, n, hd).transpose(0, 2, 1, 3)
                         for p, n in ((self.q_proj, h), (self.k_proj, kv), (self.v_proj, kv)))
        heads = stacked(x).reshape(b, length, h + 2 * kv, hd).transpose(0, 2, 1, 3)
        return heads[:, :h], heads[:, h : h + kv], heads[:, h + kv :]

    def __call__(self, x: mx.array, cache: KVCache | None, norm: RMSNorm | None = None) -> mx.array:
        """Attention over `norm`(x) (the layer's input norm, when given: the fused decode step folds it into
        the q/k/v projection)."""
        b, length, _ = x.shape
        if cache is not None:
            decision = self.dispatch.decide_for(b * length, self._kernel_support,
                                                attention_kernel.span_reason(cache.span))
            if decision.fused:
                return self._decode_kernel(x, cache, decision.path, norm)
        if norm is not None:
            x = norm(x)
        q, k, v = self.project(x, stack=cache is not None)
        offset = cache.offset if cache is not None else 0
        q = mx.fast.rope(q, self.head_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=offset)
        k = mx.fast.rope(k, self.head_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        mask = cache.attention_mask(length) if cache is not None else ("causal" if length > 1 else None)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        if length > 1:  # [B, heads, L, hd] -> [B, L, heads * hd]; one position needs no transpose
            out = out.transpose(0, 2, 1, 3)
        return self.o_proj(out.reshape(b, length, -1))

    def _kernel_support(self, backend: str) -> str | None:
        """Why the decode-attention kernel cannot run this layer, or None."""
        if self.kernel_decline:
            return self.kernel_decline
        if self.qkv.get() is None:
            return "q, k and v are stored differently (no stacked projection for the kernel)"
        return attention_kernel.support_reason(self.heads)

    def _decode_kernel(self, x: mx.array, cache: KVCache, backend: str, norm: RMSNorm | None) -> mx.array:
        """One token [1, 1, D] through the decode-attention kernel; its key and value go into the cache."""
        stacked = self.qkv.get()
        keys, values, slots, block = cache.decode_buffers(self.n_kv_heads, self.head_dim, x.dtype)
        in_place = cache.kernel_writes(backend)
        out, k, v = attention_kernel.decode_attention(
            backend, self._projection(x, norm, stacked, backend), stacked.get("bias"),
            rope_frequencies(self.head_dim, self.rope_theta), slots, keys, values, self.heads, block, in_place)
        if in_place:
            cache.written_in_place(k, v)
        else:
            cache.write(k, v)
        return self.o_proj(out)

    def _projection(self, x: mx.array, norm: RMSNorm | None, stacked: Linear, backend: str) -> mx.array:
        """The stacked q/k/v projection of norm(x), without its bias: with moebench.execution.norms switched on,
        through the input-norm projection kernel where it can read the rows (else with the reason in
        dispatch.notes); otherwise the norm and the matmul apart."""
        self.dispatch.beside_note = None
        if norm is None:
            return stacked.matmul(x)
        if norm_kernels.enabled():
            dtypes = (norm.weight.dtype, x.dtype)
            reason = self._projection_support.reason(
                stacked, dtypes, lambda: norm_kernels.projection_reason(stacked.quantized_parts(), *dtypes))
            if reason is None:
                return norm_kernels.norm_matvec(backend, x, norm.weight, norm.eps, stacked.quantized_parts())
            self.dispatch.beside_note = f"input norm and q/k/v projection beside the kernel: {reason}"
        return stacked.matmul(norm(x))


class MLP(nn.Module):
    """Dense SwiGLU: down(silu(gate(x)) * up(x)); also the shared expert."""

    def __init__(self, gate_proj: Linear, up_proj: Linear, down_proj: Linear):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def __call__(self, x: mx.array, layer: int = -1, record: Recorder | None = None,
                 residual: mx.array | None = None) -> mx.array:
        y = self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
        return y if residual is None else residual + y

    def after_attention(self, x: mx.array, attn_out: mx.array, norm: RMSNorm, layer: int = -1,
                        record: Recorder | None = None) -> tuple[mx.array, mx.array]:
        """The second half of a decoder layer: (h + MLP(norm(h)), h) with h = x + attn_out."""
        h = x + attn_out
        return self(norm(h), layer, record, residual=h), h


class SparseMoeBlock(nn.Module):
    """Router top-k over the routed experts plus a sigmoid-gated shared expert.

    Fallback (prefill, switch off, unsupported experts): router matmul, moebench.models.routing.route, SwitchGLU
    (gather_qmm) and the shared expert as an MLP, in the activation dtype, as mlx-lm computes it.
    Fused (one decode token): the router's and the shared gate's logits from one matmul over their stacked
    rows, then the router kernel and the kernel pair (moebench.execution.moe) with the shared expert and the
    residual add inside them, everything after the matmul in float32 and no reshapes. With an intervention
    set, routing runs through route() instead of the router kernel; while recording, the block output is
    kept apart from the residual. With the opt-in norm kernels (moebench.execution.norms), after_attention
    starts a fused step with the entry kernel instead: the residual add, the post-attention norm, the
    router's rows and the selection in one launch. What cannot run inside the kernels runs beside them,
    and says why (DispatchCounter.notes).
    """

    def __init__(self, args: ModelArgs, gate: Linear, experts: SwitchGLU, shared_expert: MLP | None,
                 shared_expert_gate: Linear | None):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate
        self.router_rows = RowStack(gate, shared_expert_gate) if shared_expert_gate is not None else None
        self.num_experts, self.top_k = args.num_experts, args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.dispatch = DispatchCounter()
        self.intervention: Intervention | None = None
        self._entry_support = RowsSupport()

    def __call__(self, x: mx.array, layer: int = -1, record: Recorder | None = None,
                 residual: mx.array | None = None) -> mx.array:
        """The block's output for x [..., D], plus `residual` when given."""
        decision = self.dispatch.decide(self.experts, math.prod(x.shape[:-1]))
        return self._forward(x, decision, layer, record, residual)

    def after_attention(self, x: mx.array, attn_out: mx.array, norm: RMSNorm, layer: int = -1,
                        record: Recorder | None = None) -> tuple[mx.array, mx.array]:
        """The second half of a decoder layer: (h + Block(norm(h)), h) with h = x + attn_out. With
        moebench.execution.norms switched on, a fused step routed by the router kernel starts with the entry
        kernel (the add, the norm, the router's rows and its selection in one launch; where it cannot,
        dispatch.notes says why); otherwise the four run apart."""
        decision = self.dispatch.decide(self.experts, math.prod(x.shape[:-1]))
        entry = self._entry(decision, x, attn_out, norm)
        if entry is None:
            h = x + attn_out
            return self._forward(norm(h), decision, layer, record, h), h
        h, xn, *selection = entry
        return self._forward(xn, decision, layer, record, h, tuple(selection)), h

    def _entry(self, decision: Decision, x: mx.array, attn_out: mx.array, norm: RMSNorm):
        """The entry kernel's outputs (norm_kernels.norm_router), or None where it does not run: switched off
        (the default), not a fused step, an intervention set, or rows it cannot read (dispatch.notes says)."""
        self.dispatch.beside_note = None
        if not decision.fused or self.intervention is not None or not norm_kernels.enabled():
            return None
        rows = self.router_rows.get() if self.router_rows is not None else self.gate
        dtypes = (norm.weight.dtype, x.dtype)
        reason = self._entry_support.reason(rows, dtypes, lambda: (
            "the router and the shared expert gate are stored differently" if rows is None else
            norm_kernels.support_reason(rows.quantized_parts(), "bias" in rows, *dtypes)))
        if reason is not None:
            self.dispatch.beside_note = f"router and post-attention norm beside the kernels: {reason}"
            return None
        return norm_kernels.norm_router(decision.path, x, attn_out, norm.weight, norm.eps, rows.quantized_parts(),
                                        self.num_experts, self.top_k, self.norm_topk_prob,
                                        self.router_rows is not None)

    def _forward(self, x: mx.array, decision: Decision, layer: int, record: Recorder | None,
                 residual: mx.array | None, selection: tuple | None = None) -> mx.array:
        shape = x.shape
        if decision.fused and record is None:
            return self._fused(x, decision.path, False, residual, selection)[0]
        x = x.reshape(-1, shape[-1])
        if decision.fused:  # the same launches as unrecorded (residual inside), so recording changes nothing
            flat_residual = residual.reshape(x.shape) if residual is not None else None
            if selection is not None:
                selection = tuple(a.reshape(-1, a.shape[-1]) for a in selection)
            out, parts, block = self._fused(x, decision.path, True, flat_residual, selection)
            out = out.reshape(shape)
        else:
            block, parts = self._fallback(x)
            out = block.reshape(shape) if residual is None else residual + block.reshape(shape)
        if record is not None:
            name = hooks.moe_name(layer)
            for hook, value in zip(MOE_PARTS, parts, strict=True):
                record(name(hook), value)
            record(name(hooks.BLOCK_OUT), block)
            notes = self.dispatch.notes if decision.fused else []
            record(name(hooks.PATH), replace(decision, note="; ".join(notes)) if notes else decision)
        return out

    def _shared_on(self) -> bool:
        return self.shared_expert is not None and (self.intervention is None or self.intervention.shared_expert)

    def _shared_gate(self, x: mx.array) -> mx.array:
        gate = mx.sigmoid(self.shared_expert_gate(x))
        if self.intervention is not None and self.intervention.shared_gate_scale != 1.0:
            gate = gate * self.intervention.shared_gate_scale
        return gate

    def _fallback(self, x: mx.array) -> tuple[mx.array, tuple]:
        logits = self.gate(x)
        probs, inds, scores = route(logits, self.top_k, self.norm_topk_prob, self.intervention)
        expert_out = self.experts(x, inds)
        out = routed = weighted_sum(expert_out, scores)
        shared = gate = None
        if self._shared_on():
            shared, gate = self.shared_expert(x), self._shared_gate(x)
            out = out + gate * shared
        return out, (logits, probs, inds, scores, expert_out, routed, shared, gate)

    def _fused(self, x: mx.array, backend: str, recording: bool, residual: mx.array | None = None,
               selection: tuple | None = None) -> tuple[mx.array, tuple, mx.array | None]:
        """(output (+ residual), the recorded parts, the block output without the residual); while not
        `recording` the parts are mostly None and so is the block output. `selection`: the entry kernel's
        (logits, probs, ids, scores, shared gate), when it ran."""
        shared_mlp = self.shared_expert
        w = self.dispatch.fused_weights(
            self.experts, shared_mlp and (shared_mlp.gate_proj, shared_mlp.up_proj, shared_mlp.down_proj))
        shared_on = self._shared_on()
        if selection is not None:
            logits, probs, inds, scores, gate = selection
            logits = logits[..., : self.num_experts] if recording else None
        elif self.intervention is None:
            stacked = self.router_rows.get() if self.router_rows is not None else None
            logits = (stacked or self.gate)(x)
            probs, inds, scores, gate = fused_kernel.select(backend, logits, self.num_experts, self.top_k,
                                                            self.norm_topk_prob, stacked is not None)
            if stacked is not None:
                logits = logits[..., : self.num_experts] if recording else None
            elif shared_on:
                gate = self._shared_gate(x).astype(mx.float32)
        else:
            logits = self.gate(x)
            probs, inds, scores = route(logits, self.top_k, self.norm_topk_prob, self.intervention)
            gate = self._shared_gate(x).astype(mx.float32) if shared_on else None
        folded = fused_kernel.SharedExpert(*w.shared, gate) if shared_on and w.shared is not None else None
        if not shared_on:
            gate = None
        routed = block = None
        if shared_on and folded is None:  # the shared expert beside the kernels (dispatch.notes says why)
            shared = shared_mlp(x)
            out, expert_out, _ = fused_kernel.routed(backend, x, inds, scores, *w.experts)
            out = block = out + gate.astype(out.dtype) * shared
            if residual is not None:
                out = residual + out
        else:
            out, expert_out, shared = fused_kernel.routed(backend, x, inds, scores, *w.experts, folded, residual)
        if recording:
            weighted = weighted_sum(expert_out, scores)  # float32, as inside kernel B
            routed = weighted.astype(x.dtype)
            if block is None:
                block = (weighted if shared is None else weighted + gate * shared).astype(x.dtype)
        return out, (logits, probs, inds, scores, expert_out, routed, shared, gate), block


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, block: SparseMoeBlock | MLP, input_norm: RMSNorm, post_norm: RMSNorm):
        super().__init__()
        self.self_attn, self.mlp = attn, block
        self.input_layernorm, self.post_attention_layernorm = input_norm, post_norm

    def __call__(self, x: mx.array, cache: KVCache | None, layer: int, record: Recorder | None) -> mx.array:
        attn_out = self.self_attn(x, cache, self.input_layernorm)
        out, h = self.mlp.after_attention(x, attn_out, self.post_attention_layernorm, layer, record)
        if record is not None:
            record(hooks.resid_name(layer, hooks.RESID_PRE), x)
            record(hooks.resid_name(layer, hooks.RESID_MID), h)
            record(hooks.resid_name(layer, hooks.RESID_POST), out)
            if cache is not None:  # attention decided in this call
                record(hooks.resid_name(layer, hooks.ATTN_PATH), self.self_attn.dispatch.last)
        return out


class Qwen2MoeModel(nn.Module):
    """tokens [B, L] -> logits [B, L, vocab]; pass a cache (moebench.decode.cache.make_cache) to decode."""

    def __init__(self, args: ModelArgs, embed: Embedding, layers: list[DecoderLayer], norm: RMSNorm,
                 lm_head: Linear | None):
        super().__init__()
        self.args = args
        self.embed_tokens, self.layers, self.norm = embed, layers, norm
        if lm_head is not None:
            self.lm_head = lm_head
        self.recorder: Recorder | None = None

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        return {i: layer.mlp for i, layer in enumerate(self.layers) if isinstance(layer.mlp, SparseMoeBlock)}

    def dispatch_counters(self) -> list[DispatchCounter]:
        """Every fused-or-fallback decision point: each layer's attention, then each MoE block."""
        return [layer.self_attn.dispatch for layer in self.layers] + [b.dispatch for b in self.moe_blocks().values()]

    def hidden(self, tokens: mx.array, cache: list[KVCache] | None = None) -> mx.array:
        """Final-normed hidden states [B, L, D]."""
        record = self.recorder
        x = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cache[i] if cache is not None else None, i, record)
        return self.norm(x)

    def unembed(self, h: mx.array) -> mx.array:
        return self.lm_head(h) if "lm_head" in self else self.embed_tokens.as_linear(h)

    def __call__(self, tokens: mx.array, cache: list[KVCache] | None = None) -> mx.array:
        return self.unembed(self.hidden(tokens, cache))

    def last_logits(self, tokens: mx.array, cache: list[KVCache] | None = None) -> mx.array:
        """Logits [B, vocab] of the last position only: a prefill skips the unembedding of every other one."""
        return self.unembed(self.hidden(tokens, cache)[:, -1])


class Builder:
    """Builds a decoder from a checkpoint's tensors, checking every shape against the config.

    A family that differs (attention, MoE block) subclasses this and overrides that one method.
    """

    def __init__(self, args: ModelArgs, store, dtype: mx.Dtype):
        self.args, self.store, self.dtype = args, store, dtype

    def linear(self, name: str, out_f: int, in_f: int, bias: bool = False) -> Linear:
        return load_linear(self.store, name, out_f, in_f, self.dtype, self.args.quantization, bias)

    def norm(self, name: str, size: int | None = None) -> RMSNorm:
        size = size or self.args.hidden_size
        w = self.store.take(name)
        where = self.store.where(name)
        if tuple(w.shape) != (size,):
            raise CheckpointError(f"{where}: {name} has shape {tuple(w.shape)}, expected ({size},)")
        if not mx.issubdtype(w.dtype, mx.floating):
            raise CheckpointError(f"{where}: {name} is {w.dtype}, expected floating point")
        return RMSNorm(w.astype(self.dtype), self.args.rms_norm_eps)

    def mlp(self, prefix: str, width: int) -> MLP:
        d = self.args.hidden_size
        return MLP(self.linear(f"{prefix}.gate_proj", width, d), self.linear(f"{prefix}.up_proj", width, d),
                   self.linear(f"{prefix}.down_proj", d, width))

    def attention_projections(self, prefix: str, bias: bool) -> tuple[Linear, Linear, Linear, Linear]:
        a = self.args
        d, hd = a.hidden_size, a.head_dim
        return (
            self.linear(f"{prefix}.q_proj", a.num_attention_heads * hd, d, bias=bias),
            self.linear(f"{prefix}.k_proj", a.num_key_value_heads * hd, d, bias=bias),
            self.linear(f"{prefix}.v_proj", a.num_key_value_heads * hd, d, bias=bias),
            self.linear(f"{prefix}.o_proj", d, a.num_attention_heads * hd),
        )

    def attention(self, prefix: str) -> Attention:
        return Attention(self.args, *self.attention_projections(prefix, self.args.qkv_bias))

    def moe_block(self, prefix: str) -> SparseMoeBlock:
        a = self.args
        shared = shared_gate = None
        if a.shared_expert_intermediate_size:
            shared = self.mlp(f"{prefix}.shared_expert", a.shared_expert_intermediate_size)
            shared_gate = self.linear(f"{prefix}.shared_expert_gate", 1, a.hidden_size)
        experts = load_switch_glu(self.store, prefix, a.num_experts, a.hidden_size, a.moe_intermediate_size,
                                  self.dtype, a.quantization)
        return SparseMoeBlock(a, self.linear(f"{prefix}.gate", a.num_experts, a.hidden_size), experts, shared,
                              shared_gate)

    def model(self) -> Qwen2MoeModel:
        a = self.args
        embed = Embedding(self.linear("model.embed_tokens", a.vocab_size, a.hidden_size))
        layers = []
        for i in range(a.num_hidden_layers):
            p = f"model.layers.{i}"
            attn = self.attention(f"{p}.self_attn")
            attn.qkv.share_storage()  # q/k/v become views of the stacked rows: no second copy in memory
            block = self.moe_block(f"{p}.mlp") if a.is_moe_layer(i) else self.mlp(f"{p}.mlp", a.intermediate_size)
            layers.append(DecoderLayer(attn, block, self.norm(f"{p}.input_layernorm.weight"),
                                       self.norm(f"{p}.post_attention_layernorm.weight")))
            mx.eval(layers[-1].parameters())  # materialise layer by layer: bounded peak memory
        final_norm = self.norm("model.norm.weight")
        lm_head = None
        if not a.tie_word_embeddings:
            lm_head = self.linear("lm_head", a.vocab_size, a.hidden_size)
        else:  # tied: a stored lm_head is a copy transformers and mlx-lm ignore, and so do we
            for part in ("weight", "scales", "biases"):
                self.store.take_optional(f"lm_head.{part}")
        model = Qwen2MoeModel(a, embed, layers, final_norm, lm_head)
        mx.eval(model.parameters())
        return model


def build(args: ModelArgs, store, dtype: mx.Dtype) -> Qwen2MoeModel:
    """Build a Qwen2-MoE model from a checkpoint's tensors."""
    return Builder(args, store, dtype).model()


def tensor_shapes(args: ModelArgs) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Qwen2-MoE checkpoint in the HF float layout (per-expert), with its shape."""
    d, hd = args.hidden_size, args.head_dim
    yield "model.embed_tokens.weight", (args.vocab_size, d)
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (d,)
        yield f"{p}.post_attention_layernorm.weight", (d,)
        for name, heads in (("q_proj", args.num_attention_heads), ("k_proj", args.num_key_value_heads),
                            ("v_proj", args.num_key_value_heads)):
            yield f"{p}.self_attn.{name}.weight", (heads * hd, d)
            if args.qkv_bias:
                yield f"{p}.self_attn.{name}.bias", (heads * hd,)
        yield f"{p}.self_attn.o_proj.weight", (d, args.num_attention_heads * hd)
        if args.is_moe_layer(i):
            f = args.moe_intermediate_size
            yield f"{p}.mlp.gate.weight", (args.num_experts, d)
            for e in range(args.num_experts):
                yield f"{p}.mlp.experts.{e}.gate_proj.weight", (f, d)
                yield f"{p}.mlp.experts.{e}.up_proj.weight", (f, d)
                yield f"{p}.mlp.experts.{e}.down_proj.weight", (d, f)
            if args.shared_expert_intermediate_size:
                s = args.shared_expert_intermediate_size
                yield f"{p}.mlp.shared_expert.gate_proj.weight", (s, d)
                yield f"{p}.mlp.shared_expert.up_proj.weight", (s, d)
                yield f"{p}.mlp.shared_expert.down_proj.weight", (d, s)
                yield f"{p}.mlp.shared_expert_gate.weight", (1, d)
        else:
            f = args.intermediate_size
            yield f"{p}.mlp.gate_proj.weight", (f, d)
            yield f"{p}.mlp.up_proj.weight", (f, d)
            yield f"{p}.mlp.down_proj.weight", (d, f)
    yield "model.norm.weight", (d,)
    if not args.tie_word_embeddings:
        yield "lm_head.weight", (args.vocab_size, d)
