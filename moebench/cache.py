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

    @property
    def state(self) -> tuple[mx.array, mx.array] | tuple[()]:
        return () if self.keys is None else (self.keys, self.values)


def make_cache(num_layers: int) -> list[KVCache]:
    return [KVCache() for _ in range(num_layers)]
