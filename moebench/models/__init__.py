"""Model families, chosen by config.json's model_type. Each family is one module that declares itself in a
Family value (its FAMILY: moebench.models.family); registering a family is naming its module here."""

from __future__ import annotations

import functools
import importlib

from ..errors import ConfigError
from .family import Family

FAMILY_MODULES = ("qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "qwen3_next", "mixtral", "glm4_moe", "deepseek_v3")


@functools.cache
def families() -> dict[str, Family]:
    """model_type -> its Family, over every registered family module."""
    found: dict[str, Family] = {}
    for name in FAMILY_MODULES:
        declared = importlib.import_module(f".{name}", __name__).FAMILY
        found.update(dict.fromkeys(declared.model_types, declared))
    return found


def family(model_type: str, source: str = "config.json") -> Family:
    """The Family of a model_type, or a ConfigError listing the supported ones."""
    if model_type not in families():
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported (supported: {sorted(families())})")
    return families()[model_type]
