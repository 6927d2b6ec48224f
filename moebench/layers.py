"""Dense building blocks built straight from checkpoint tensors: Linear and Embedding, float or quantized.

They are built from the loaded weights rather than initialised and overwritten, so a real-size
checkpoint is never quantized at random first, and every shape is checked against the config.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import Quantization
from .errors import CheckpointError
from .quant import QuantizedParts, QuantizedWeight, make_parts


class Linear(QuantizedWeight):
    """y = x W^T (+ b); W float [out, in] or quantized parts."""

    def __init__(self, weight: mx.array, bias: mx.array | None = None, parts: QuantizedParts | None = None):
        super().__init__(weight, parts)
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        if self.mode is None:
            y = x @ self["weight"].T
        else:
            y = mx.quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), transpose=True,
                                    group_size=self.group_size, bits=self.bits, mode=self.mode)
        if "bias" in self:
            y = y + self["bias"]
        return y


def stack_rows(first: Linear, second: Linear) -> Linear | None:
    """One Linear whose outputs are `first`'s then `second`'s (one matmul instead of two), or None when
    they are stored differently (float vs quantized, bits, group size, dtypes) or have a bias."""
    if first.quant != second.quant or "bias" in first or "bias" in second:
        return None
    names = ("weight",) if first.mode is None else ("weight", "scales", "biases")
    pairs = [(first.get(n), second.get(n)) for n in names]
    if any((a is None) != (b is None) or (a is not None and a.dtype != b.dtype) for a, b in pairs):
        return None
    stacked = [mx.concatenate([a, b]) if a is not None else None for a, b in pairs]
    if first.mode is None:
        return Linear(stacked[0])
    return Linear(stacked[0], parts=QuantizedParts(*stacked, first.group_size, first.bits, first.mode))


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
