"""Dense building blocks built straight from checkpoint tensors: Linear and Embedding, float or quantized.

They are built from the loaded weights rather than initialised and overwritten, so a real-size
checkpoint is never quantized at random first, and every shape is checked against the config.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ..checkpoint.config import Quantization
from ..checkpoint.quant import QuantizedParts, QuantizedWeight, make_parts
from ..errors import CheckpointError


class Linear(QuantizedWeight):
    """y = x W^T (+ b); W float [out, in] or quantized parts."""

    def __init__(self, weight: mx.array, bias: mx.array | None = None, parts: QuantizedParts | None = None):
        super().__init__(weight, parts)
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        y = self.matmul(x)
        if "bias" in self:
            y = y + self["bias"]
        return y

    def matmul(self, x: mx.array) -> mx.array:
        """x W^T without the bias (a kernel that adds it itself takes this)."""
        if self.mode is None:
            return x @ self["weight"].T
        return mx.quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), transpose=True,
                                   group_size=self.group_size, bits=self.bits, mode=self.mode)


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
    return Linear(stacked["weight"], stacked.get("bias"), parts)


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
            self._slots = [(m, n) for m in modules for n in PARTS if n in m]
        arrays = [m[n] for m, n in self._slots]
        if self._arrays is None or not all(map(operator.is_, arrays, self._arrays)):
            self._value, self._arrays = self._build(*modules), arrays
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


class Embedding(nn.Module):
    """Token embedding; can also act as the tied output projection."""

    def __init__(self, table: Linear):
        super().__init__()
        self.table = table

    def __call__(self, ids: mx.array) -> mx.array:
        t = self.table
        if t.quant is None:
            return t.weight[ids]
        gs, bits, mode = t.quant
        return mx.dequantize(
            t.weight[ids], t.scales[ids], t.get("biases")[ids] if "biases" in t else None,
            group_size=gs, bits=bits, mode=mode,
        ).astype(t.scales.dtype if mode == "affine" else mx.float32)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.table(x)


def load_linear(
    store,
    name: str,
    out_features: int,
    in_features: int,
    dtype: mx.Dtype,
    quantization: Quantization | None,
    bias: bool = False,
) -> Linear:
    """Take `{name}.weight` (+ scales/biases, + bias) from the store and check its shape."""
    weight = store.take(f"{name}.weight")
    scales = store.take_optional(f"{name}.scales")
    biases = store.take_optional(f"{name}.biases")
    b = store.take(f"{name}.bias") if bias else None
    if b is not None and tuple(b.shape) != (out_features,):
        raise CheckpointError(f"{store.where(name + '.bias')}: {name}.bias has shape {tuple(b.shape)}, "
                              f"expected ({out_features},)")
    if b is not None and not mx.issubdtype(b.dtype, mx.floating):
        raise CheckpointError(f"{store.where(name + '.bias')}: {name}.bias is {b.dtype}, expected floating point")
    if b is not None:
        b = b.astype(dtype)
    if scales is None:
        if biases is not None:
            raise CheckpointError(f"{store.where(name + '.biases')}: {name}.biases present without scales")
        if tuple(weight.shape) != (out_features, in_features):
            raise CheckpointError(
                f"{store.where(name + '.weight')}: {name}.weight has shape {tuple(weight.shape)}, "
                f"expected ({out_features}, {in_features})"
            )
        if not mx.issubdtype(weight.dtype, mx.floating):
            raise CheckpointError(f"{store.where(name + '.weight')}: {name}.weight is {weight.dtype} "
                                  "without scales (unquantized weights must be floating point)")
        return Linear(weight.astype(dtype), b)
    spec = quantization.for_module(name) if quantization else None
    if spec is None:
        raise CheckpointError(
            f"{store.where(name + '.scales')}: {name} is quantized but config.json has no quantization for it"
        )
    parts = make_parts(f"{store.where(name + '.weight')}: {name}", weight, scales, biases, spec, scale_dtype=dtype)
    if weight.ndim != 2 or (parts.out_features, parts.in_features) != (out_features, in_features):
        raise CheckpointError(
            f"{store.where(name + '.weight')}: {name} holds a {parts.bits}-bit matrix of "
            f"{tuple(weight.shape[:-1])} x {parts.in_features}, expected ({out_features}, {in_features})"
        )
    return Linear(parts.weight, b, parts)
