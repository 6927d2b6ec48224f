"""The recurrent state of one linear-attention layer (Gated DeltaNet), the cache beside KVCache for such a layer.

A linear-attention layer keeps no per-position keys and values: it carries the last few positions' projections for
its causal convolution (the conv state) and one matrix per value head that every token updates (the delta state).
Both are replaced whole at every write, so forgetting positions cannot mean moving an offset back as KVCache does.
MLX arrays are immutable, so the states after the last few writes are kept by reference (no copy) and a rewind puts
them back: a decode that queued steps ahead and rolls them back, or a step interrupted part-way through its layers,
finds its layers exactly as they were. Rewinding further back than kept is a DecodeError.

A compiled decode step (moebench.decode.compiled) holds the same objects: it takes their arrays as inputs of its
traced function (the empty state as zeros of `state_shapes`) and writes what the function returns.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import DecodeError
from ..models.declare import LinearAttentionSpec


def state_shapes(spec: LinearAttentionSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of one sequence's conv state [1, kernel - 1, channels of q | k | v] and delta state
    [1, value_heads, value_dim, key_dim] in a layer declared by `spec`."""
    channels = 2 * spec.num_key_heads * spec.key_head_dim + spec.num_value_heads * spec.value_head_dim
    return (1, spec.conv_kernel - 1, channels), (1, spec.num_value_heads, spec.value_head_dim, spec.key_head_dim)


def empty_state(spec: LinearAttentionSpec, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """(conv, delta) before the first position, as the layer starts a sequence: zeros, the conv state in the
    activations' `dtype`, the delta state in float32."""
    conv, delta = state_shapes(spec)
    return mx.zeros(conv, dtype), mx.zeros(delta, mx.float32)


class LinearAttentionState:
    """conv [B, kernel - 1, channels] and delta [B, value_heads, value_dim, key_dim] (float32) after `offset`
    positions, with the states after each of the last `keep` writes.

    `keep`: how many writes back a rewind may go. A decode that queues `ahead` steps behind the one it reads rolls
    back at most those and the one being built, so it makes its caches with keep = ahead + 1
    (moebench.decode.loop.STEPS_AHEAD by default). Position 0, the empty state, is always within reach."""

    static = False  # not a compiled step's static cache (moebench.execution.plan.Shape)

    def __init__(self, keep: int):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise DecodeError(f"LinearAttentionState: keep must be an integer >= 1, got {keep!r}")
        self.keep = keep
        self.conv: mx.array | None = None
        self.delta: mx.array | None = None
        self.offset = 0
        self.kept: list[tuple[int, mx.array, mx.array]] = []  # (offset, conv, delta) after each kept write

    @classmethod
    def holding(cls, conv: mx.array, delta: mx.array) -> LinearAttentionState:
        """A state that holds `conv` and `delta` (a traced step's inputs) and keeps its next write."""
        state = cls(1)
        state.conv, state.delta = conv, delta
        return state

    def write(self, conv: mx.array, delta: mx.array, positions: int) -> None:
        """The states after `positions` more positions (a prompt chunk or one token)."""
        self.offset += positions
        self.conv, self.delta = conv, delta
        self.kept.append((self.offset, conv, delta))
        del self.kept[: -self.keep]

    def rewind_to(self, position: int) -> None:
        """The states as they were after `position` positions: the empty state for 0, else the kept write that
        ended there. A position not kept (too far back, inside a prompt chunk, or ahead) is a DecodeError and the
        state stays as it was."""
        if position == self.offset:
            return
        if position == 0:
            self.conv = self.delta = None
            self.offset, self.kept = 0, []
            return
        at = next((i for i, (offset, _, _) in enumerate(self.kept) if offset == position), None)
        if at is None:
            reach = [0] + [offset for offset, _, _ in self.kept]
            raise DecodeError(f"linear-attention state at position {self.offset} cannot rewind to position {position}:"
                              f" it keeps the states at positions {reach} (the last {self.keep} writes and the empty "
                              "state)")
        self.offset, self.conv, self.delta = self.kept[at]
        del self.kept[at + 1 :]

    @property
    def state(self) -> tuple[mx.array, mx.array] | tuple[()]:
        """The arrays to evaluate (what KVCache.state is to a prompt chunk)."""
        return () if self.conv is None else (self.conv, self.delta)
