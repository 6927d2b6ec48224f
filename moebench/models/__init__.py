"""Model families, chosen by config.json's model_type: one module per family (qwen2_moe, qwen3_moe, olmoe,
gpt_oss),
imported when a checkpoint of that family is opened."""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import ConfigError

FAMILIES = ("gpt_oss", "olmoe", "qwen2_moe", "qwen3_moe")


def family(model_type: str, source: str = "config.json") -> ModuleType:
    """The family module for a model_type, or a ConfigError listing the supported ones."""
    if model_type not in FAMILIES:
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported (supported: {sorted(FAMILIES)})")
    return importlib.import_module(f".{model_type}", __name__)
