"""Exception types users catch. Every error names the file, tensor or field at fault."""

from __future__ import annotations


class MoebenchError(Exception):
    """Base class of every error moebench raises on purpose."""


class ConfigError(MoebenchError):
    """config.json is missing, unreadable, or has a missing or invalid field."""


class CheckpointError(MoebenchError):
    """A safetensors file, shard index or tensor is missing, corrupt or has the wrong shape."""


class UnsupportedKernelConfig(MoebenchError):
    """The fused decode-MoE kernel cannot run this layer; the message says why."""


class DecodeError(MoebenchError, ValueError):
    """A prompt, token id or decode setting that cannot be used: no tokens, ids outside the vocabulary, top_p 0, ..."""


class NonFiniteError(MoebenchError, FloatingPointError):
    """NaN or Inf where a number must be finite: a weight at load, the logits a token would be chosen from."""


class DeviceMemoryError(MoebenchError, MemoryError):
    """A decode would ask for more memory than the device has (MLX would abort or fail mid-way)."""
