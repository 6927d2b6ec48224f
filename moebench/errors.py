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
