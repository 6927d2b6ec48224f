"""Gated DeltaNet linear attention (the token mixing of three in four Qwen3-Next / Qwen3.5 layers), top to bottom.

For each token t, from the normed hidden state x_t:
1. projections: q, k, v (key heads of key_dim for q and k, value heads of value_dim for v), z (the output gate,
   per value head), b and a (one number per value head each). Qwen3-Next fuses them in two matrices whose rows
   are grouped per key head (`in_proj_qkvz`: per key head its q, k, then its value heads' v and z; `in_proj_ba`:
   per key head its value heads' b then a); Qwen3.5 keeps four (`in_proj_qkv` as [q | k | v], `in_proj_z`,
   `in_proj_b`, `in_proj_a`). The numbers are the same either way once split.
2. a causal depthwise convolution over the last `conv_kernel` positions of [q | k | v], then SiLU. The
   conv_kernel - 1 positions before the first of a call are the conv state (zeros before the sequence).
3. q and k L2-normalised per head (eps 1e-6 added to the sum of squares), q also scaled by key_dim^-1/2.
4. the gated delta rule, per value head (a key head serves num_value_heads / num_key_heads consecutive value
   heads), its state S [value_dim, key_dim] in float32:
       decay g_t = exp(-exp(A_log) * softplus(a_t + dt_bias)),   beta_t = sigmoid(b_t)
       S = g_t S;   S = S + beta_t (v_t - S k_t) k_t^T;   o_t = S q_t
   token by token for a decode step; a prompt in chunks of positions (chunked_delta_rule: the same numbers up
   to float32 rounding, a few graph nodes per chunk instead of ~8 per position).
5. o_t RMSNorm'ed per value head (weight as stored, no +1), times silu(z_t); then the output projection.

The conv and delta states live in the cache (moebench.decode.state.LinearAttentionState), never in the module.
The arithmetic is mlx-lm's (mlx_lm.models.gated_delta and qwen3_next); transformers' torch functions compute the
same numbers with the state transposed ([key_dim, value_dim]).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError
from . import hooks
from .args import ModelArgs
from .declare import GATED_DELTA, LinearAttentionParts, LinearAttentionSpec
from .hooks import Record
from .layers import Linear

FUSED_QKVZ = "in_proj_qkvz + in_proj_ba, rows grouped per key head (Qwen3-Next)"
SPLIT_QKV_Z_B_A = "in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (Qwen3.5)"
LAYOUTS = (FUSED_QKVZ, SPLIT_QKV_Z_B_A)
L2_EPS = 1e-6  # added to the sum of squares of q and k (the FLA library's and transformers' l2norm)


@dataclass(frozen=True)
class LinearAttentionArgs:
    """The linear-attention layers' sizes (config.json's linear_num_key_heads, linear_num_value_heads,
    linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim) and how the projections are stored."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layout: str

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ConfigError(f"linear attention layout {self.layout!r} is not one of {LAYOUTS}")
        if self.num_value_heads % self.num_key_heads:
            raise ConfigError(f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                              f"linear_num_key_heads ({self.num_key_heads})")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the convolution runs over: [q | k | v]."""
        return 2 * self.key_dim + self.value_dim


class DepthwiseConv1d(nn.Module):
    """One filter of `kernel` taps per channel, weight [channels, kernel, 1] (MLX's layout; transformers stores
    [channels, 1, kernel])."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((channels, kernel, 1))

    def __call__(self, window: mx.array) -> mx.array:
        """[B, kernel - 1 + L, C] (the conv state, then L new positions) -> [B, L, C]."""
        return mx.conv1d(window, self["weight"], groups=window.shape[-1])


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output (its weight as stored), times silu(z) in float32."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight, self.eps = mx.ones((dims,)), eps

    def __call__(self, x: mx.array, z: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(x, self["weight"], self.eps).astype(mx.float32)
        return (nn.silu(z.astype(mx.float32)) * normed).astype(x.dtype)


def normalize_qk(q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
    """q / |q| * key_dim^-1/2 and k / |k| per head (|x| = sqrt(sum x^2 + L2_EPS)), through the fused rms_norm:
    rms_norm(x, eps / d) = x / sqrt((sum x^2 + eps) / d) = sqrt(d) * x / |x|."""
    d = q.shape[-1]
    q = mx.fast.rms_norm(q, None, L2_EPS / d) / d
    k = mx.fast.rms_norm(k, None, L2_EPS / d) * d**-0.5
    return q, k


def gates(a: mx.array, b: mx.array, a_log: mx.array, dt_bias: mx.array) -> tuple[mx.array, mx.array]:
    """(decay g, beta) per position and value head, float32: g = exp(-exp(A_log) * softplus(a + dt_bias)),
    beta = sigmoid(b)."""
    g = mx.exp(-mx.exp(a_log.astype(mx.float32)) * nn.softplus((a + dt_bias).astype(mx.float32)))
    return g, mx.sigmoid(b.astype(mx.float32))


def delta_step(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
               state: mx.array) -> tuple[mx.array, mx.array]:
    """One token: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dv, Dk] -> (o [B, H, Dv], state)."""
    state = state * g[..., None, None]
    remembered = (state * k[..., None, :]).sum(axis=-1)  # S k: what the state already returns for k
    state = state + ((v - remembered) * beta[..., None])[..., None] * k[..., None, :]
    return (state * q[..., None, :]).sum(axis=-1), state


STEPPED_BELOW = 4  # prompts this short are stepped (delta_rule says why)


def delta_rule(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
               state: mx.array) -> tuple[mx.array, mx.array]:
    """Positions in order: q, k [B, L, Hk, Dk], v [B, L, Hv, Dv], g, beta [B, L, Hv], state [B, Hv, Dv, Dk]
    (float32) -> (o [B, L, Hv, Dv] float32, the state after the last position).

    Fewer than STEPPED_BELOW positions (a decode step among them: it stays exactly the per-token update) are
    stepped, the rest run chunked. What decides is the size of the graph, which sets the cost where every node is
    a kernel launch: stepping adds ~34 nodes a position (MLX 0.32), the chunked form ~120 to start with and ~20 a
    chunk (its chunks shrink to a short prompt, chunk_size), so the two graphs are about the same size at 4
    positions and 2048 positions are ~1,000 nodes instead of ~70,000. The arithmetic is about the same either way
    (some three state-sized products a position), so where it decides (a CPU) the chunked form gains less."""
    if q.shape[1] < STEPPED_BELOW:
        return stepped_delta_rule(q, k, v, g, beta, state)
    return chunked_delta_rule(q, k, v, g, beta, state)


def per_value_head(q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """q and k repeated for the value heads they serve (a key head serves Hv / Hk consecutive ones), all float32."""
    group = v.shape[2] // q.shape[2]
    if group > 1:
        q, k = mx.repeat(q, group, axis=2), mx.repeat(k, group, axis=2)
    return q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32)


def stepped_delta_rule(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                       state: mx.array) -> tuple[mx.array, mx.array]:
    """delta_rule one position at a time through delta_step (the definition the chunked form must equal)."""
    q, k, v = per_value_head(q, k, v)
    outputs = []
    for t in range(q.shape[1]):
        o, state = delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outputs.append(o)
    return mx.stack(outputs, axis=1), state


CHUNK = 64  # positions solved together (a power of two: unit_lower_inverse doubles its blocks up to it)


def chunk_size(length: int) -> int:
    """CHUNK, or for a shorter prompt the power of two that holds it (less padding to compute)."""
    return min(CHUNK, 1 << (length - 1).bit_length())


def in_chunks(x: mx.array, size: int) -> mx.array:
    """[B, L, H, ...] -> [L / size, B, H, size, ...], the positions padded with zeros to whole chunks; chunk first,
    so that one chunk of what is computed from it is one contiguous block."""
    batch, length, heads = x.shape[:3]
    pad = -length % size
    if pad:
        x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(batch, -1, size, heads, *x.shape[3:])
    return x.transpose(1, 0, 3, 2, *range(4, x.ndim))


def segment_log_decays(log_g: mx.array) -> mx.array:
    """log g [..., C] -> [..., C, C]: at [t, s] the log of the decay from position s to t within a chunk,
    g_{s+1} ... g_t (0 at t = s, -inf above the diagonal). Each entry is summed over its own segment rather than
    taken as a difference of running sums, which would cancel away the small decays after large ones."""
    size = log_g.shape[-1]
    rows, cols = mx.arange(size)[:, None], mx.arange(size)[None]
    spread = mx.where(rows > cols, log_g[..., :, None], 0.0)  # [t, s] = log g_t where s < t
    return mx.where(rows >= cols, mx.cumsum(spread, axis=-2), -mx.inf)


def unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 for a strictly lower triangular a [..., C, C] (C a power of two), by doubling blocks: the
    inverse of [[A, 0], [X, B]] is [[A^-1, 0], [-B^-1 X A^-1, B^-1]]. Matmuls only (no linalg, which MLX runs
    on the CPU alone), log2(C) levels instead of C row substitutions."""
    *lead, size, _ = a.shape
    inverse, block = mx.ones((*lead, size, 1, 1), a.dtype), 1
    while block < size:
        count = size // (2 * block)
        pairs = a.reshape(*lead, count, 2 * block, count, 2 * block)
        lower = mx.moveaxis(mx.diagonal(pairs, axis1=-4, axis2=-2), -1, -3)[..., block:, :block]
        halves = inverse.reshape(*lead, count, 2, block, block)
        first, second = halves[..., 0, :, :], halves[..., 1, :, :]
        corner = -(second @ lower @ first)
        inverse = mx.concatenate([mx.concatenate([first, mx.zeros_like(first)], axis=-1),
                                  mx.concatenate([corner, second], axis=-1)], axis=-2)
        block *= 2
    return inverse.reshape(*lead, size, size)


def chunked_delta_rule(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                       state: mx.array) -> tuple[mx.array, mx.array]:
    """delta_rule a chunk of positions at a time (the WY form): equal to stepping up to float32 rounding.

    Within a chunk, with D(t, s) = g_{s+1} ... g_t and D(t) the decay from the chunk's start, each position
    writes u_s k_s^T into the state, u_s = beta_s (v_s - D(s) S0 k_s - sum_{r<s} D(s, r) (k_s . k_r) u_r):
    a unit lower triangular system (I + A) U = beta V - beta D K S0^T, solved once for all chunks. Then
    o_t = D(t) S0 q_t + sum_{s<=t} D(t, s) (q_t . k_s) u_s and the state after the chunk is
    D(end) S0 + sum_s D(end, s) u_s k_s^T; only that carry runs chunk after chunk. Every decay is exp of a sum
    of log g <= 0, masked to -inf before exp, so nothing exponentiated is positive. The state is carried
    transposed, S^T [B, H, Dk, Dv], and k^T made contiguous once: a matmul of a transposed operand is some
    2.5x slower on a CPU's BLAS."""
    length, size = q.shape[1], chunk_size(q.shape[1])
    q, k, v = (in_chunks(t, size) for t in per_value_head(q, k, v))  # [N, B, H, C, D]
    log_g, beta = in_chunks(mx.log(g), size), in_chunks(beta, size)  # [N, B, H, C]; padding: g = 1, beta = 0
    from_start = mx.exp(mx.cumsum(log_g, axis=-1))[..., None]  # D(t)
    between = mx.exp(segment_log_decays(log_g))  # D(t, s), 0 above the diagonal; its last row is D(end, s)
    k_t = mx.contiguous(k.swapaxes(-1, -2))
    strictly_lower = mx.arange(size)[:, None] > mx.arange(size)[None]
    solve = unit_lower_inverse(mx.where(strictly_lower, beta[..., None] * between * (k @ k_t), 0.0))
    new_values = solve @ (beta[..., None] * v)  # U = new_values - from_state @ S0^T
    from_state = solve @ (beta[..., None] * from_start * k)
    within = between * (q @ k_t)
    q_decayed, k_to_end_t = from_start * q, k_t * between[..., -1:, :]  # k_s^T D(end, s)
    chunk_decay = from_start[..., -1, :, None]  # [N, B, H, 1, 1]: D(end)
    carried = mx.contiguous(state.swapaxes(-1, -2))
    outputs = []
    for n in range(q.shape[0]):
        u = new_values[n] - from_state[n] @ carried
        outputs.append(q_decayed[n] @ carried + within[n] @ u)
        carried = chunk_decay[n] * carried + k_to_end_t[n] @ u
    out = mx.stack(outputs).transpose(1, 0, 3, 2, 4)  # [B, N, C, H, Dv]
    return out.reshape(out.shape[0], -1, *out.shape[3:])[:, :length], carried.swapaxes(-1, -2)


class GatedDeltaNet(nn.Module):
    """The linear-attention layer: x [B, L, D] -> [B, L, D], continuing the states in `cache` (a
    LinearAttentionState; None: a sequence on its own)."""

    float32_params = ("A_log",)  # loaded in float32 whatever the activations' dtype, as mlx-lm keeps it

    def __init__(self, args: ModelArgs, linear: LinearAttentionArgs):
        super().__init__()
        d, self.linear = args.hidden_size, linear
        nv = linear.num_value_heads
        if linear.layout == FUSED_QKVZ:
            self.in_proj_qkvz = Linear(d, 2 * linear.key_dim + 2 * linear.value_dim)
            self.in_proj_ba = Linear(d, 2 * nv)
        else:
            self.in_proj_qkv = Linear(d, linear.conv_dim)
            self.in_proj_z = Linear(d, linear.value_dim)
            self.in_proj_b = Linear(d, nv)
            self.in_proj_a = Linear(d, nv)
        self.conv1d = DepthwiseConv1d(linear.conv_dim, linear.conv_kernel)
        self.A_log = mx.zeros((nv,))
        self.dt_bias = mx.ones((nv,))
        self.norm = GatedRMSNorm(linear.value_head_dim, args.rms_norm_eps)
        self.out_proj = Linear(linear.value_dim, d)

    @property
    def spec(self) -> LinearAttentionSpec:
        """What this layer computes, for the execution layer (no fused kernel runs it yet)."""
        lin = self.linear
        return LinearAttentionSpec(GATED_DELTA, lin.num_key_heads, lin.num_value_heads, lin.key_head_dim,
                                   lin.value_head_dim, lin.conv_kernel)

    def parts(self) -> LinearAttentionParts:
        """What a fused step reads of this layer (moebench.models.declare), as the arrays are now."""
        return LinearAttentionParts(self.project, self.out_proj, self.conv1d["weight"], self["A_log"],
                                    self["dt_bias"], self.norm["weight"], self.norm.eps)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """x [B, L, D] -> ([q | k | v] [B, L, conv_dim], z [B, L, Hv, Dv], b [B, L, Hv], a [B, L, Hv])."""
        lin, (batch, length, _) = self.linear, x.shape
        nk, nv, dk, dv = lin.num_key_heads, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim
        if lin.layout == SPLIT_QKV_Z_B_A:
            return (self.in_proj_qkv(x), self.in_proj_z(x).reshape(batch, length, nv, dv), self.in_proj_b(x),
                    self.in_proj_a(x))
        per_key = nv // nk  # value heads per key head
        qkvz = self.in_proj_qkvz(x).reshape(batch, length, nk, -1)
        q, k, v, z = mx.split(qkvz, [dk, 2 * dk, 2 * dk + per_key * dv], axis=-1)
        b, a = mx.split(self.in_proj_ba(x).reshape(batch, length, nk, 2 * per_key), [per_key], axis=-1)
        qkv = mx.concatenate([t.reshape(batch, length, -1) for t in (q, k, v)], axis=-1)
        return qkv, z.reshape(batch, length, nv, dv), b.reshape(batch, length, nv), a.reshape(batch, length, nv)

    def __call__(self, x: mx.array, cache=None, record: Record | None = None) -> mx.array:
        """With `record`, hands it the gates, the state's norm after the call and silu(z) (moebench.models.hooks)."""
        lin, (batch, length, _) = self.linear, x.shape
        qkv, z, b, a = self.project(x)
        conv_state = cache.conv if cache is not None and cache.conv is not None else \
            mx.zeros((batch, lin.conv_kernel - 1, lin.conv_dim), qkv.dtype)
        window = mx.concatenate([conv_state, qkv], axis=1)
        mixed = nn.silu(self.conv1d(window))
        q, k, v = mx.split(mixed, [lin.key_dim, 2 * lin.key_dim], axis=-1)
        q = q.reshape(batch, length, lin.num_key_heads, lin.key_head_dim)
        k = k.reshape(batch, length, lin.num_key_heads, lin.key_head_dim)
        v = v.reshape(batch, length, lin.num_value_heads, lin.value_head_dim)
        q, k = normalize_qk(q, k)
        g, beta = gates(a, b, self["A_log"], self["dt_bias"])
        state = cache.delta if cache is not None and cache.delta is not None else \
            mx.zeros((batch, lin.num_value_heads, lin.value_head_dim, lin.key_head_dim), mx.float32)
        out, state = delta_rule(q, k, v, g, beta, state)
        if record is not None:
            record_linear(record, g, beta, state, z)
        if cache is not None:
            conv = window[:, window.shape[1] - (lin.conv_kernel - 1) :]
            if length > 1:  # a copy: a slice would hold the whole window (a prompt chunk's projections) for as long
                conv = mx.contiguous(conv)  # as the cache keeps the state (contiguous copies a slice of a larger one)
            cache.write(conv, state, length)
        out = self.norm(out.astype(x.dtype), z)
        return self.out_proj(out.reshape(batch, length, -1))


def record_linear(record: Record, g: mx.array, beta: mx.array, state: mx.array, z: mx.array) -> None:
    """A call's decay and beta [B*L, Hv], each value head's state norm after it [B, Hv] and silu(z) [B*L, Hv, Dv]
    as GatedRMSNorm multiplies by it (float32)."""
    heads = g.shape[-1]
    record(hooks.DECAY, g.reshape(-1, heads))
    record(hooks.BETA, beta.reshape(-1, heads))
    record(hooks.STATE_NORM, mx.sqrt(mx.square(state).sum(axis=(-2, -1))))
    record(hooks.OUTPUT_GATE, nn.silu(z.astype(mx.float32)).reshape(-1, *z.shape[-2:]))
