"""The fused steps a plan runs in place of a layer's modules, for one decode token.

LinearAttentionKernel: a Gated DeltaNet layer's in-projections, then the gated delta step kernel (convolution, q/k
norm, gates, the state's update, the gated norm), then its out-projection; the new states go into its cache.

AttentionKernel: the layer's input norm and the stacked q/k/v matmul, then the decode-attention kernel (bias, the q/k
norm where the family has one, RoPE, attention over the cache and the new token), then o_proj with the residual add
in one kernel where it can read o_proj (else the matmul and the add); the new key and value go into the cache,
stored by the kernel itself in place where the plan says the cache allows it (a compiled step's static cache on a
GPU).

MoeKernel: one kernel normalising the block's input and computing the router's and the shared gate's logits over
their stacked rows where it can read them (else the norm and one matmul), and the kernel pair, whose first kernel
selects the experts from the logits itself, with the shared expert and the residual add inside, everything after the
logits in float32. Where the experts are sharded over ranks the router kernel selects them before the pair (each
rank picks its slots from the ids); with an intervention set, routing runs through moebench.models.routing.route
instead; a shared expert stored unlike the routed experts runs beside the kernels.
Recording keeps the same launches and adds the recorded parts beside them.

Each step says what it launches for one unrecorded decode token on the GPU path (`launches`, the graph nodes it
builds there, moebench.execution.plan.Launches); on the reference backend each kernel runs as compiled MLX ops
instead, so there the count is what the same decisions launch on a GPU (whose plan may still decide otherwise:
its cap on the experts' width).
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx

from ..decode.cache import GROW_STEP
from ..decode.state import empty_state
from ..models import hooks
from ..models.declare import (
    CLAMPED_SWIGLU,
    PER_HEAD,
    SIGMOID_GATED,
    SIGMOID_GROUPED,
    WHOLE_PROJECTION,
    AttentionParts,
    AttentionSpec,
    LatentAttentionSpec,
    LinearAttentionSpec,
    MoeBlock,
    MoeParts,
)
from ..models.gated_delta import gates, record_linear
from ..models.hooks import Record
from ..models.layers import ColumnShard, Linear
from ..models.routing import recorded_choice, route, shared_takes_part
from ..models.run import token_mixer
from ..models.sharding import attention_note, block_note
from ..models.switch import ExpertShard, weighted_sum
from . import attention, linear_attention, moe
from .attention import QKNorm, rope_frequencies
from .kernel import run_compiled
from .plan import Launches
from .rows import ROWS_WARPS, Norm, Rows
from .rows import linear as rows_linear
from .support import attention_reason, linear_attention_reason, rotary_dims, rows_reason
from .weights import Derived, FusedWeights, RowStack

ROUTE_NOTE = "routing by moebench.models.routing.route (an intervention is set), not the kernels' selection"
# The cache capacity the launches are declared for: the least a decode cache holds (a KVCache grows by GROW_STEP
# slots, the compiled step's StaticCache rounds its capacity up to the same 256). The attention's combine launch
# depends on it: it joins the partials of the threadgroups that split more than SPLIT_POSITIONS (128) attended
# slots (attention.splits), so every larger capacity launches the same, and a window of at most 128 never does (nor
# a kernel that joins them itself: AttentionKernel.counter).
DECLARED_CAPACITY = GROW_STEP


def linear_launches(what: str, linear, bias: bool = True) -> Launches:
    """A Linear's x W^T on one token: one quantized matmul and, with `bias` (the call adds the module's bias), the
    bias broadcast to the token's shape and the add."""
    if isinstance(linear, ColumnShard):
        return Launches(None, f"{what} sharded over ranks (its partial sums joined by all_sum)")
    if not isinstance(linear, Linear) or linear.mode is None:
        return Launches(None, f"{what} not a quantized Linear (a float x @ W^T adds MLX's transpose and reshapes)")
    added = (f"{what} bias (broadcast)", f"{what} bias (add)") if bias and "bias" in linear else ()
    return Launches((f"{what} (quantized matmul)", *added))


class LayerWeights:
    """What one decoder layer's kernels read, derived from its modules: the stacked q/k/v rows (q_proj's as the
    module stores them, an output gate's rows included; the module's own arrays become views of them, so both cost
    the memory of one; none for a linear-attention layer), the router's rows stacked with the shared expert gate's,
    and the experts' quantized parts; each rebuilt when a weight is replaced."""

    def __init__(self, layer, block: MoeBlock | None = None):
        """`block`: the layer's MoE block (the model's moe_blocks()), None for a dense MLP layer."""
        attn = token_mixer(layer)
        self.block = block
        self.has_shared = block is not None and block.spec.shared is not None  # decided once, read every step
        self.qkv = None
        if isinstance(attn.spec, AttentionSpec):
            parts = attn.parts()
            self.qkv = RowStack(parts.q_proj, parts.k_proj, parts.v_proj)
            self.qkv.share_storage()
        gated = block is not None and block.spec.shared == SIGMOID_GATED
        self.router = RowStack(block.parts().router, block.parts().shared_gate) if gated else None
        self.experts = Derived(FusedWeights.build) if block is not None else None

    def fused(self, parts: MoeParts) -> FusedWeights:
        e, s = parts.experts, parts.shared
        shared = (s.gate_proj, s.up_proj, s.down_proj) if self.has_shared else ()
        return self.experts.get(e.gate_proj, e.up_proj, e.down_proj, *shared)


def attention_step_reason(attn, weights: LayerWeights) -> str | None:
    """Why the decode-attention kernel cannot run this layer's token mixing (`attn`), whatever the token, or
    None."""
    spec = attn.spec
    if isinstance(spec, LinearAttentionSpec):
        return linear_attention_reason(spec)
    if isinstance(spec, LatentAttentionSpec):
        return LATENT_REASON
    if weights.qkv.get() is None:
        return "q, k and v are stored differently (no stacked projection for the kernel)"
    return attention_reason(spec)


LATENT_REASON = ("multi-head latent attention (the decode-attention kernel reads keys and values of one width per "
                 "head; the latent step runs as MLX ops)")
PROJECTION_NORM_NOTE = "q and k normed over the whole projection by MLX ops before the kernel (it sees one head)"


def attention_step_note(attn, step: AttentionKernel, by_ops: list[int]) -> str | None:
    """What a fused attention layer runs beside the kernels, and why, and on a sharded model which heads it holds;
    `by_ops`: the attention layers running as MLX ops whose writes keep a static cache from being written in place
    (none where the cache is not static)."""
    notes = [PROJECTION_NORM_NOTE if attn.spec.qk_norm == WHOLE_PROJECTION else None, attention_note(attn)]
    if step.o_note is not None:
        notes.append(f"o_proj and the residual add as their own launches: {step.o_note}")
    if by_ops:
        notes.append(f"keys and values written by the cache's update, not in place: layers {by_ops} run attention "
                     "by MLX ops")
    return "; ".join(n for n in notes if n) or None


def rotary(spec: AttentionSpec, parts: AttentionParts) -> tuple[mx.array, float]:
    """The layer's rotation frequencies [rotary_dims / 2] and the attention factor multiplying q and k: at
    rope_theta and 1, or, where the layer declares scaled rotary, its own (the parts' scaled_frequencies and
    rope_factor)."""
    if not spec.scaled_rope:
        return rope_frequencies(rotary_dims(spec), parts.rope_theta), 1.0
    inv_freq = parts.scaled_frequencies
    mx.eval(inv_freq)
    return inv_freq, float(parts.rope_factor)


class AttentionKernel:
    """One layer's attention for one token through the decode-attention kernel on `backend`:
    residual + attention(norm(residual)). With `write` the kernel stores the token's key and value in the cache
    buffers in place, and on CUDA the kernel joins its split threadgroups' partials itself (its counter made
    here, written in place as the cache is), so no combine launch follows. The rows kernel computes o_proj with
    the residual add where it can read o_proj (support.rows_reason; `o_note` says why not, and then the matmul and
    the add run as their own launches). The layer's declared variants ride along: partial or scaled rotary (its
    frequencies and attention factor), the sinks (the heads this process holds), the window and the output gate
    (inside the kernel; a recorded step records sigmoid(gate) as the module does), and q, k and v clamped before
    the kernel, after the whole-projection norm where the family has one (the kernel is handed the declaration
    without the clamp, as it sees them clamped)."""

    def __init__(self, attn, weights: LayerWeights, backend: str, write: bool, dtype: mx.Dtype):
        """`dtype`: the activations'."""
        spec, parts = attn.spec, attn.parts()
        self.o_proj, self.qkv, self.backend, self.write = parts.o_proj, weights.qkv, backend, write
        self.heads, self.clip = replace(spec, clip_qkv=None), spec.clip_qkv
        self.inv_freq, self.rope_scale = rotary(spec, parts)
        self.sinks = parts.sinks if spec.sinks else None
        self.norms = (parts.q_norm, parts.k_norm) if self.heads.qk_norm is not None else None
        self.o_note = rows_reason("o_proj", self.o_proj, dtype, ROWS_WARPS)
        self.counter = attention.new_counter(spec.n_kv_heads) if write and backend == "cuda" else None

    def __call__(self, norm, residual: mx.array, cache, record: Record | None = None) -> mx.array:
        """`record`: the layer's `mixer` record (a recorded step), where the output gate is recorded."""
        stacked = self.qkv.get()
        keys, values, slots, block = cache.decode_buffers(self.heads.n_kv_heads, self.heads.head_dim, residual.dtype)
        qkv, bias, qk_norm = stacked.matmul(norm(residual)), stacked.get("bias"), None
        if self.heads.qk_norm == PER_HEAD:  # inside the kernel
            qk_norm = QKNorm(self.norms[0]["weight"], self.norms[1]["weight"], self.norms[0].eps)
        elif self.heads.qk_norm == WHOLE_PROJECTION:  # across every head: before the kernel, which sees one head
            qkv, bias = self._whole_projection_norm(qkv if bias is None else qkv + bias), None
        if self.clip is not None:
            qkv, bias = mx.clip(qkv if bias is None else qkv + bias, -self.clip, self.clip), None
        if record is not None and self.heads.output_gate:
            self._record_gate(qkv if bias is None else qkv + bias, record)
        sinks = None if self.sinks is None else self.sinks.astype(residual.dtype)  # the activation dtype, as attended
        out, k, v = attention.decode_attention(self.backend, qkv, bias, self.inv_freq, slots, keys, values, self.heads,
                                               block, self.write, qk_norm, sinks, self.rope_scale, self.counter)
        if self.write:
            cache.written_in_place(k, v)
        else:
            cache.write(k, v)
        if self.o_note is None:
            return rows_linear(self.backend, out, Rows.of(self.o_proj), residual=residual)[1]
        return residual + self.o_proj(out)

    def launches(self, static: bool, dtype: mx.Dtype) -> Launches:
        """What __call__ builds on a GPU backend for activations in `dtype`, over DECLARED_CAPACITY cache slots of a
        compiled step's static cache (`static`: the kernel writes it in place) or a KVCache (two slice updates); the
        partials of split threadgroups joined by a second launch unless the kernel joins them (self.counter)."""
        stacked = self.qkv.get()
        bias = ("q/k/v bias (broadcast)", "q/k/v bias (add)") if "bias" in stacked else ()  # else inside the kernel
        projection = Launches(("input norm (rms_norm)",)) + linear_launches("q/k/v projection", stacked, False)
        names = []
        if self.heads.qk_norm == WHOLE_PROJECTION:
            names += [*bias, "q/k/v (split)", "q norm over the projection (rms_norm)",
                      "k norm over the projection (rms_norm)", "q/k/v (concatenate)"]
            bias = ()
        if self.clip is not None:
            names += [*bias, "q/k/v clamp bound (broadcast)", "q/k/v clamp (maximum)", "q/k/v clamp bound (broadcast)",
                      "q/k/v clamp (minimum)"]
        if self.sinks is not None and self.sinks.dtype != dtype:
            names.append("sinks (astype)")
        names.append("decode attention (kernel)")
        if self.counter is None and \
                attention.splits(attention.attended(self.heads, DECLARED_CAPACITY), self.heads.n_kv_heads) > 1:
            names.append("attention combine (kernel)")
        if not static:
            names += ["key cache write (slice_update)", "value cache write (slice_update)"]
        if self.o_note is None:
            return projection + Launches((*names, "o_proj + residual (kernel)"))
        return (projection + Launches(tuple(names)) + linear_launches("o_proj", self.o_proj)
                + Launches(("residual (add)",)))

    def _record_gate(self, projected: mx.array, record: Record) -> None:
        """sigmoid of each head's gate rows of the projection (bias added), float32 [1, H, hd], as the module
        records it (hooks.OUTPUT_GATE)."""
        h, hd = self.heads.n_heads, self.heads.head_dim
        gate = projected[..., : 2 * h * hd].reshape(-1, h, 2, hd)[:, :, 1]
        record(hooks.OUTPUT_GATE, mx.sigmoid(gate).astype(mx.float32))

    def _whole_projection_norm(self, qkv: mx.array) -> mx.array:
        """q and k of the stacked projection [..., (H + 2 KV) hd] each RMS-normed over its whole width."""
        q_width, kv_width = self.heads.n_heads * self.heads.head_dim, self.heads.n_kv_heads * self.heads.head_dim
        q, k, v = mx.split(qkv, [q_width, q_width + kv_width], axis=-1)
        return mx.concatenate([self.norms[0](q), self.norms[1](k), v], axis=-1)


class LinearAttentionKernel:
    """One linear-attention layer (Gated DeltaNet) for one token: the module's in-projections, the gated delta
    step kernel on `backend` (moebench.execution.linear_attention), the module's out-projection; the new conv and
    delta states go into the layer's cache as the module writes them, so a rollback, the Stepper and the compiled
    step see the same states either way. With `record` (a recorded forward hands it the layer's `mixer` record) it
    records what the module records: the gates from the projections, the state norm after the step, silu(z)."""

    def __init__(self, net, backend: str):
        self.net, self.backend, self.spec = net, backend, net.spec

    def __call__(self, norm, residual: mx.array, cache, record: Record | None = None) -> mx.array:
        parts = self.net.parts()
        qkv, z, b, a = parts.project(norm(residual))
        conv, delta = cache.conv, cache.delta
        if conv is None:  # before the first position
            conv, delta = empty_state(self.spec, qkv.dtype)
        weights = linear_attention.GatedDeltaWeights.of(parts)
        out, conv, delta = linear_attention.gated_delta_step(self.backend, qkv, z, b, a, conv, delta, weights,
                                                             self.spec)
        if record is not None:
            record_linear(record, *gates(a, b, weights.a_log, weights.dt_bias), delta, z)
        cache.write(conv, delta, 1)
        return residual + parts.out_proj(out)

    def launches(self, static: bool, dtype: mx.Dtype) -> Launches:
        """Not declared: the in-projections are the layer's own MLX ops, their reshapes and splits as its stored
        layout has them."""
        return Launches(None, "linear attention: its in-projections are the layer's own MLX ops "
                              "(LinearAttentionParts.project)")


class MoeKernel:
    """One MoE block for one token through the kernel pair on `backend`, its first kernel selecting the experts
    (moe.routed_by_router; the router kernel before the pair where the experts are sharded):
    residual + block(norm(residual)). One kernel normalises the residual stream and computes the router's logits
    where it can read the norm and the router (support.rows_reason; `router_note` says why not, and then
    the norm and the router's matmul run as their own launches). The block's declared variants ride along: its
    scoring (the selection's), its experts' biases and clamped SwiGLU (the pair's); a router bias is added to
    the logits. `intervention`: the one set on the block when the plan was made (a plan's key holds it, so it is
    the one in force whenever the plan runs), or None."""

    def __init__(self, block: MoeBlock, weights: LayerWeights, backend: str, rows: int, intervention: object,
                 norm, dtype: mx.Dtype):
        self.block, self.weights, self.backend, self.rows = block, weights, backend, rows
        self.intervention = intervention
        spec, parts = block.spec, block.parts()
        self.router_note = ROUTE_NOTE if intervention is not None else \
            rows_reason("the router", self._router(parts), dtype, ROWS_WARPS, norm)
        self.eps = mx.array([norm.eps], mx.float32) if self.router_note is None else None  # the kernel's input
        self.shared_on = shared_takes_part(spec, intervention)
        self.shard = parts.experts if isinstance(parts.experts, ExpertShard) else None
        self.split_shared = spec.shared is not None and isinstance(parts.shared.down_proj, ColumnShard)
        self.clamp = parts.experts.clamp if spec.activation == CLAMPED_SWIGLU else None
        self.grouped = spec.scoring == SIGMOID_GROUPED  # the router kernel's selection-biased variant

    def _router(self, parts: MoeParts) -> Linear:
        """The router's rows as one Linear: stacked with the shared expert gate's where the block has one and both
        are stored alike (LayerWeights.router), else the router's own."""
        stacked = self.weights.router.get() if self.weights.router is not None else None
        return stacked or parts.router

    def __call__(self, norm, residual: mx.array, record: Record | None) -> mx.array:
        b, recording = self.block, record is not None
        shape = residual.shape
        if recording:  # one token as [1, D]: the same launches, the recorded parts [1, ...] like the fallback's
            residual = residual.reshape(1, -1)
        spec, parts = b.spec, b.parts()
        w = self.weights.fused(parts)
        shared_on, intervention = self.shared_on, self.intervention
        stacked, by_router = False, intervention is None and self.shard is None
        if intervention is None:
            router = self._router(parts)
            stacked = router is not parts.router
            grouped = moe.GroupedChoice.of(spec, parts.selection_bias) if self.grouped else None
            choice = (spec.num_experts, spec.top_k, spec.renormalize, stacked, spec.scoring, grouped)
            if self.router_note is None:
                xn, logits = rows_linear(self.backend, residual, Rows.of(router), Norm.of(norm, self.eps))
            else:
                xn = norm(residual)
                logits = router(xn)
            if not by_router:  # the ids before the pair: each rank picks its slots
                probs, inds, scores, gate = moe.select(self.backend, logits, *choice)
        else:
            xn = norm(residual)
            logits = parts.router(xn)
            probs, inds, scores = route(logits, spec, intervention, selection_bias=parts.selection_bias)
        router_gate = shared_on and stacked  # the shared expert's gate: the stacked row's sigmoid
        if not router_gate:
            gate = b.shared_scale(xn).astype(mx.float32) if shared_on else None
        folded = moe.SharedExpert(*w.shared, None if by_router and router_gate else gate) \
            if shared_on and w.shared is not None else None
        beside = shared_on and folded is None  # the shared expert beside the kernels (the plan's note says why)
        variant = None if w.biases is None and self.clamp is None else moe.ExpertVariant(w.biases, self.clamp)
        if by_router:
            out, expert_out, shared, probs, inds, scores, sgate = moe.routed_by_router(
                self.backend, xn, logits, *choice, *w.experts, folded, None if beside else residual, self.rows,
                variant)
            if router_gate:
                gate = sgate
        else:
            slots, weights, once = inds, scores, True
            if self.shard is not None:  # this rank's experts; the residual (and a whole shared expert) on rank 0
                held, slots = self.shard.owned(inds)
                weights, once = mx.where(held, scores, 0), self.shard.group.rank() == 0
            mine = once or self.split_shared  # a split shared expert: every rank adds its share of the width
            out, expert_out, shared = moe.routed(self.backend, xn, slots, weights, *w.experts,
                                                 folded if mine else None,
                                                 residual if once and not beside else None, self.rows, variant)
        if stacked:
            logits = logits[..., : spec.num_experts] if recording else None
        if self.shard is not None and recording:  # every rank records every slot: the others' by the same all_sum
            out, expert_out, shared = self._summed_with_records(out, expert_out, shared, held, folded, mine, xn)
        elif self.shard is not None:
            out = mx.distributed.all_sum(out, group=self.shard.group)
        block_out = None
        if beside:
            shared = parts.shared(xn)
            out = block_out = out + gate.astype(out.dtype) * shared
            out = residual + out
        if recording:
            weighted, mixed = run_compiled(recorded_mix, (xn.dtype,), expert_out, scores, shared, gate)
            hooks.record_moe(record, logits, probs, inds, scores, expert_out, weighted, shared, gate,
                             mixed if block_out is None else block_out,
                             recorded_choice(probs, spec, parts.selection_bias))
            out = out.reshape(shape)
        return out

    def launches(self, dtype: mx.Dtype) -> Launches:
        """What __call__ builds unrecorded on a GPU backend for activations in `dtype`: the rows kernel's norm and
        logits (or the norm and the router's matmul) and the kernel pair, its first kernel selecting the experts
        (with the casts the pair makes of stored dtypes unlike the kernels'), or not declared where a part runs as
        MLX ops the block or moebench.models builds."""
        if self.intervention is not None:
            return Launches(None, ROUTE_NOTE)
        if self.shard is not None:
            return Launches(None, "experts sharded over ranks (this rank's slots picked by MLX ops, joined by all_sum)")
        parts = self.block.parts()
        w = self.weights.fused(parts)
        router = self._router(parts)
        stacked = router is not parts.router
        if self.shared_on and w.shared is None:
            return Launches(None, f"the shared expert beside the kernels (its own MLP): {w.shared_note}")
        if self.shared_on and not stacked:
            return Launches(None, "the shared expert's factor from the block's shared_scale (its own MLX ops)")
        if self.router_note is None:
            router_launches = Launches(("post-attention norm + router logits (kernel)",))
        else:
            router_launches = (Launches(("post-attention norm (rms_norm)",))
                               + linear_launches("router + shared gate rows" if stacked else "router", router))
        scale = w.experts[0].scales.dtype  # the pair casts every projection's scales and biases to it
        stored = [a for p in (*w.experts, *(w.shared or w.experts)) for a in (p.scales, p.biases) if a is not None]
        casts = (("quantization scales or biases (astype)",) * sum(a.dtype != scale for a in stored)
                 + ("expert bias (astype)",) * sum(b.dtype != dtype for b in w.biases or ()))
        return router_launches + Launches((*casts, "router + gate/up (kernel)", "down + residual (kernel)"))

    def _summed_with_records(self, out: mx.array, expert_out: mx.array, shared: mx.array | None, held: mx.array,
                             folded, mine: bool, xn: mx.array) -> tuple[mx.array, mx.array, mx.array | None]:
        """The block output and the recorded expert (and folded shared expert) outputs summed over the ranks in one
        all_sum (in float32): the ranks' graphs differ (the residual and a whole shared expert on rank 0 alone), and
        MLX orders independent collectives by each rank's graph, so separate all_sums could pair one rank's block
        output with another's records."""
        parts = [out.astype(mx.float32).reshape(-1), mx.where(held[..., None], expert_out, 0).reshape(-1)]
        if folded is not None:
            parts.append((shared if mine else mx.zeros(xn.shape, mx.float32)).reshape(-1))
        summed = mx.distributed.all_sum(mx.concatenate(parts), group=self.shard.group)
        ends = (out.size, out.size + expert_out.size)
        out_sum = summed[: ends[0]].reshape(out.shape).astype(out.dtype)
        experts = summed[ends[0] : ends[1]].reshape(expert_out.shape)
        return out_sum, experts, summed[ends[1] :].reshape(xn.shape) if folded is not None else shared


def recorded_mix(expert_out: mx.array, scores: mx.array, shared: mx.array | None, gate: mx.array | None,
                 dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """What a recorded fused block hands its record beside the kernels' outputs: the routed experts' weighted sum
    and the block's output (with the shared expert's gated share), summed in float32 as inside kernel B, each
    cast to the activation dtype."""
    weighted = weighted_sum(expert_out, scores)
    mixed = weighted if shared is None else weighted + gate * shared
    return weighted.astype(dtype), mixed.astype(dtype)


def moe_note(block, weights: LayerWeights, router_note: str | None) -> str | None:
    """What a fused MoE block runs beside the kernels, and why (None: nothing); `router_note`: why the rows kernel
    does not normalise the block's input and compute its logits (MoeKernel.router_note: ROUTE_NOTE when an
    intervention is set on the block), or None."""
    notes = []
    shared_note = weights.fused(block.parts()).shared_note
    if shared_note:
        notes.append(f"shared expert beside the kernels: {shared_note}")
    if (sharded := block_note(block)) is not None:
        notes.append(sharded)
    if router_note == ROUTE_NOTE:
        notes.append(ROUTE_NOTE)
    elif router_note is not None:
        notes.append(f"the norm and the router's matmul as their own launches: {router_note}")
    return "; ".join(notes) or None
