"""Per-layer key/value cache for decoding, grown in fixed steps so a decode step rarely reallocates."""

from __future__ import annotations

import mlx.core as mx

GROW_STEP = 256


class KVCache:
    """Keys and values [B, kv_heads, T, head_dim] of one attention layer."""

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, new = self.offset, keys.shape[2]
        if self.keys is None or prev + new > self.keys.shape[2]:
            b, h, _, d = keys.shape
            grow = ((new + GROW_STEP - 1) // GROW_STEP) * GROW_STEP
            k_new = mx.zeros((b, h, grow, d), keys.dtype)
            v_new = mx.zeros((b, h, grow, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = k_new, v_new
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], k_new], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], v_new], axis=2)
        self.offset += new
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def attention_mask(self, length: int) -> str | None:
        return "causal" if length > 1 else None

    @property
    def state(self) -> tuple[mx.array, mx.array] | tuple[()]:
        return () if self.keys is None else (self.keys, self.values)


def make_cache(num_layers: int) -> list[KVCache]:
    return [KVCache() for _ in range(num_layers)]


class StaticKVCache:
    """A fixed-capacity cache whose write position is an array, so a decode step has constant shapes
    and can be traced once by mx.compile. The caller advances `offset` between steps."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    @classmethod
    def empty(cls, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: mx.Dtype) -> StaticKVCache:
        zeros = mx.zeros((batch, kv_heads, capacity, head_dim), dtype)
        return cls(zeros, mx.zeros_like(zeros), mx.array(0, dtype=mx.int32))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] > self.keys.shape[2]:
            raise ValueError(f"{keys.shape[2]} new positions exceed the cache capacity {self.keys.shape[2]}")
        start = mx.concatenate([mx.zeros((2,), mx.int32), self.offset.reshape(1), mx.zeros((1,), mx.int32)])
        self.keys = mx.slice_update(self.keys, keys, start, axes=(0, 1, 2, 3))
        self.values = mx.slice_update(self.values, values, start, axes=(0, 1, 2, 3))
        return self.keys, self.values

    def attention_mask(self, length: int) -> mx.array:
        """Query i (at position offset + i) sees cache slots 0..offset + i; the rest is unwritten."""
        positions = self.offset + mx.arange(length, dtype=mx.int32)
        return mx.arange(self.keys.shape[2], dtype=mx.int32)[None, :] <= positions[:, None]
