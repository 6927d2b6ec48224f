"""The expert layer every MoE family shares: SwitchLinear (E stacked matrices) and SwitchGLU (SwiGLU experts);
BiasedSwitchLinear for experts with biases (gpt-oss), whose family also overrides SwitchGLU.activate.

Experts are held stacked `[E, out, in]`, float or quantized (moebench.checkpoint.weights stacks
checkpoints that store them one by one).
"""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn

from .args import QuantizedParts
from .layers import QuantizedWeight

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
SORT_THRESHOLD = 64  # indices.size at or above which tokens are sorted by expert (prefill)


def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return gate * mx.sigmoid(gate) * up


_swiglu_compiled = mx.compile(_swiglu, shapeless=True)


def on_main_thread() -> bool:
    """Whether this is the main thread: the one thread moebench uses mx.compile on. Measured here (MLX 0.32.4),
    a compiled function called from any other thread ends the process at exit ("terminate called without an
    active exception"), and several threads using one concurrently can hang."""
    return threading.current_thread() is threading.main_thread()


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up, on the main thread as one compiled kernel (two separate ops cost a launch each at
    decode), elsewhere as the two ops."""
    return (_swiglu_compiled if on_main_thread() else _swiglu)(gate, up)


class SwitchLinear(QuantizedWeight):
    """E stacked linear maps; each (token, slot) multiplies by the expert its index names."""

    def __init__(self, in_features: int, out_features: int, num_experts: int):
        super().__init__((num_experts, out_features, in_features))

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        if self.mode is None:
            return mx.gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=indices,
                                sorted_indices=sorted_indices)
        return mx.gather_qmm(
            x, self["weight"], self["scales"], self.get("biases"), rhs_indices=indices, transpose=True,
            group_size=self.group_size, bits=self.bits, mode=self.mode, sorted_indices=sorted_indices,
        )


class BiasedSwitchLinear(SwitchLinear):
    """E stacked linear maps, each with its own bias [E, out] added to the rows routed to it."""

    def __init__(self, in_features: int, out_features: int, num_experts: int):
        super().__init__(in_features, out_features, num_experts)
        self.bias = mx.zeros((num_experts, out_features))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return super().__call__(x, indices, sorted_indices) + mx.expand_dims(self["bias"][indices], -2)


class SwitchGLU(nn.Module):
    """SwiGLU experts: down_e(silu(gate_e(x)) * up_e(x)) for each selected expert e. `clamp`: a clamped SwiGLU's
    (limit, alpha) where the experts compute one (the fused kernels take it), None for SwiGLU."""

    clamp: tuple[float, float] | None = None

    def __init__(self, in_features: int, hidden_features: int, num_experts: int):
        super().__init__()
        self.gate_proj = SwitchLinear(in_features, hidden_features, num_experts)
        self.up_proj = SwitchLinear(in_features, hidden_features, num_experts)
        self.down_proj = SwitchLinear(hidden_features, in_features, num_experts)

    @classmethod
    def from_parts(cls, gate: QuantizedParts, up: QuantizedParts, down: QuantizedParts) -> SwitchGLU:
        """Experts holding these quantized stacks (a kernel test or benchmark without a checkpoint)."""
        experts = cls(gate.in_features, gate.out_features, gate.weight.shape[0])
        for proj, p in zip((experts.gate_proj, experts.up_proj, experts.down_proj), (gate, up, down), strict=True):
            proj.set_weight(p.weight, p)
        return experts

    @property
    def num_experts(self) -> int:
        return self.gate_proj.num_experts

    def quantized_parts(self) -> list[QuantizedParts | None]:
        """gate, up and down quantized parts (None for a float projection)."""
        return [p.quantized_parts() for p in (self.gate_proj, self.up_proj, self.down_proj)]

    def activate(self, gate: mx.array, up: mx.array) -> mx.array:
        """The experts' activation of the gate and up projections: silu(gate) * up."""
        return swiglu(gate, up)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [N, D], indices [N, K] -> each selected expert's output, unweighted, [N, K, D]."""
        n, k = indices.shape
        do_sort = indices.size >= SORT_THRESHOLD
        if do_sort:
            flat = indices.flatten()
            order = mx.argsort(flat)
            inverse = mx.argsort(order)
            xs = mx.expand_dims(x, -2)[order // k]  # [N*K, 1, D], grouped by expert
            idx = flat[order]
        else:
            xs = mx.expand_dims(x, (-2, -3))  # [N, 1, 1, D]: one row-vector matvec per (token, slot)
            idx = indices
        h = self.activate(self.gate_proj(xs, idx, do_sort), self.up_proj(xs, idx, do_sort))
        y = self.down_proj(h, idx, do_sort)
        if do_sort:
            y = y[inverse].reshape(n, k, 1, -1)
        return y.squeeze(-2)


class ExpertShard(SwitchGLU):
    """This rank's share of a block's experts, `first` .. `first + held - 1` of `total`, the others held by the
    other ranks of `group` (moebench.models.sharding). Each rank computes the (token, slot) pairs routed to its
    own experts and zeros for the rest; one all_sum then gives every rank every slot's output. Each slot is
    non-zero on exactly one rank, so the sum is exact: the outputs are those of the unsharded layer."""

    def __init__(self, in_features: int, hidden_features: int, total: int, first: int, held: int,
                 group: mx.distributed.Group):
        super().__init__(in_features, hidden_features, held)
        self.total, self.first, self.group = total, first, group

    def owned(self, indices: mx.array) -> tuple[mx.array, mx.array]:
        """(whether each slot's expert is held here, its index in this rank's stack: 0 where it is not)."""
        held = (indices >= self.first) & (indices < self.first + self.num_experts)
        return held, mx.where(held, indices - self.first, 0).astype(indices.dtype)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        held, local = self.owned(indices)
        y = super().__call__(x, local)
        return mx.distributed.all_sum(mx.where(held[..., None], y, 0), group=self.group)


def weighted_sum(expert_out: mx.array, scores: mx.array) -> mx.array:
    """Sum over the top-k axis of expert outputs [N, K, D] weighted by scores [N, K], in the output dtype."""
    return (expert_out * scores[..., None].astype(expert_out.dtype)).sum(axis=-2)
