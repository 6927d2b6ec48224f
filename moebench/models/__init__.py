"""Model families, chosen by config.json's model_type. Each family module provides
`build(args, store, dtype)` and `tensor_shapes(args)` (its checkpoint layout, for writing)."""

from __future__ import annotations

from types import ModuleType

from ..errors import ConfigError
from . import qwen2_moe, qwen3_moe

FAMILIES: dict[str, ModuleType] = {"qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe}


def family(model_type: str, source: str = "config.json") -> ModuleType:
    """The family module for a model_type, or a ConfigError listing the supported ones."""
    if model_type not in FAMILIES:
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported (supported: {sorted(FAMILIES)})")
    return FAMILIES[model_type]
