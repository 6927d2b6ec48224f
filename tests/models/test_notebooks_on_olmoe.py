"""Every notebook runs unchanged on an OLMoE checkpoint (no shared expert, softmax then top-k without
renormalising, q/k RMSNorm over the whole projections): the widgets and records know no family names."""

from __future__ import annotations

from pathlib import Path

import pytest
from byte_tokenizer import write_byte_tokenizer
from test_notebooks_on_qwen3 import NOTEBOOKS, run_notebook_on

from moebench.tools.presets import get_preset
from moebench.tools.writer import write_random_checkpoint


@pytest.fixture(scope="module")
def olmoe_checkpoint(tmp_path_factory) -> Path:
    """The olmoe-tiny preset, 4-bit, experts stacked as mlx-lm's OLMoE conversions store them."""
    config = get_preset("olmoe-tiny").config
    folder = write_random_checkpoint(tmp_path_factory.mktemp("olmoe") / "ckpt", config, seed=5, bits=4,
                                     layout="stacked")
    write_byte_tokenizer(folder)
    return folder


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_runs_on_olmoe(notebook, olmoe_checkpoint, monkeypatch):
    run_notebook_on(notebook, olmoe_checkpoint, "olmoe", monkeypatch)
