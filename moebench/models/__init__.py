"""Model families, chosen by config.json's model_type."""

from __future__ import annotations

from . import qwen2_moe, qwen3_moe

FAMILIES = {"qwen2_moe": qwen2_moe.build, "qwen3_moe": qwen3_moe.build}
