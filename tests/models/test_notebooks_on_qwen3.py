"""Every notebook runs unchanged on a Qwen3-MoE checkpoint (no shared expert, top-8, renormalised
top-k): the widgets and records know no family names."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from byte_tokenizer import write_byte_tokenizer
from nbclient import NotebookClient

from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory) -> Path:
    config = qwen2_moe_config(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=64,
                              shared_expert_intermediate_size=0, qkv_bias=False, num_experts=16,
                              num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096)
    folder = write_random_checkpoint(tmp_path_factory.mktemp("qwen3") / "ckpt", config, seed=5, bits=4,
                                     layout="stacked")  # as mlx-lm writes quantized Qwen3-MoE experts
    write_byte_tokenizer(folder)
    return folder


def run_notebook_on(notebook: Path, folder: Path, model_type: str, monkeypatch, check: str = "") -> None:
    """Run `notebook` with `folder` first in its model picker; no cell may fail, the model it opened must be of
    `model_type` (not the shipped model), and the assertions in `check` (code run after the last cell) must hold."""
    monkeypatch.setenv("MOEBENCH_MODEL", str(folder))
    nb = nbformat.read(notebook, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(f'assert picker.model.args.model_type == "{model_type}", '
                                              'picker.model.args\n' + check))
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(notebook.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_runs_on_qwen3(notebook, qwen3_checkpoint, monkeypatch):
    run_notebook_on(notebook, qwen3_checkpoint, "qwen3_moe", monkeypatch)
