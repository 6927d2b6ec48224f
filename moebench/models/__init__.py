"""Model families, chosen by config.json's model_type: one module per family (qwen2_moe, qwen3_moe, olmoe,
gpt_oss, qwen3_next), imported when a checkpoint of that family is opened. Qwen3.5 MoE (its multimodal folder's
model_type and its text_config's) is qwen3_next's module."""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import ConfigError

FAMILIES = ("gpt_oss", "olmoe", "qwen2_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next")
MODULE_OF = {"qwen3_5_moe": "qwen3_next", "qwen3_5_moe_text": "qwen3_next"}  # model_types sharing a module


def family(model_type: str, source: str = "config.json") -> ModuleType:
    """The family module for a model_type, or a ConfigError listing the supported ones."""
    if model_type not in FAMILIES:
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported (supported: {sorted(FAMILIES)})")
    return importlib.import_module(f".{MODULE_OF.get(model_type, model_type)}", __name__)
