"""Choosing the next token from logits: greedy, or sampled with temperature, top-k and top-p, and a repetition
penalty on tokens already seen.

The settings keep transformers' meaning (they are what checkpoints publish in generation_config.json) and
apply in its order: repetition penalty, temperature, top-k, top-p. The penalty applies to greedy decoding
too, as in transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import mlx.core as mx

from ..checkpoint.config import GenerationConfig
from ..errors import DecodeError

# The smallest temperature and repetition penalty (other than temperature 0, greedy) that keep logits / x finite in
# float32 for any logit below 1e32: below it a logit overflows to inf and ties with every other one that does.
MIN_DIVISOR = 1e-6
MAX_SEED = 2**64 - 1  # MLX's random keys (and numpy's generators, as moebench uses them) take 64-bit seeds


@dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy; top_k > 0 keeps the k likeliest tokens (0: all); top_p < 1 keeps the smallest
    set of tokens with that much mass; repetition_penalty > 1 divides a seen token's positive logit (multiplies a
    negative one), over the last `repetition_context` tokens of prompt and output (None: all, as transformers;
    mlx-lm's default is 20)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    repetition_penalty: float = 1.0
    repetition_context: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "repetition_penalty"):
            if not _is_real(getattr(self, name)):
                raise DecodeError(f"Sampling.{name} must be a number, got {getattr(self, name)!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise DecodeError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_DIVISOR:
            raise DecodeError(f"temperature {self.temperature} is below {MIN_DIVISOR}: logits / temperature would "
                              "overflow float32 (use 0 for greedy)")
        if not 0 < self.top_p <= 1:
            raise DecodeError(f"top_p must be in (0, 1], got {self.top_p}")
        check_seed(self.seed)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise DecodeError(f"top_k must be an integer >= 0 (0 keeps every token), got {self.top_k!r}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty < MIN_DIVISOR:
            raise DecodeError(f"repetition_penalty must be a finite number >= {MIN_DIVISOR} (1 is off), got "
                              f"{self.repetition_penalty}")
        if self.repetition_context is not None and (not _is_int(self.repetition_context)
                                                    or self.repetition_context < 1):
            raise DecodeError(f"repetition_context must be an integer >= 1 or None, got {self.repetition_context!r}")

    @property
    def uses_history(self) -> bool:
        """Whether `sample` needs the tokens seen so far (a decode loop keeps them only then)."""
        return self.repetition_penalty != 1.0

    @classmethod
    def from_generation_config(cls, config: GenerationConfig, seed: int | None = None) -> Sampling:
        """A checkpoint's published settings, read as transformers reads them: greedy unless do_sample, a
        setting left out not applied (temperature 1 when sampling), the repetition penalty either way."""
        penalty = config.repetition_penalty if config.repetition_penalty is not None else 1.0
        if not config.do_sample:
            return cls(seed=seed, repetition_penalty=penalty)
        return cls(temperature=config.temperature if config.temperature is not None else 1.0,
                   top_p=config.top_p if config.top_p is not None else 1.0, seed=seed, top_k=config.top_k or 0,
                   repetition_penalty=penalty)


def check_seed(seed: object, name: str = "seed") -> int | None:
    """`seed` when it is None or an integer from 0 to MAX_SEED (what MLX's mx.random.key and numpy's default_rng
    take); anything else (negative, past 64 bits, a bool or a float) is a DecodeError naming it."""
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise DecodeError(f"{name} must be an integer from 0 to 2**64 - 1 (or None), got {seed!r}")
    return seed


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def penalize_repetition(logits: mx.array, history: mx.array, penalty: float) -> mx.array:
    """logits [B, V] with each seen token's logit divided by `penalty` when positive, multiplied when negative.
    history [B, T] (or [T]) holds the seen ids; repeats count once."""
    history = history.astype(mx.uint32)
    if history.ndim == 1:
        history = mx.broadcast_to(history[None], (logits.shape[0], history.shape[0]))
    seen = mx.take_along_axis(logits, history, axis=-1)
    seen = mx.where(seen < 0, seen * penalty, seen / penalty)
    return mx.put_along_axis(logits, history, seen, axis=-1)


def sampling_logits(logits: mx.array, sampling: Sampling, history: mx.array | None = None) -> mx.array:
    """The float32 logits [B, V] a sampled token is drawn from: penalized, scaled by temperature, and -inf outside
    top-k and top-p. Greedy settings only penalize."""
    logits = logits.astype(mx.float32)
    if sampling.uses_history:
        if history is None:
            raise DecodeError("repetition_penalty needs the tokens seen so far; this decode loop passes none")
        if sampling.repetition_context is not None:
            history = history[..., -sampling.repetition_context:]
        logits = penalize_repetition(logits, history, sampling.repetition_penalty)
    if sampling.temperature <= 0:
        return logits
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = mx.sort(logits, axis=-1)[..., -sampling.top_k][..., None]
        logits = mx.where(logits < kth, -mx.inf, logits)
    if sampling.top_p < 1.0:
        probs = mx.softmax(logits, axis=-1)
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        keep_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) < sampling.top_p
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        logits = mx.where(keep, logits, -mx.inf)
    return logits


def seen_tokens(history: mx.array | None, tokens: mx.array, sampling: Sampling) -> mx.array | None:
    """The ids the repetition penalty looks at once `tokens` [n] are fed (the prompt, then each chosen token):
    what a decode loop passes to `sample` as `history`. None when the settings need none, so a loop without a
    penalty keeps nothing; rolling a step of n tokens back is `history[:-n]`."""
    if not sampling.uses_history:
        return None
    tokens = tokens.reshape(-1).astype(mx.uint32)
    return tokens if history is None else mx.concatenate([history, tokens])


def sample(logits: mx.array, sampling: Sampling, key: mx.array | None = None,
           history: mx.array | None = None) -> mx.array:
    """logits [B, V] -> token ids [B]. `history` (ids seen so far, prompt included) is needed only when
    `sampling.uses_history`."""
    if sampling.temperature <= 0:
        return mx.argmax(sampling_logits(logits, sampling, history) if sampling.uses_history else logits, axis=-1)
    return mx.random.categorical(sampling_logits(logits, sampling, history), key=key)


GREEDY = Sampling()
