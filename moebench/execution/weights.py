"""The arrays the fused kernels read, derived from the model's own weights and kept in step with them.

The model holds its weights as mlx-lm does (q, k and v apart; the router and the shared expert gate
apart); at decode the execution layer reads some of them stacked (one matmul for q/k/v, one for the
router's rows and the shared gate's), and the kernel pair reads the experts' quantized parts. These are
built once and rebuilt only when a weight array was replaced (loaded, trained, swapped): Derived.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedKernelConfig
from ..models.args import QuantizedParts
from ..models.layers import Linear
from ..models.switch import PROJECTIONS, SwitchLinear
from .support import shared_fold_reason

PARTS = ("weight", "scales", "biases", "bias")


def stack_rows(*linears: Linear) -> Linear | None:
    """One Linear whose outputs are the given Linears' in order (one matmul instead of several), or None when
    they are stored differently (float vs quantized, bits, group size, dtypes, bias on some only)."""
    first = linears[0]
    if any(m.quant != first.quant or set(m) != set(first) for m in linears):
        return None
    names = [n for n in PARTS if n in first]
    if any(m[n].dtype != first[n].dtype for m in linears for n in names):
        return None
    stacked = {n: mx.concatenate([m[n] for m in linears]) for n in names}
    parts = None
    if first.mode is not None:
        parts = QuantizedParts(stacked["weight"], stacked["scales"], stacked.get("biases"), first.group_size,
                               first.bits, first.mode)
    rows = Linear(first.shape[-1], sum(m.shape[0] for m in linears), bias="bias" in stacked)
    rows.set_weight(stacked["weight"], parts, stacked.get("bias"))
    return rows


class Derived:
    """A value computed from some modules' arrays (weight, scales, biases, bias), recomputed only when one
    of those modules or arrays was replaced (weights loaded, trained, swapped). It is asked for at every
    decode step of every layer, so the check is a few identity comparisons, not a rebuild."""

    def __init__(self, build: Callable[..., object]):
        self._build = build
        self._modules: tuple = ()
        self._slots: list[tuple[nn.Module, str]] = []
        self._arrays: list[mx.array] | None = None
        self._value = None

    def get(self, *modules: nn.Module):
        """build(*modules), from the last call's result when nothing was replaced since."""
        if len(modules) != len(self._modules) or not all(map(operator.is_, modules, self._modules)):
            self._modules, self._arrays = modules, None
        arrays = [m.get(n) for m, n in self._slots]  # None where an array left its module (made float, say)
        if self._arrays is None or not all(map(operator.is_, arrays, self._arrays)):
            self._slots = [(m, n) for m in modules for n in PARTS if n in m]  # the names may have changed too
            self._value, self._arrays = self._build(*modules), [m[n] for m, n in self._slots]
        return self._value

    @property
    def value(self):
        """The value of the last get(), or None before the first."""
        return self._value

    def adopt(self) -> None:
        """Take the modules' current arrays as the ones the value was built from (they were re-pointed)."""
        self._arrays = [m[n] for m, n in self._slots]


def _evaluated_stack(*linears: Linear) -> Linear | None:
    stacked = stack_rows(*linears)
    if stacked is not None:
        mx.eval(stacked.parameters())  # built once and read by every later call (never traced into one)
    return stacked


class RowStack:
    """The stacked Linear of several (see stack_rows), kept in step with them (Derived). A plain object
    rather than a child module, so the model's parameters and checkpoint names stay those of the
    separate Linears."""

    def __init__(self, *linears: Linear):
        self.linears = linears
        self._stacked = Derived(_evaluated_stack)

    def get(self) -> Linear | None:
        """The stacked Linear, or None when the Linears cannot be stacked."""
        return self._stacked.get(*self.linears)

    def share_storage(self) -> None:
        """Point each Linear's arrays at its rows of the stacked ones, so both cost the memory of one."""
        stacked = self.get()
        if stacked is None:
            return
        start = 0
        for m in self.linears:
            rows = m["weight"].shape[0]
            for n in PARTS:
                if n in m:
                    m[n] = stacked[n][start:start + rows]
            start += rows
        mx.eval([m.parameters() for m in self.linears])
        self._stacked.adopt()



def expert_biases(gate: SwitchLinear, up: SwitchLinear, down: SwitchLinear) -> tuple[mx.array, ...] | None:
    """The routed experts' biases gate [E, Dff], up [E, Dff], down [E, D] as the kernel pair adds them, or None
    when they have none; biases on some projections only are refused (the pair would drop the others)."""
    biased = ["bias" in p for p in (gate, up, down)]
    if not any(biased):
        return None
    if not all(biased):
        names = [n for n, b in zip(PROJECTIONS, biased, strict=True) if not b]
        raise UnsupportedKernelConfig(f"experts with biases on some projections only ({', '.join(names)} without): "
                                      f"the kernel pair takes all three or none")
    return gate["bias"], up["bias"], down["bias"]


@dataclass(frozen=True)
class FusedWeights:
    """The arrays the kernels of one MoE block read: the routed experts' gate/up/down parts and their biases
    (None: none), and the shared expert's parts when they can run inside the kernel pair (else None, with
    `shared_note` saying why; None when the family has no shared expert)."""

    experts: tuple[QuantizedParts, QuantizedParts, QuantizedParts]
    shared: tuple[QuantizedParts, QuantizedParts, QuantizedParts] | None = None
    shared_note: str | None = None
    biases: tuple[mx.array, mx.array, mx.array] | None = None

    @classmethod
    def build(cls, gate: SwitchLinear, up: SwitchLinear, down: SwitchLinear, *shared: Linear) -> FusedWeights:
        """From the routed experts' projections and, when the family has one, the shared expert's."""
        parts = tuple(p.quantized_parts() for p in (gate, up, down))
        if any(p is None for p in parts):  # float experts: declined by support.parts_reason, nothing to read
            return cls(parts)
        biases = expert_biases(gate, up, down)
        note = None
        if shared:
            projections = {name: m.quantized_parts() for name, m in zip(PROJECTIONS, shared, strict=True)}
            note = shared_fold_reason(parts, projections, biased=any("bias" in m for m in shared))
        folded = tuple(m.quantized_parts() for m in shared) if shared and note is None else None
        return cls(parts, folded, note, biases)
