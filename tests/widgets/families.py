"""Tiny checkpoints of the families people run, each with a byte-level tokenizer, for the tests that pick them in a
notebook's model picker (8 experts, GLM's and DeepSeek-V3's 16 in groups; the hybrids with a sigmoid-gated shared
expert, GLM and DeepSeek-V3 with one added as it is, the others without)."""

from __future__ import annotations

from pathlib import Path

from byte_tokenizer import write_byte_tokenizer

from moebench.tools.presets import get_preset
from moebench.tools.writer import write_gpt_oss_mlx_lm_checkpoint, write_random_checkpoint

# what a person picks -> the make-random preset of its family at the tiny preset's size
FAMILIES = {"Qwen3-MoE": "qwen3-tiny", "OLMoE": "olmoe-tiny", "gpt-oss": "gpt-oss-tiny",
            "Qwen3.5": "qwen3.5-moe-tiny", "Qwen3-Next": "qwen3-next-tiny", "GLM-4.x": "glm4-moe-tiny",
            "DeepSeek-V3": "deepseek-v3-tiny"}


def write_family(folder: Path, preset: str) -> Path:
    """`preset` as the conversions people run lay it out (4-bit, experts stacked as mlx-lm stores them; gpt-oss with
    mxfp4 experts), float32 activations, in `folder` (named after the preset, as the picker shows it)."""
    config = {**get_preset(preset).config, "torch_dtype": "float32"}
    folder = Path(folder) / preset
    if config["model_type"] == "gpt_oss":
        write_gpt_oss_mlx_lm_checkpoint(folder, config, seed=5)
    else:
        write_random_checkpoint(folder, config, seed=5, bits=4, layout="stacked")
    write_byte_tokenizer(folder)
    return folder
