"""Per-layer key/value cache for decoding, grown in fixed steps so a decode step rarely reallocates (a hybrid's
linear-attention layers keep a recurrent state instead, moebench.decode.state); the compiled step's static cache
(StaticCache: fixed-capacity buffers for the attending layers, beside the recurrent states); and the memory a
decode asks for, checked before MLX is asked (an allocation MLX cannot make kills the process on CPU)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import mlx.core as mx

from ..errors import DecodeError, DeviceMemoryError
from ..models.args import ModelArgs
from ..models.declare import AttentionSpec, LatentAttentionSpec, LinearAttentionSpec
from ..models.run import token_mixer
from .state import LinearAttentionState, state_shapes

GROW_STEP = 256


def available_memory() -> tuple[int, str]:
    """(bytes arrays may still take, where): on a GPU its working set (Metal's recommended size, else the device's
    memory: Metal's memory_size, CUDA's total_memory) less what MLX holds; on CPU the system's available memory.
    MLX's cache of freed buffers counts as free."""
    if mx.default_device() != mx.cpu:
        info = mx.device_info()
        total = (info.get("max_recommended_working_set_size") or info.get("memory_size")
                 or info.get("total_memory"))
        if total:
            return int(total) - mx.get_active_memory(), f"{info.get('device_name', 'GPU')} memory"
    return _system_available() + mx.get_cache_memory(), "available system memory"


def _system_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux: the physical memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def require_memory(nbytes: int, what: str) -> None:
    """A DeviceMemoryError when `what` needs more than the memory left (available_memory)."""
    free, where = available_memory()
    if nbytes > free:
        raise DeviceMemoryError(f"{what} needs about {nbytes / 2**30:.2f} GiB, more than the "
                                f"{max(free, 0) / 2**30:.2f} GiB of {where} left")


def linear_layers(model) -> list[LinearAttentionSpec]:
    """The declarations of the model's linear-attention layers (none but in a hybrid), in layer order."""
    specs = [token_mixer(layer).spec for layer in model.layers]
    return [spec for spec in specs if isinstance(spec, LinearAttentionSpec)]


def cache_widths(spec: AttentionSpec | LatentAttentionSpec) -> tuple[int, int, int]:
    """(heads, key width, value width) of what an attention layer declaring `spec` caches a position: its
    key/value heads' keys and values (the heads this process holds), or multi-head latent attention's compressed
    latent and its rotary key."""
    if isinstance(spec, LatentAttentionSpec):
        return 1, spec.kv_lora_rank, spec.qk_rope_head_dim
    return spec.n_kv_heads, spec.head_dim, spec.head_dim


def kv_cache_bytes(model, positions: int) -> int:
    """Every attention layer's keys and values for `positions` positions (a linear-attention layer keeps none), as
    cache_widths says, in the model's dtype."""
    specs = [token_mixer(layer).spec for layer in model.layers]
    per_position = sum(h * (k + v) for h, k, v in (cache_widths(s) for s in specs
                                                   if not isinstance(s, LinearAttentionSpec)))
    return per_position * positions * model.dtype.size


def linear_state_bytes(model, keep: int) -> int:
    """The recurrent states of the linear-attention layers, `keep` writes of each kept for a rewind: the float32
    delta state and the conv state (kernel - 1 positions of q, k and v) in the model's dtype."""
    per_write = 0
    for spec in linear_layers(model):
        conv, delta = state_shapes(spec)
        per_write += math.prod(conv) * model.dtype.size + math.prod(delta) * 4
    return keep * per_write


def forward_bytes(args: ModelArgs, queries: int, keys: int, logits: int = 1) -> int:
    """A generous estimate of what one forward of `queries` positions over `keys` cached ones holds beyond the
    weights and the cache (the check is against asking for far too much, not a budget): the activations of the
    widest layer, one layer's attention scores where MLX makes them whole (CPU; about 1.3x one layer's, measured),
    and `logits` positions' float32 logits."""
    widest = max(4 * args.hidden_size, args.intermediate_size,
                 args.num_experts_per_tok * args.moe_intermediate_size + args.shared_expert_intermediate_size)
    scores = 2 * args.num_attention_heads * queries * keys * 4 if mx.default_device() == mx.cpu else 0
    return 3 * queries * widest * 4 + scores + 2 * logits * args.vocab_size * 4


class KVCache:
    """Keys and values [B, kv_heads, T, head_dim] of one attention layer. A fused decode step writes the new
    token's key and value as an update MLX sees (`write`), so arrays of this cache that a caller holds
    (recording, a notebook) keep what they held."""

    static = False  # not a compiled step's static cache (moebench.execution.plan.Shape)

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def _reserve(self, new: int, batch: int, heads: int, key_dim: int, value_dim: int, dtype: mx.Dtype) -> None:
        """Grow the buffers (in GROW_STEP slots) so that `new` more positions fit."""
        prev = self.offset
        if self.keys is not None and prev + new <= self.keys.shape[2]:
            return
        grow = ((new + GROW_STEP - 1) // GROW_STEP) * GROW_STEP
        k_new = mx.zeros((batch, heads, grow, key_dim), dtype)
        v_new = mx.zeros((batch, heads, grow, value_dim), dtype)
        if self.keys is None:
            self.keys, self.values = k_new, v_new
        else:
            self.keys = mx.concatenate([self.keys[..., :prev, :], k_new], axis=2)
            self.values = mx.concatenate([self.values[..., :prev, :], v_new], axis=2)

    def rewind_to(self, position: int) -> None:
        """Forget every position from `position` on (a step rolled back); later writes overwrite their slots."""
        self.offset = position

    def write(self, keys: mx.array, values: mx.array) -> None:
        """Store the next positions' keys and values (room reserved by the caller)."""
        prev = self.offset
        self.offset += keys.shape[2]
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        b, h, new, d = keys.shape
        self._reserve(new, b, h, d, values.shape[3], keys.dtype)
        self.write(keys, values)
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def decode_buffers(self, heads: int, head_dim: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array, int]:
        """For one new token (the fused decode-attention kernel): the key and value buffers [1, heads, CAP,
        head_dim] as they are before it is written, int32 [P, CAP] (its position and their slots) and the
        block of the buffers that holds this layer (0: the buffers are this layer's alone)."""
        self._reserve(1, 1, heads, head_dim, head_dim, dtype)
        return self.keys, self.values, slots_array(self.offset, self.keys.shape[2]), 0

    def attention_mask(self, length: int) -> str | None:
        return "causal" if length > 1 else None

    @property
    def state(self) -> tuple[mx.array, mx.array] | tuple[()]:
        return () if self.keys is None else (self.keys, self.values)

    @property
    def conv(self) -> mx.array:
        """What a linear-attention layer reads first: a KVCache has no recurrent state to give it."""
        raise DecodeError("a linear-attention layer was given a KVCache: a hybrid model (Gated DeltaNet layers) "
                          "needs its own caches, moebench.decode.cache.layer_caches(model, keep)")

    delta = conv


_slots: dict[tuple[int, int], mx.array] = {}


def slots_array(position: int, capacity: int) -> mx.array:
    """int32 [position, capacity], one array per value pair: every layer of a decode step asks for the same."""
    key = (position, capacity)
    if key not in _slots:
        if len(_slots) >= 4 * GROW_STEP:
            _slots.clear()
        _slots[key] = mx.array(key, dtype=mx.int32)
    return _slots[key]


def make_cache(num_layers: int) -> list[KVCache]:
    return [KVCache() for _ in range(num_layers)]


def layer_caches(model, keep: int) -> list[KVCache | LinearAttentionState]:
    """A moebench model's caches, per layer the one its token mixing takes: a LinearAttentionState that can rewind
    `keep` writes for a linear-attention layer, else a KVCache."""
    return [LinearAttentionState(keep) if isinstance(token_mixer(layer).spec, LinearAttentionSpec) else KVCache()
            for layer in model.layers]


@dataclass(frozen=True)
class StepPosition:
    """Where one traced step writes in static caches, built once per step for every layer: the offset [],
    the slice_update start [4] and the decode kernel's [P, CAP]; `known`: the offset as a Python int when the
    forward is not traced (a prompt), so it attends causally to the slots written so far and its own."""

    offset: mx.array
    start: mx.array
    slots: mx.array
    known: int | None = None

    @classmethod
    def at(cls, offset: mx.array, capacity: int, known: int | None = None) -> StepPosition:
        p = offset.reshape(1)
        return cls(offset, mx.concatenate([mx.zeros((2,), mx.int32), p, mx.zeros((1,), mx.int32)]),
                   mx.concatenate([p, mx.array([capacity], mx.int32)]), known)


class StaticCache:
    """The attending layers' keys and values in two fixed-capacity buffers [attending layers, kv_heads, CAP,
    head_dim] whose write position is an array, and a hybrid's recurrent states (one LinearAttentionState per
    linear-attention layer, which keeps no keys and values and so has no block in the buffers), so a decode step
    has constant shapes and can be traced once by mx.compile: the buffers and the states are its inputs and
    outputs. `blocks`: per model layer, its block of the buffers, or None for a linear-attention layer (whose
    state is the next of `states`).

    A decode step on a GPU writes in place: each layer's decode-attention kernel stores its token's key
    and value at slot P of its own block of the buffers itself (StaticLayerCache.written_in_place), and the
    step hands the same buffers on. No kernel of the step reads slot P (they read slots < P, each layer
    its own block), but MLX does not see these writes: it orders GPU work by the buffers each kernel
    declares it reads and writes (its CUDA graphs run kernels with no such edge at once), and here the
    buffers are only read. So a reader must come after the step by data (the next decode step is built
    on this step's token) or by the step having been scheduled first (CompiledForward schedules each step
    before it builds the next); the buffers hold a step's keys and values once its logits are evaluated.
    (mx.depends adds no such order, and an update MLX sees would copy both whole buffers a step: both
    measured, docs/benchmarks/attention-split-h200-2026-12-01.md.)

    Otherwise (prefill, the reference attention, MLX's SDPA) the layers hand their new keys and values
    over and `commit` writes them, one update per buffer for all layers. Nothing reads a layer's new
    entries before the commit: the unfused path attends over a copy of its layer's block with them written
    in. One forward writes one way: an update of the whole buffer would race the in-place writes. A
    linear-attention layer hands over its new states, and the commit writes them into its LinearAttentionState
    (which keeps the last few writes for a rewind): a forward that fails before its commit changed no state. The
    caller advances the position between forwards."""

    def __init__(self, keys: mx.array, values: mx.array, position: StepPosition,
                 blocks: tuple[int | None, ...] | None = None, states: list[LinearAttentionState] | None = None):
        self.keys, self.values, self.position = keys, values, position
        self.blocks = tuple(range(keys.shape[0])) if blocks is None else blocks
        self.states = states or []
        self.attending = [i for i, block in enumerate(self.blocks) if block is not None]  # model layer of each block
        self.recurrent = [i for i, block in enumerate(self.blocks) if block is None]  # model layer of each state
        if len(self.attending) != keys.shape[0] or len(self.recurrent) != len(self.states):
            raise ValueError(f"layers {self.blocks} name {len(self.attending)} blocks and {len(self.recurrent)} "
                             f"states; the cache holds {keys.shape[0]} blocks and {len(self.states)} states")
        self._clear()

    def _clear(self) -> None:
        """Drop what a forward handed over."""
        self.pending: list[tuple[mx.array, mx.array] | None] = [None] * len(self.attending)
        self.in_place: set[int] = set()  # blocks whose kernel stored its pending pair itself
        self.pending_states: list[tuple[mx.array, mx.array, int] | None] = [None] * len(self.states)

    @classmethod
    def empty(cls, layers: int, kv_heads: int, capacity: int, head_dim: int, dtype: mx.Dtype,
              blocks: tuple[int | None, ...] | None = None,
              states: list[LinearAttentionState] | None = None, value_dim: int | None = None) -> StaticCache:
        """Zeroed buffers; the values `value_dim` wide when they differ from the keys (MLA's rotary key)."""
        keys = mx.zeros((layers, kv_heads, capacity, head_dim), dtype)
        values = mx.zeros((layers, kv_heads, capacity, value_dim or head_dim), dtype)
        return cls(keys, values, StepPosition.at(mx.array(0, dtype=mx.int32), capacity), blocks, states)

    @classmethod
    def for_model(cls, model, capacity: int, keep: int) -> StaticCache:
        """Zeroed buffers of `capacity` positions (an integer >= 1) for `model`'s attending layers alone (the
        key/value heads this process holds: a rank's own where attention is sharded), and an empty
        LinearAttentionState keeping `keep` writes for each linear-attention layer."""
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise DecodeError(f"StaticCache: capacity must be an integer >= 1 (positions), got {capacity!r}")
        linear = [isinstance(token_mixer(layer).spec, LinearAttentionSpec) for layer in model.layers]
        attending = [token_mixer(layer) for layer, lin in zip(model.layers, linear, strict=True) if not lin]
        blocks = tuple(None if lin else linear[:i].count(False) for i, lin in enumerate(linear))
        heads, key_dim, value_dim = cache_widths(attending[0].spec) if attending else (1, 1, 1)
        return cls.empty(len(attending), heads, capacity, key_dim, model.dtype, blocks,
                         [LinearAttentionState(keep) for lin in linear if lin], value_dim)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def arrays(self) -> list[mx.array]:
        """Everything the cache holds, to evaluate (a prompt chunk before the next)."""
        return [self.keys, self.values, *(a for state in self.states for a in state.state)]

    def layers(self) -> list[StaticLayerCache | StaticLinearState]:
        """One cache per layer, to pass to the model's forward; `commit` after it. A forward that failed
        before its commit wrote nothing: what it handed over is dropped here."""
        self._clear()
        states = iter(range(len(self.states)))
        return [StaticLinearState(self, i, next(states)) if block is None else StaticLayerCache(self, i, block)
                for i, block in enumerate(self.blocks)]

    def add(self, block: int, keys: mx.array, values: mx.array, in_place: bool = False) -> None:
        """Hand over a block's new keys and values [1, kv_heads, n, head_dim]; with `in_place` its kernel has
        stored them in the buffers already."""
        if keys.shape[2] > self.capacity:
            raise ValueError(f"{keys.shape[2]} new positions exceed the cache capacity {self.capacity}")
        if self.pending[block] is not None:
            raise RuntimeError(f"layer {self.attending[block]} wrote its keys and values twice in one forward")
        self.pending[block] = (keys, values)
        if in_place:
            self.in_place.add(block)

    def add_state(self, index: int, conv: mx.array, delta: mx.array, positions: int) -> None:
        """Hand over the states of the `index`-th linear-attention layer after `positions` more positions."""
        if self.pending_states[index] is not None:
            raise RuntimeError(f"layer {self.recurrent[index]} wrote its recurrent state twice in one forward")
        self.pending_states[index] = (conv, delta, positions)

    def commit(self) -> None:
        """Write every attending layer's new keys and values at the position, one update per buffer (nothing to
        write when the kernels stored them in place), and every linear-attention layer's new states."""
        missing = [self.attending[b] for b, p in enumerate(self.pending) if p is None]
        if missing:
            raise RuntimeError(f"layers {missing} wrote no keys and values in this forward")
        missing = [self.recurrent[j] for j, p in enumerate(self.pending_states) if p is None]
        if missing:
            raise RuntimeError(f"layers {missing} wrote no recurrent state in this forward")
        if self.in_place and len(self.in_place) < len(self.pending):
            raise RuntimeError(f"layers {[self.attending[b] for b in sorted(self.in_place)]} wrote their keys and "
                               "values in place and the others did not: an update of the whole buffers would race "
                               "the in-place writes")
        if self.pending and not self.in_place:
            start = self.position.start
            for name, part in (("keys", 0), ("values", 1)):
                new = mx.concatenate([p[part] for p in self.pending], axis=0)
                setattr(self, name, mx.slice_update(getattr(self, name), new, start, axes=(0, 1, 2, 3)))
        for state, (conv, delta, positions) in zip(self.states, self.pending_states, strict=True):
            state.write(conv, delta, positions)
        self._clear()


class StaticLayerCache:
    """One attending layer's view of a StaticCache (its `block` of the buffers), with the interface the attention
    layers use. On a GPU the decode-attention kernel stores its token's key and value here in place
    (`written_in_place`)."""

    static = True

    def __init__(self, cache: StaticCache, layer: int, block: int):
        self.cache, self.layer, self.block = cache, layer, block

    @property
    def offset(self) -> mx.array:
        return self.cache.position.offset

    def write(self, keys: mx.array, values: mx.array) -> None:
        """Hand the new positions' keys and values to the cache, which writes them at its commit."""
        self.cache.add(self.block, keys, values)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Hand them over, and return this layer's block [1, kv_heads, CAP, head_dim] with them written in; for
        a prompt (the offset known), the slots written so far and the new ones alone (it attends causally, as
        with a growing cache: no array mask over CAP slots).

        The block is a copy (its buffer is shared with every layer's, so it cannot be updated in place):
        a step that attends with MLX's SDPA (the fused switch off, or a layer the kernel declines) copies CAP
        positions a layer, on top of SDPA reading them over the whole capacity."""
        self.write(keys, values)
        known, i = self.cache.position.known, self.block
        if known == 0:
            return keys, values
        if known is not None:
            return tuple(mx.concatenate([buffer[i : i + 1, :, :known], new], axis=2)
                         for buffer, new in ((self.cache.keys, keys), (self.cache.values, values)))
        start = self.cache.position.start
        return tuple(mx.slice_update(buffer[i : i + 1], new, start, axes=(0, 1, 2, 3))
                     for buffer, new in ((self.cache.keys, keys), (self.cache.values, values)))

    def decode_buffers(self, heads: int, head_dim: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array, int]:
        """Every attending layer's buffers as before this forward, int32 [P, CAP], and this layer's block in them
        (see KVCache.decode_buffers)."""
        return self.cache.keys, self.cache.values, self.cache.position.slots, self.block

    def written_in_place(self, keys: mx.array, values: mx.array) -> None:
        """The kernel that output these (its k_new / v_new) stored them in the buffers itself: the commit
        writes nothing."""
        self.cache.add(self.block, keys, values, in_place=True)

    def attention_mask(self, length: int) -> mx.array | str | None:
        """Query i (at position offset + i) sees cache slots 0..offset + i; the rest is unwritten. A prompt (the
        offset known) sees the slots written so far and its own: causal."""
        if self.cache.position.known is not None:
            return "causal" if length > 1 else None
        positions = self.offset + mx.arange(length, dtype=mx.int32)
        return mx.arange(self.cache.capacity, dtype=mx.int32)[None, :] <= positions[:, None]


class StaticLinearState:
    """One linear-attention layer's view of a StaticCache, with the interface its layer uses (a
    LinearAttentionState's): the states as they were before this forward (None before the first position), and
    `write`, which hands the new ones to the cache for its commit."""

    static = True

    def __init__(self, cache: StaticCache, layer: int, index: int):
        self.cache, self.layer, self.index = cache, layer, index

    @property
    def conv(self) -> mx.array | None:
        return self.cache.states[self.index].conv

    @property
    def delta(self) -> mx.array | None:
        return self.cache.states[self.index].delta

    def write(self, conv: mx.array, delta: mx.array, positions: int) -> None:
        """The states after `positions` more positions, written at the cache's commit."""
        self.cache.add_state(self.index, conv, delta, positions)
