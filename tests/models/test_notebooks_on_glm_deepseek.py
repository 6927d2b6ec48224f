"""Every notebook runs unchanged on a GLM-4.x MoE and a DeepSeek-V3 checkpoint (the grouped sigmoid router with its
selection bias, shared experts added as they are, dense first layers; DeepSeek-V3's multi-head latent attention):
the widgets and records know no family names."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_notebooks_on_qwen3 import NOTEBOOKS, run_notebook_on

from moebench.tools.byte_tokenizer import write_byte_tokenizer
from moebench.tools.presets import get_preset
from moebench.tools.writer import write_random_checkpoint

PRESETS = {"glm4_moe": "glm4-moe-tiny", "deepseek_v3": "deepseek-v3-tiny"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny preset, 4-bit at group 32 (DeepSeek's latent widths), experts stacked as mlx-lm stores
    them."""
    made = {}
    for model_type, preset in PRESETS.items():
        folder = write_random_checkpoint(tmp_path_factory.mktemp(preset) / "ckpt", get_preset(preset).config,
                                         seed=5, bits=4, group_size=32, layout="stacked")
        write_byte_tokenizer(folder)
        made[model_type] = folder
    return made


@pytest.mark.parametrize("model_type", PRESETS)
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_runs_on_a_selection_biased_router(notebook, model_type, checkpoints, monkeypatch):
    run_notebook_on(notebook, checkpoints[model_type], model_type, monkeypatch)
