"""The shared expert layer every MoE family reuses: SwitchLinear, SwitchGLU and their checkpoint loader.

Experts are stored stacked `[E, out, in]` (quantized or float). The loader prefers the pre-stacked
`{root}.switch_mlp.{proj}` tensors and otherwise stacks `{root}.experts.{i}.{proj}` from index 0,
checking the expert count against the config and inferring each tensor's bit width from its shape.
"""

from __future__ import annotations

import re
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ..checkpoint.config import Quantization
from ..checkpoint.quant import QuantizedParts, QuantizedWeight, make_parts
from ..errors import CheckpointError

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
SORT_THRESHOLD = 64  # indices.size at or above which tokens are sorted by expert (prefill)


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up as one fused kernel (two separate ops cost a launch each at decode)."""
    return nn.silu(gate) * up


class SwitchLinear(QuantizedWeight):
    """E stacked linear maps; each (token, slot) multiplies by the expert its index names."""

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


class SwitchGLU(nn.Module):
    """SwiGLU experts: down_e(silu(gate_e(x)) * up_e(x)) for each selected expert e."""

    def __init__(self, gate_proj: SwitchLinear, up_proj: SwitchLinear, down_proj: SwitchLinear):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    @property
    def num_experts(self) -> int:
        return self.gate_proj.num_experts

    def quantized_parts(self) -> list[QuantizedParts | None]:
        """gate, up and down quantized parts (None for a float projection)."""
        return [p.quantized_parts() for p in (self.gate_proj, self.up_proj, self.down_proj)]

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
        h = swiglu(self.gate_proj(xs, idx, do_sort), self.up_proj(xs, idx, do_sort))
        y = self.down_proj(h, idx, do_sort)
        if do_sort:
            y = y[inverse].reshape(n, k, 1, -1)
        return y.squeeze(-2)


def weighted_sum(expert_out: mx.array, scores: mx.array) -> mx.array:
    """Sum over the top-k axis of expert outputs [N, K, D] weighted by scores [N, K], in the output dtype."""
    return (expert_out * scores[..., None].astype(expert_out.dtype)).sum(axis=-2)


def _stack_per_expert(store, root: str, proj: str, num_experts: int) -> dict[str, mx.array]:
    """Stack `{root}.experts.{i}.{proj}.*` for i in 0..E-1; a hole, an extra or a ragged expert is an error."""
    pattern = re.compile(re.escape(f"{root}.experts.") + r"(\d+)\." + re.escape(proj) + r"\.(\w+)$")
    found: dict[str, dict[int, str]] = {}
    for name in list(store.names()):
        m = pattern.match(name)
        if m:
            found.setdefault(m.group(2), {})[int(m.group(1))] = name
    if "weight" not in found:
        raise CheckpointError(
            f"{store.folder}: missing tensor {root}.switch_mlp.{proj}.weight "
            f"(and no per-expert {root}.experts.0.{proj}.weight)"
        )
    stacked = {}
    for suffix, by_index in sorted(found.items()):
        for i in range(num_experts):
            if i not in by_index:
                raise CheckpointError(f"{store.folder}: missing tensor {root}.experts.{i}.{proj}.{suffix} "
                                      f"(config has {num_experts} experts)")
        extra = sorted(set(by_index) - set(range(num_experts)))
        if extra:
            raise CheckpointError(
                f"{store.where(by_index[extra[0]])}: unexpected tensor {by_index[extra[0]]} "
                f"(config has {num_experts} experts)"
            )
        parts = [store.take(by_index[i]) for i in range(num_experts)]
        for i, p in enumerate(parts):
            if p.shape != parts[0].shape or p.dtype != parts[0].dtype:
                raise CheckpointError(
                    f"{store.where(by_index[i])}: ragged expert {by_index[i]}: {tuple(p.shape)} {p.dtype}, "
                    f"expert 0 has {tuple(parts[0].shape)} {parts[0].dtype}"
                )
        stacked[suffix] = mx.stack(parts)
        del parts
    return stacked


def load_switch_linear(
    store,
    root: str,
    proj: str,
    num_experts: int,
    out_features: int,
    in_features: int,
    dtype: mx.Dtype,
    quantization: Quantization | None,
) -> SwitchLinear:
    """One projection of the experts of MoE block `root`, pre-stacked or per-expert."""
    prefix = f"{root}.switch_mlp.{proj}"
    if f"{prefix}.weight" in store:
        tensors = {s: store.take_optional(f"{prefix}.{s}") for s in ("weight", "scales", "biases")}
        extras = [n for n in store.names() if n.startswith(f"{root}.experts.") and f".{proj}." in n]
        if extras:
            raise CheckpointError(f"{store.where(extras[0])}: {extras[0]} duplicates the stacked {prefix}")
    else:
        tensors = _stack_per_expert(store, root, proj, num_experts)
    unknown = sorted(set(tensors) - {"weight", "scales", "biases"})
    if unknown:
        raise CheckpointError(f"{store.folder}: unexpected expert tensor {prefix}.{unknown[0]}")
    weight, scales, biases = tensors["weight"], tensors.get("scales"), tensors.get("biases")
    if weight.ndim != 3 or weight.shape[0] != num_experts:
        raise CheckpointError(
            f"{store.where(prefix + '.weight')}: {prefix}.weight has shape {tuple(weight.shape)}, "
            f"expected {num_experts} stacked experts [E, out, in]"
        )
    if scales is None:
        if biases is not None:
            raise CheckpointError(f"{store.folder}: {prefix}.biases present without scales")
        if tuple(weight.shape[1:]) != (out_features, in_features):
            raise CheckpointError(
                f"{store.where(prefix + '.weight')}: {prefix}.weight has shape {tuple(weight.shape)}, "
                f"expected ({num_experts}, {out_features}, {in_features})"
            )
        if not mx.issubdtype(weight.dtype, mx.floating):
            raise CheckpointError(f"{store.folder}: {prefix}.weight is {weight.dtype} without scales")
        return SwitchLinear(weight.astype(dtype))
    spec = quantization.for_module(prefix) if quantization else None
    if spec is None:
        raise CheckpointError(f"{store.folder}: {prefix} is quantized but config.json has no quantization block")
    parts = make_parts(f"{store.where(prefix + '.weight')}: {prefix}", weight, scales, biases, spec,
                       scale_dtype=dtype)
    if (parts.out_features, parts.in_features) != (out_features, in_features):
        raise CheckpointError(
            f"{store.where(prefix + '.weight')}: {prefix} holds {parts.bits}-bit experts of "
            f"{parts.out_features} x {parts.in_features}, expected {out_features} x {in_features}"
        )
    return SwitchLinear(parts.weight, parts)


def load_switch_glu(
    store, root: str, num_experts: int, hidden: int, expert_dim: int, dtype: mx.Dtype,
    quantization: Quantization | None,
) -> SwitchGLU:
    """The gate/up/down expert stacks of MoE block `root`."""
    shapes = {"gate_proj": (expert_dim, hidden), "up_proj": (expert_dim, hidden), "down_proj": (hidden, expert_dim)}
    projs = [
        load_switch_linear(store, root, p, num_experts, *shapes[p], dtype, quantization) for p in PROJECTIONS
    ]
    return SwitchGLU(*projs)
