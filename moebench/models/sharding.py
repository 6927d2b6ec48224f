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
ColumnShard), each joined by an all_sum; the KV cache of a rank holds its own key/value heads only. Every rank
then holds every slot's output and the whole residual stream, so records and widgets see what one process
would. Sharding replaces placeholders before the weights load, and the loader reads on each rank only the
experts and rows it holds (moebench.checkpoint.weights).

Run under `mlx.launch`, e.g. `mlx.launch -n 2 --backend ring -- moebench generate MODEL --prompt hi --shard
experts`: every rank runs the same program, and collective calls pair up in the order they are made.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import ConfigError
from .layers import ColumnShard, RowShard
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


def shard_heads(model, group: mx.distributed.Group) -> None:
    """Give each attention layer of `model` (placeholder weights, before loading) this rank's span of its query
    heads and of its key/value heads; each query head keeps its key/value head (the spans are the same share
    of both). Heads that do not split evenly over the ranks are a ConfigError."""
    size, rank = group.size(), group.rank()
    if size == 1:
        return
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        if attn.n_heads % size or attn.n_kv_heads % size:
            raise ConfigError(f"shard: layer {i}'s {attn.n_heads} query and {attn.n_kv_heads} key/value heads do not "
                              f"split evenly over {size} ranks ({TENSOR_MODE} needs both to)")
        hd, dims = attn.head_dim, attn.q_proj.shape[1]
        heads, kv = attn.n_heads // size, attn.n_kv_heads // size
        bias = "bias" in attn.q_proj
        attn.q_proj = RowShard(dims, attn.n_heads * hd, rank * heads * hd, heads * hd, bias)
        attn.k_proj = RowShard(dims, attn.n_kv_heads * hd, rank * kv * hd, kv * hd, bias)
        attn.v_proj = RowShard(dims, attn.n_kv_heads * hd, rank * kv * hd, kv * hd, bias)
        attn.o_proj = ColumnShard(attn.n_heads * hd, rank * heads * hd, heads * hd, dims, group, "bias" in attn.o_proj)
        attn.n_heads, attn.n_kv_heads = heads, kv


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


def attention_note(attn) -> str | None:
    """An attention decision's note on a layer whose heads are split over ranks, None where it is whole."""
    out = attn.o_proj
    if not isinstance(out, ColumnShard):
        return None
    hd, k = attn.head_dim, attn.k_proj

    def heads(first: int, width: int, total: int) -> str:
        last = (first + width) // hd - 1
        return f"{first // hd}{'' if last == first // hd else f'-{last}'} of {total // hd}"

    return (f"query heads {heads(out.first, out.shape[1], out.total)}, key/value heads "
            f"{heads(k.first, k.shape[0], k.total)} on rank {out.group.rank()} of {out.group.size()} (the other "
            "ranks' by all_sum)")


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
    """Bytes of the attention layers' arrays this process holds, over every layer."""
    return sum(a.nbytes for layer in model.layers for _, a in tree_flatten(layer.self_attn.parameters()))


def resident_mlp_bytes(model) -> int:
    """Bytes of the shared experts' and dense MLPs' arrays this process holds, over every layer."""
    return sum(a.nbytes for mlp in split_mlps(model).values() for _, a in tree_flatten(mlp.parameters()))


def per_rank(group: mx.distributed.Group | None, value: int) -> list[int]:
    """`value` as each rank of `group` has it, in rank order (every rank calls this together)."""
    if group is None or group.size() == 1:
        return [value]
    return mx.distributed.all_gather(mx.array([value], dtype=mx.int64), group=group).tolist()


def report(model, group: mx.distributed.Group | None) -> dict:
    """Where the experts, heads and MLP widths are: this rank's spans in words, and each rank's resident expert,
    attention and MLP bytes and process peak memory so far (every rank calls this together)."""
    mlps = split_mlps(model)
    first = mlp_note(next(iter(mlps.values()))) if mlps else None
    return {"ranks": group.size() if group is not None else 1, "experts": describe(shard_of(model)),
            "attention": attention_note(model.layers[0].self_attn) or "every head in this process",
            "mlps": first or ("every MLP's whole width in this process" if mlps else "no shared expert or dense MLP"),
            "expert_bytes_per_rank": per_rank(group, resident_expert_bytes(model)),
            "attention_bytes_per_rank": per_rank(group, resident_attention_bytes(model)),
            "mlp_bytes_per_rank": per_rank(group, resident_mlp_bytes(model)),
            "peak_bytes_per_rank": per_rank(group, mx.get_peak_memory())}
