"""Bit-width inference from shapes and validation of quantized parts against MLX's rules."""

from __future__ import annotations

import mlx.core as mx
import pytest

from moebench.checkpoint.quant import infer_bits, make_parts
from moebench.errors import CheckpointError, ConfigError
from moebench.models.args import AFFINE_BITS, AFFINE_GROUP_SIZES, QuantSpec

IN, OUT = 256, 8


def quantized(bits: int, group_size: int, mode: str = "affine", shape=(OUT, IN)):
    w = mx.random.normal(shape, key=mx.random.key(bits * 1000 + group_size))
    return mx.quantize(w, group_size=group_size, bits=bits, mode=mode)


@pytest.mark.parametrize("group_size", AFFINE_GROUP_SIZES)
@pytest.mark.parametrize("bits", AFFINE_BITS)
def test_bits_come_from_the_shapes_not_the_config(bits, group_size):
    q, scales, biases = quantized(bits, group_size)
    config_says = QuantSpec(group_size, 4 if bits != 4 else 8)  # deliberately the wrong default width
    parts = make_parts("m", q, scales, biases, config_says)
    assert parts.bits == infer_bits("m", q, scales, config_says) == bits
    assert (parts.out_features, parts.in_features, parts.group_size, parts.mode) == (OUT, IN, group_size, "affine")


def test_stacked_experts_infer_the_same_width():
    q, scales, biases = quantized(8, 64, shape=(3, OUT, IN))
    parts = make_parts("experts", q, scales, biases, QuantSpec(64, 4))
    assert (parts.bits, parts.out_features, parts.in_features) == (8, OUT, IN)


@pytest.mark.parametrize("mode,group_size,bits", [("mxfp4", 32, 4), ("mxfp8", 32, 8), ("nvfp4", 16, 4)])
def test_bias_free_modes(mode, group_size, bits):
    out = quantized(bits, group_size, mode)
    q, scales = out[0], out[1]
    parts = make_parts("m", q, scales, None, QuantSpec(group_size, bits, mode))
    assert (parts.bits, parts.mode, parts.biases, parts.in_features) == (bits, mode, None, IN)
    with pytest.raises(CheckpointError, match="m.biases: mode .* has no biases"):
        make_parts("m", q, scales, scales, QuantSpec(group_size, bits, mode))
    with pytest.raises(CheckpointError, match="uint8 scales"):
        make_parts("m", q, scales.astype(mx.float32), None, QuantSpec(group_size, bits, mode))
    with pytest.raises(CheckpointError, match=f"do not match {mode}"):
        make_parts("m", q[:, :-1], scales, None, QuantSpec(group_size, bits, mode))


def test_scales_and_biases_cast_to_the_activation_dtype():
    q, scales, biases = quantized(4, 64)
    parts = make_parts("m", q, scales.astype(mx.float16), biases.astype(mx.float16), QuantSpec(64, 4),
                       scale_dtype=mx.float32)
    assert parts.scales.dtype == parts.biases.dtype == mx.float32
    assert make_parts("m", q, scales.astype(mx.bfloat16), biases, QuantSpec(64, 4)).scales.dtype == mx.bfloat16


def test_invalid_parts_are_named():
    q, scales, biases = quantized(4, 64)
    spec = QuantSpec(64, 4)
    cases = [
        ((q.astype(mx.float32), scales, biases), "m.weight: quantized weights must be uint32"),
        ((q, scales[:, :1], biases[:, :1]), "no valid bit width"),
        ((q, scales[:-1], biases), r"m.scales: shape \(7, 4\) does not match weight \(8, 32\)"),
        ((q, scales[None], biases), "m.scales"),
        ((q[0], scales[0], biases[0]), "m.scales"),
        ((q, scales, None), "m.biases: affine quantization needs biases"),
        ((q, scales, biases[:, :2]), "m.biases: shape"),
        ((q, scales.astype(mx.uint8), biases.astype(mx.uint8)), "m.scales: affine scales must be floating"),
        ((q[:, :0], scales[:, :0], biases[:, :0]), "empty last axis"),
    ]
    for (w, s, b), message in cases:
        with pytest.raises(CheckpointError, match=message):
            make_parts("m", w, s, b, spec)


def test_the_spec_is_validated_before_mlx_sees_it():
    q, scales, biases = quantized(4, 64)
    with pytest.raises(ConfigError, match="m: affine group_size 16"):
        make_parts("m", q, scales, biases, QuantSpec(16, 4))
    with pytest.raises(ConfigError, match="mode 'int4'"):
        make_parts("m", q, scales, biases, QuantSpec(64, 4, "int4"))


def test_hint_lists_the_widths_the_shapes_would_fit():
    q, scales, biases = quantized(4, 32)  # 32 words, 8 groups: 4-bit g32, or 2-bit g64 at group 64
    with pytest.raises(CheckpointError, match=r"\(4, 32\)"):
        infer_bits("m", q, scales, QuantSpec(128, 4))
