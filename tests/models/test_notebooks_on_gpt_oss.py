"""Every notebook runs unchanged on a gpt-oss checkpoint at gpt-oss-20b's routing shape (32 experts, top-4 logits
then softmax, a router bias; experts with biases and the clamped SwiGLU in mxfp4; sinks and a window of 4 on
alternate layers), written as mlx-lm lays gpt-oss out: the widgets and records know no family names."""

from __future__ import annotations

from pathlib import Path

import pytest
from byte_tokenizer import write_byte_tokenizer
from test_notebooks_on_qwen3 import NOTEBOOKS, run_notebook_on

from moebench.tools.presets import get_preset
from moebench.tools.writer import write_gpt_oss_mlx_lm_checkpoint


@pytest.fixture(scope="module")
def gpt_oss_checkpoint(tmp_path_factory) -> Path:
    """gpt-oss-tiny's widths with gpt-oss-20b's 32 experts top-4, affine 4-bit g32 around mxfp4 experts."""
    config = {**get_preset("gpt-oss-tiny").config, "num_local_experts": 32, "num_experts_per_tok": 4,
              "torch_dtype": "float32"}
    folder = write_gpt_oss_mlx_lm_checkpoint(tmp_path_factory.mktemp("gpt-oss") / "ckpt", config, seed=5)
    write_byte_tokenizer(folder)
    return folder


# gpt-oss has no shared expert: notebook 05 runs no shared-expert intervention (it would decode the baseline again)
CHECKS = {"05_interventions": 'assert not panel.has_shared_expert and panel.gate_scale.disabled\n'
                              'assert [r.label.split(":")[0] for r in panel.results] == ["1", "2"], panel.results\n'
                              'assert not any("shared" in r.label for r in panel.results)'}


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_runs_on_gpt_oss(notebook, gpt_oss_checkpoint, monkeypatch):
    run_notebook_on(notebook, gpt_oss_checkpoint, "gpt_oss", monkeypatch, CHECKS.get(notebook.stem, ""))
