"""Expert parallelism over an mx.distributed group: each rank holds about 1/n of every MoE block's experts.

The router, attention, norms, embeddings, dense MLPs and the shared expert stay whole on every rank; each
block's routed experts become an ExpertShard (moebench.models.switch) holding a contiguous span of them,
whose outputs one all_sum per layer joins. Every rank then holds every slot's output, so records and
widgets see what one process would. Sharding replaces placeholders before the weights load, and the loader
reads on each rank only the experts it holds (moebench.checkpoint.weights.stack_experts).

Run under `mlx.launch`, e.g. `mlx.launch -n 2 --backend ring -- moebench generate MODEL --prompt hi --shard
experts`: every rank runs the same program, and collective calls pair up in the order they are made.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import ConfigError
from .switch import ExpertShard, SwitchGLU

MODES = ("experts",)


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
        block.switch_mlp = ExpertShard(dims, hidden, total, first, end - first, group)


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


def shard_note(experts: SwitchGLU) -> str | None:
    """A layer decision's note on a sharded block's experts (describe), None where the block is whole."""
    return describe(experts) if isinstance(experts, ExpertShard) else None


def resident_expert_bytes(model) -> int:
    """Bytes of the routed experts' arrays this process holds, over every MoE block."""
    return sum(a.nbytes for block in model.moe_blocks().values()
               for _, a in tree_flatten(block.switch_mlp.parameters()))


def per_rank(group: mx.distributed.Group | None, value: int) -> list[int]:
    """`value` as each rank of `group` has it, in rank order (every rank calls this together)."""
    if group is None or group.size() == 1:
        return [value]
    return mx.distributed.all_gather(mx.array([value], dtype=mx.int64), group=group).tolist()


def report(model, group: mx.distributed.Group | None) -> dict:
    """Where the experts are: this rank's span in words, and each rank's resident expert bytes and process peak
    memory so far (every rank calls this together)."""
    return {"ranks": group.size() if group is not None else 1, "experts": describe(shard_of(model)),
            "expert_bytes_per_rank": per_rank(group, resident_expert_bytes(model)),
            "peak_bytes_per_rank": per_rank(group, mx.get_peak_memory())}
