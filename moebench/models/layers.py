"""The dense building blocks: Linear, Embedding and RMSNorm, each holding one weight, float or quantized.

A model is built from its ModelArgs with placeholder weights of the right shapes (lazy zeros, never
computed) and the checkpoint loader (moebench.checkpoint.weights) fills them, checking every tensor
against the placeholder's shape; a real-size checkpoint is never initialised at random first.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .args import QuantizedParts


class QuantizedWeight(nn.Module):
    """A module holding one weight (or one stack of expert weights), float or quantized.

    group_size / bits / mode are plain attributes (None for a float weight) and calls read arrays as
    items: both skip nn.Module's attribute fallback, which costs at every call of every decode step.
    """

    def __init__(self, shape: tuple[int, ...], bias: bool = False):
        super().__init__()
        self.weight = mx.zeros(shape)  # a placeholder of the right shape until the checkpoint fills it
        if bias:
            self.bias = mx.zeros(shape[-2:-1])
        self.group_size = self.bits = self.mode = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The float shape: (out, in), or (E, out, in) for an expert stack."""
        if self.mode is None:
            return tuple(self["weight"].shape)
        *lead, packed = self["weight"].shape
        return (*lead, packed * 32 // self.bits)

    def set_weight(self, weight: mx.array, parts: QuantizedParts | None = None, bias: mx.array | None = None) -> None:
        """Hold `weight` (float), or the quantized `parts`; and the bias when the module has one."""
        for name in ("scales", "biases"):
            if name in self:
                del self[name]
        self.weight = weight if parts is None else parts.weight
        if parts is not None:
            self.scales = parts.scales
            if parts.biases is not None:
                self.biases = parts.biases
        self.group_size, self.bits, self.mode = (None, None, None) if parts is None else (
            parts.group_size, parts.bits, parts.mode)
        if bias is not None:
            self.bias = bias

    @property
    def quant(self) -> tuple[int, int, str] | None:
        """(group size, bits, mode), or None for a float weight."""
        return None if self.mode is None else (self.group_size, self.bits, self.mode)

    def quantized_parts(self) -> QuantizedParts | None:
        """The quantized pieces (what the fused kernels read), or None for a float weight."""
        if self.mode is None:
            return None
        return QuantizedParts(self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits,
                              self.mode)


def _matmul(w: QuantizedWeight, x: mx.array) -> mx.array:
    """x W^T for a 2-D weight, float or quantized."""
    if w.mode is None:
        return x @ w["weight"].T
    return mx.quantized_matmul(x, w["weight"], w["scales"], w.get("biases"), transpose=True, group_size=w.group_size,
                               bits=w.bits, mode=w.mode)


class Linear(QuantizedWeight):
    """y = x W^T (+ b); W [out, in], float or quantized."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__((out_features, in_features), bias)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.matmul(x)
        if "bias" in self:
            y = y + self["bias"]
        return y

    def matmul(self, x: mx.array) -> mx.array:
        """x W^T without the bias (a kernel that adds the bias itself takes this)."""
        return _matmul(self, x)


class RowShard(Linear):
    """Output rows [first, first + out_features) of a Linear of `total` rows: this rank's query or key/value heads
    (moebench.models.sharding). The loader reads only these rows from the checkpoint."""

    def __init__(self, in_features: int, total: int, first: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias)
        self.total, self.first = total, first


class ColumnShard(Linear):
    """Input columns [first, first + in_features) of a Linear of `total` inputs: the attention output projection
    over this rank's heads. Each rank's partial product covers its heads; one all_sum over `group` gives every
    rank the whole layer's output (the bias, if any, added once, after it)."""

    def __init__(self, total: int, first: int, in_features: int, out_features: int, group: mx.distributed.Group,
                 bias: bool = False):
        super().__init__(in_features, out_features, bias)
        self.total, self.first, self.group = total, first, group

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(self.matmul(x), group=self.group)
        if "bias" in self:
            y = y + self["bias"]
        return y


class HeadLinear(QuantizedWeight):
    """One linear map a head, W [H, out, in], float or quantized: x [.., H, L, in] -> x W_h^T [.., H, L, out], or
    with `transpose` False x [.., H, L, out] -> x W_h [.., H, L, in] (multi-head latent attention's absorbed key
    and value projections)."""

    def __init__(self, in_features: int, out_features: int, heads: int):
        super().__init__((heads, out_features, in_features))

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        if self.mode is None:
            return x @ (self["weight"].swapaxes(-1, -2) if transpose else self["weight"])
        return mx.quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), transpose=transpose,
                                   group_size=self.group_size, bits=self.bits, mode=self.mode)


class Embedding(QuantizedWeight):
    """Token embedding [vocab, dims]; also the tied output projection."""

    def __init__(self, vocab: int, dims: int):
        super().__init__((vocab, dims))

    def __call__(self, ids: mx.array) -> mx.array:
        if self.mode is None:
            return self["weight"][ids]
        return mx.dequantize(
            self["weight"][ids], self["scales"][ids], self["biases"][ids] if "biases" in self else None,
            group_size=self.group_size, bits=self.bits, mode=self.mode,
        ).astype(self["scales"].dtype if self.mode == "affine" else mx.float32)

    def as_linear(self, x: mx.array) -> mx.array:
        """x E^T: logits through the tied embedding table."""
        return _matmul(self, x)


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight, self.eps = mx.ones((dims,)), eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self["weight"], self.eps)
