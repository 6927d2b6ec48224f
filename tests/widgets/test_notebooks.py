"""The committed notebooks: stripped of outputs and widget state, no assertions in cells, and each opens its
model through the ModelPicker (MOEBENCH_MODEL's folders, then the shipped model)."""

import ast
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_the_six_notebooks_exist():
    assert [nb.name[:3] for nb in NOTEBOOKS] == ["01_", "02_", "03_", "04_", "05_", "06_"]


def test_notebooks_are_committed_stripped():
    result = subprocess.run([str(ROOT / "scripts" / "check-notebooks-stripped.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def code(nb: Path) -> str:
    return "\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")


def test_each_notebook_opens_its_model_through_the_picker():
    for nb in NOTEBOOKS:
        assert "picker = ModelPicker()" in code(nb) and "moebench.load(" not in code(nb), nb.name


def test_no_cell_asserts():
    for nb in NOTEBOOKS:
        tree = ast.parse(code(nb).replace("await ", ""))
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Assert)], nb.name
