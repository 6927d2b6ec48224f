"""Quantized tensor parts: bit-width inference from shapes and validation against MLX's rules.

MLX aborts the process on a bad group size, bit width or scale shape, which would kill a notebook
kernel, so every check happens here in Python first and raises a CheckpointError naming the tensor.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import CheckpointError
from ..models.args import AFFINE_BITS, AFFINE_GROUP_SIZES, QuantizedParts, QuantSpec


def infer_bits(name: str, weight: mx.array, scales: mx.array, spec: QuantSpec) -> int:
    """Bits from the MLX invariant packed_in * 32 == bits * groups * group_size.

    Mixed-precision exports keep one group size but may store e.g. an 8-bit down_proj under a
    4-bit default, so the shapes, not the config, decide the width.
    """
    packed_in, groups = weight.shape[-1], scales.shape[-1]
    if groups <= 0 or packed_in <= 0:
        raise CheckpointError(f"{name}: empty last axis (weight {weight.shape}, scales {scales.shape})")
    if spec.mode != "affine":
        expected = groups * spec.group_size * spec.bits
        if packed_in * 32 != expected:
            raise CheckpointError(
                f"{name}: weight {tuple(weight.shape)} and scales {tuple(scales.shape)} do not match "
                f"{spec.mode} (group_size {spec.group_size}, bits {spec.bits})"
            )
        return spec.bits
    total = packed_in * 32
    denom = groups * spec.group_size
    if total % denom or total // denom not in AFFINE_BITS:
        found = [b for b in AFFINE_BITS if total % (b * groups) == 0 and total // (b * groups) in AFFINE_GROUP_SIZES]
        hint = f"; shapes would fit bits/group_size {[(b, total // (b * groups)) for b in found]}" if found else ""
        raise CheckpointError(
            f"{name}: weight {tuple(weight.shape)} with scales {tuple(scales.shape)} gives no valid bit "
            f"width at group_size {spec.group_size} (packed_in*32 = {total}, groups*group_size = {denom}){hint}"
        )
    return total // denom


def make_parts(
    name: str,
    weight: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    spec: QuantSpec,
    scale_dtype: mx.Dtype | None = None,
) -> QuantizedParts:
    """Validate one quantized matrix (or expert stack) and return its parts.

    `scale_dtype` casts affine scales and biases (float32 on CPU, where half-precision quantized
    matmul is slow and inaccurate).
    """
    spec.validate(name)
    if weight.dtype != mx.uint32:
        raise CheckpointError(f"{name}.weight: quantized weights must be uint32, got {weight.dtype}")
    if weight.ndim < 2 or scales.ndim != weight.ndim or weight.shape[:-1] != scales.shape[:-1]:
        raise CheckpointError(
            f"{name}.scales: shape {tuple(scales.shape)} does not match weight {tuple(weight.shape)}"
        )
    if spec.mode == "affine":
        if biases is None:
            raise CheckpointError(f"{name}.biases: affine quantization needs biases and none were found")
        if biases.shape != scales.shape:
            raise CheckpointError(
                f"{name}.biases: shape {tuple(biases.shape)} differs from scales {tuple(scales.shape)}"
            )
        for part, arr in (("scales", scales), ("biases", biases)):
            if not mx.issubdtype(arr.dtype, mx.floating):
                raise CheckpointError(f"{name}.{part}: affine {part} must be floating point, got {arr.dtype}")
        if scale_dtype is not None:
            scales, biases = scales.astype(scale_dtype), biases.astype(scale_dtype)
    else:
        if biases is not None:
            raise CheckpointError(f"{name}.biases: mode {spec.mode} has no biases, but the checkpoint has them")
        if scales.dtype != mx.uint8:
            raise CheckpointError(f"{name}.scales: mode {spec.mode} needs uint8 scales, got {scales.dtype}")
    bits = infer_bits(name, weight, scales, spec)
    return QuantizedParts(weight, scales, biases, spec.group_size, bits, spec.mode)
