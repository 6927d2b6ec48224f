"""Expert parallelism over an mx.distributed group: each rank holds about 1/n of every MoE block's experts;
optionally tensor parallelism for the rest too: each rank holds 1/n of every layer's heads and MLP width.

Mode "experts": the router, attention, norms, embeddings, dense MLPs and the shared expert stay whole on every
rank; each block's routed experts become an ExpertShard (moebench.models.switch) holding a contiguous span of
them, whose outputs one all_sum per layer joins (a family whose experts differ, gpt-oss's with biases and a clamp,
gives them a `sharded(first, held, group)` method returning its own ExpertShard). Mode "experts+tensor" also
splits, as mlx-lm's shard() does, every layer's query heads and key/value heads (q/k/v as RowShards with their
biases' rows, o_proj as a ColumnShard whose bias is added once after the all_sum, moebench.models.layers;
gpt-oss's per-head sinks are loaded whole and each rank attends with its heads' span) and the width of every
shared expert and dense MLP (gate/up as RowShards, down as a
ColumnShard), each joined by an all_sum; the KV cache of a rank holds its own key/value heads only. A hybrid's
full-attention layers (GatedAttention) split by heads the same way, each query head's rows (its queries and its
output gate) together and the per-head q/k norms whole; its linear-attention layers (Gated DeltaNet) split by key
heads: a rank holds its key heads and the value heads they serve, the projections' rows of those heads, the conv
channels of their q, k and v, A_log and dt_bias of its value heads (the gated norm, one per head dimension, whole),
and the output projection's input columns joined by an all_sum; its recurrent state holds only its heads. Where a
rank's rows are not one span (Qwen3.5's in_proj_qkv [q | k | v], the conv channels) the module says which in
`held_rows` (HeldRows) and the loader reads those alone. Every rank
then holds every slot's output and the whole residual stream, so records and widgets see what one process
would. Sharding replaces placeholders before the weights load, and the loader reads on each rank only the
experts and rows it holds (moebench.checkpoint.weights).

Run under `mlx.launch`, e.g. `mlx.launch -n 2 --backend ring -- moebench generate MODEL --prompt hi --shard
experts`: every rank runs the same program, and collective calls pair up in the order they are made.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import ConfigError
from .declare import LatentAttentionSpec
from .gated_delta import FUSED_QKVZ, DepthwiseConv1d, GatedDeltaNet, LinearAttentionArgs
from .layers import ColumnShard, Linear, RowShard
from .run import token_mixer
from .switch import ExpertShard, SwitchGLU

TENSOR_MODE = "experts+tensor"  # experts, attention heads and MLP widths split over the ranks
MODES = ("experts", TENSOR_MODE)


def expert_span(total: int, rank: int, size: int) -> tuple[int, int]:
    """The experts [first, end) rank `rank` of `size` holds: contiguous spans whose sizes differ by at most one."""
    return rank * total // size, (rank + 1) * total // size


def init_group(mode: str) -> mx.distributed.Group:
    """The group of the processes mlx.launch started (one process alone: a group of one, and nothing is sharded)."""
    if mode not in MODES:
        raise ConfigError(f"shard: unknown mode {mode!r} (modes: {', '.join(MODES)})")
    return mx.distributed.init()


def shard_experts(model, group: mx.distributed.Group) -> None:
    """Give each MoE block of `model` (placeholder weights, before loading) this rank's span of its experts."""
    size, rank = group.size(), group.rank()
    if size == 1:
        return
    for i, block in model.moe_blocks().items():
        experts: SwitchGLU = block.switch_mlp
        total, hidden, dims = experts.gate_proj.shape
        first, end = expert_span(total, rank, size)
        if end == first:
            raise ConfigError(f"shard: {size} ranks for layer {i}'s {total} experts: rank {rank} would hold none")
        sharded = getattr(experts, "sharded", None)  # a family's own experts (biases, activation) shard themselves
        block.switch_mlp = (sharded(first, end - first, group) if sharded is not None
                            else ExpertShard(dims, hidden, total, first, end - first, group))


@dataclass(frozen=True)
class HeldRows:
    """The rows of a module's stored tensors this rank holds where they are not one span (a RowShard's): spans
    [first, end) of a first axis of `total` rows, in order. Set as a module's `held_rows`, it tells the loader
    (moebench.checkpoint.weights) to read those rows alone of every tensor the module loads."""

    total: int
    spans: tuple[tuple[int, int], ...]


def shard_heads(model, group: mx.distributed.Group) -> None:
    """Give each token-mixing layer of `model` (placeholder weights, before loading) this rank's span of its heads:
    an attention layer's query and key/value heads (shard_attention), a linear-attention layer's key heads
    (shard_linear_attention). Heads that do not split evenly over the ranks are a ConfigError naming the layer."""
    if group.size() == 1:
        return
    for i, layer in enumerate(model.layers):
        mixer = token_mixer(layer)
        if isinstance(mixer, GatedDeltaNet):
            shard_linear_attention(i, mixer, group)
        elif isinstance(mixer.spec, LatentAttentionSpec):
            raise ConfigError(f"shard: layer {i}'s multi-head latent attention is not split over ranks ({TENSOR_MODE} "
                              "splits query and key/value heads; shard the experts alone)")
        else:
            shard_attention(i, mixer, group)


def shard_attention(i: int, attn, group: mx.distributed.Group) -> None:
    """Layer `i`'s query heads and key/value heads, this rank's span of each; each query head keeps its key/value
    head (the spans are the same share of both) and its q_proj rows together (its queries, and its output gate
    where q_proj is twice as wide)."""
    size, rank = group.size(), group.rank()
    if attn.n_heads % size or attn.n_kv_heads % size:
        raise ConfigError(f"shard: layer {i}'s {attn.n_heads} query and {attn.n_kv_heads} key/value heads do not "
                          f"split evenly over {size} ranks ({TENSOR_MODE} needs both to)")
    hd, (q_rows, dims) = attn.head_dim, attn.q_proj.shape
    per_head = q_rows // attn.n_heads  # head_dim, or twice it with an output gate (GatedAttention)
    heads, kv = attn.n_heads // size, attn.n_kv_heads // size
    bias = "bias" in attn.q_proj
    attn.q_proj = RowShard(dims, q_rows, rank * heads * per_head, heads * per_head, bias)
    attn.k_proj = RowShard(dims, attn.n_kv_heads * hd, rank * kv * hd, kv * hd, bias)
    attn.v_proj = RowShard(dims, attn.n_kv_heads * hd, rank * kv * hd, kv * hd, bias)
    attn.o_proj = ColumnShard(attn.n_heads * hd, rank * heads * hd, heads * hd, dims, group, "bias" in attn.o_proj)
    attn.n_heads, attn.n_kv_heads = heads, kv


def shard_linear_attention(i: int, net: GatedDeltaNet, group: mx.distributed.Group) -> None:
    """Layer `i`'s Gated DeltaNet, this rank's span of its key heads and of the value heads they serve (each key
    head serves consecutive value heads, so both spans are contiguous): its rows of the projections (Qwen3-Next's
    fused ones are grouped per key head: one span each; Qwen3.5's in_proj_qkv [q | k | v]: three), its conv
    channels (three spans: the conv runs over [q | k | v]), A_log and dt_bias of its value heads, out_proj's input
    columns (a ColumnShard: one all_sum). The delta rule runs per value head and the conv per channel, so the rank's
    heads compute exactly what they do in the whole layer; the cache's states then hold only those heads."""
    size, rank, whole = group.size(), group.rank(), net.linear
    if whole.num_key_heads % size:
        raise ConfigError(f"shard: layer {i}'s linear attention's {whole.num_key_heads} key heads (serving "
                          f"{whole.num_value_heads} value heads) do not split evenly over {size} ranks ({TENSOR_MODE} "
                          "needs them to)")
    mine = replace(whole, num_key_heads=whole.num_key_heads // size, num_value_heads=whole.num_value_heads // size)
    dims, nv, first_v = net.out_proj.shape[0], mine.num_value_heads, rank * mine.num_value_heads
    if whole.layout == FUSED_QKVZ:  # per key head: its q, k, then its value heads' v and z; its b then its a
        qkvz = 2 * mine.key_dim + 2 * mine.value_dim
        net.in_proj_qkvz = RowShard(dims, size * qkvz, rank * qkvz, qkvz)
        net.in_proj_ba = RowShard(dims, 2 * whole.num_value_heads, 2 * first_v, 2 * nv)
    else:
        net.in_proj_qkv = Linear(dims, mine.conv_dim)
        net.in_proj_qkv.held_rows = conv_rows(whole, mine, rank)
        net.in_proj_z = RowShard(dims, whole.value_dim, rank * mine.value_dim, mine.value_dim)
        net.in_proj_b = RowShard(dims, whole.num_value_heads, first_v, nv)
        net.in_proj_a = RowShard(dims, whole.num_value_heads, first_v, nv)
    net.conv1d = DepthwiseConv1d(mine.conv_dim, whole.conv_kernel)
    net.conv1d.held_rows = conv_rows(whole, mine, rank)
    net.A_log, net.dt_bias = mx.zeros((nv,)), mx.ones((nv,))
    net.held_rows = HeldRows(whole.num_value_heads, ((first_v, first_v + nv),))  # A_log's and dt_bias's
    net.out_proj = ColumnShard(whole.value_dim, rank * mine.value_dim, mine.value_dim, dims, group)
    net.linear = mine


def conv_rows(whole: LinearAttentionArgs, mine: LinearAttentionArgs, rank: int) -> HeldRows:
    """Rank `rank`'s channels of [q | k | v] (q and k of its key heads, v of its value heads), holding `mine`'s
    share of `whole`'s heads: three spans."""
    q, v, k = rank * mine.key_dim, 2 * whole.key_dim + rank * mine.value_dim, whole.key_dim + rank * mine.key_dim
    return HeldRows(whole.conv_dim, ((q, q + mine.key_dim), (k, k + mine.key_dim), (v, v + mine.value_dim)))


def split_mlps(model) -> dict[str, object]:
    """The dense SwiGLU MLPs tensor parallelism splits, by where they sit: every shared expert and dense layer."""
    mlps = {}
    for i, layer in enumerate(model.layers):
        if "shared_expert" in layer.mlp:
            mlps[f"layer {i}'s shared expert"] = layer.mlp.shared_expert
        elif "switch_mlp" not in layer.mlp:
            mlps[f"layer {i}'s dense MLP"] = layer.mlp
    return mlps


def shard_mlps(model, group: mx.distributed.Group) -> None:
    """Give every shared expert and dense MLP of `model` (placeholder weights, before loading) this rank's span
    of its width: gate/up rows and down columns, the partial outputs joined by down's all_sum. A width that does
    not split evenly over the ranks is a ConfigError."""
    size, rank = group.size(), group.rank()
    if size == 1:
        return
    for where, mlp in split_mlps(model).items():
        hidden, dims = mlp.gate_proj.shape
        if hidden % size:
            raise ConfigError(f"shard: {where} of width {hidden} does not split evenly over {size} ranks "
                              f"({TENSOR_MODE} needs it to)")
        width = hidden // size
        mlp.gate_proj = RowShard(dims, hidden, rank * width, width)
        mlp.up_proj = RowShard(dims, hidden, rank * width, width)
        mlp.down_proj = ColumnShard(hidden, rank * width, width, dims, group)


def mlp_note(mlp) -> str | None:
    """A note on an MLP (a shared expert) whose width is split over ranks, None where it is whole."""
    down = mlp.down_proj
    if not isinstance(down, ColumnShard):
        return None
    last = down.first + down.shape[1] - 1
    return (f"width {down.first}-{last} of {down.total} on rank {down.group.rank()} of {down.group.size()} (the "
            "other ranks' by all_sum)")


def attention_note(mixer) -> str | None:
    """A token-mixing layer's note on the heads this rank holds where they are split over ranks (an attention
    layer's query and key/value heads, a linear-attention layer's key and value heads), None where it is whole."""
    if isinstance(mixer, GatedDeltaNet):
        out, dv, per_key = mixer.out_proj, mixer.linear.value_head_dim, mixer.linear.num_value_heads
        per_key //= mixer.linear.num_key_heads  # value heads per key head
        if not isinstance(out, ColumnShard):
            return None
        return (f"key heads {_heads(out.first // per_key, out.shape[1] // per_key, out.total // per_key, dv)}, "
                f"value heads {_heads(out.first, out.shape[1], out.total, dv)} on rank {out.group.rank()} of "
                f"{out.group.size()} (the other ranks' by all_sum)")
    out = mixer.o_proj
    if not isinstance(out, ColumnShard):
        return None
    hd, k = mixer.head_dim, mixer.k_proj
    return (f"query heads {_heads(out.first, out.shape[1], out.total, hd)}, key/value heads "
            f"{_heads(k.first, k.shape[0], k.total, hd)} on rank {out.group.rank()} of {out.group.size()} (the other "
            "ranks' by all_sum)")


def _heads(first: int, width: int, total: int, head_dim: int) -> str:
    """Heads [first, first + width) of total, in columns of head_dim each, in words: '2-3 of 4', '1 of 2'."""
    start, last = first // head_dim, (first + width) // head_dim - 1
    return f"{start}{'' if last == start else f'-{last}'} of {total // head_dim}"


def shard_of(model) -> ExpertShard | None:
    """The first MoE block's ExpertShard (every block is sharded alike), or None for a whole model."""
    blocks = model.moe_blocks()
    experts = next(iter(blocks.values())).switch_mlp if blocks else None
    return experts if isinstance(experts, ExpertShard) else None


def describe(shard: ExpertShard | None) -> str:
    """Which experts this rank holds, in words (the plan's note, the CLI's report)."""
    if shard is None:
        return "every expert in this process"
    return (f"experts {shard.first}-{shard.first + shard.num_experts - 1} of {shard.total} on rank "
            f"{shard.group.rank()} of {shard.group.size()} (the other ranks' by all_sum)")


def block_note(block) -> str | None:
    """A MoE block decision's note on what of the block this rank holds: its experts (describe) and, where split,
    its shared expert's width; None where the block is whole."""
    notes = [describe(block.switch_mlp)] if isinstance(block.switch_mlp, ExpertShard) else []
    if "shared_expert" in block and (split := mlp_note(block.shared_expert)) is not None:
        notes.append(f"shared expert {split}")
    return "; ".join(notes) or None


def resident_expert_bytes(model) -> int:
    """Bytes of the routed experts' arrays this process holds, over every MoE block."""
    return sum(a.nbytes for block in model.moe_blocks().values()
               for _, a in tree_flatten(block.switch_mlp.parameters()))


def resident_attention_bytes(model) -> int:
    """Bytes of the token-mixing layers' arrays (attention, linear attention) this process holds, over every
    layer."""
    return sum(a.nbytes for layer in model.layers for _, a in tree_flatten(token_mixer(layer).parameters()))


def resident_mlp_bytes(model) -> int:
    """Bytes of the shared experts' and dense MLPs' arrays this process holds, over every layer."""
    return sum(a.nbytes for mlp in split_mlps(model).values() for _, a in tree_flatten(mlp.parameters()))


def per_rank(group: mx.distributed.Group | None, value: int) -> list[int]:
    """`value` as each rank of `group` has it, in rank order (every rank calls this together)."""
    if group is None or group.size() == 1:
        return [value]
    return mx.distributed.all_gather(mx.array([value], dtype=mx.int64), group=group).tolist()


def mixers_note(model, linear: bool) -> str:
    """The heads this rank holds of the model's first attention layer (or with `linear`, linear-attention layer),
    in words (every such layer is split alike)."""
    kind = [m for m in map(token_mixer, model.layers) if isinstance(m, GatedDeltaNet) == linear]
    if not kind:
        return "no linear attention" if linear else "no attention"
    whole = "every key and value head in this process" if linear else "every head in this process"
    return attention_note(kind[0]) or whole


def report(model, group: mx.distributed.Group | None) -> dict:
    """Where the experts, heads and MLP widths are: this rank's spans in words (the first attention layer's heads,
    a hybrid's first linear-attention layer's), and each rank's resident expert, attention (linear attention
    included) and MLP bytes and process peak memory so far (every rank calls this together)."""
    mlps = split_mlps(model)
    first = mlp_note(next(iter(mlps.values()))) if mlps else None
    return {"ranks": group.size() if group is not None else 1, "experts": describe(shard_of(model)),
            "attention": mixers_note(model, False), "linear_attention": mixers_note(model, True),
            "mlps": first or ("every MLP's whole width in this process" if mlps else "no shared expert or dense MLP"),
            "expert_bytes_per_rank": per_rank(group, resident_expert_bytes(model)),
            "attention_bytes_per_rank": per_rank(group, resident_attention_bytes(model)),
            "mlp_bytes_per_rank": per_rank(group, resident_mlp_bytes(model)),
            "peak_bytes_per_rank": per_rank(group, mx.get_peak_memory())}
