"""Every notebook runs unchanged on a Qwen3-Next hybrid (three Gated DeltaNet linear-attention layers to one gated
full-attention layer, routed experts with a sigmoid-gated shared expert), written by make-random as mlx-lm lays
these models out: the widgets and records know no family names, and a layer without keys and values is no
special case for them."""

from __future__ import annotations

from pathlib import Path

import pytest
from byte_tokenizer import write_byte_tokenizer
from test_notebooks_on_qwen3 import NOTEBOOKS, run_notebook_on

from moebench.tools.presets import get_preset
from moebench.tools.writer import write_random_checkpoint


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory) -> Path:
    config = {**get_preset("qwen3-next-tiny").config, "torch_dtype": "float32"}
    folder = write_random_checkpoint(tmp_path_factory.mktemp("qwen3-next") / "ckpt", config, seed=5, bits=4,
                                     layout="stacked")
    write_byte_tokenizer(folder)
    return folder


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_runs_on_a_hybrid(notebook, hybrid_checkpoint, monkeypatch):
    run_notebook_on(notebook, hybrid_checkpoint, "qwen3_next", monkeypatch)
