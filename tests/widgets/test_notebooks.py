"""The committed notebooks: stripped of outputs and widget state, and each opens its model through MODEL."""

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_the_five_notebooks_exist():
    assert [nb.name[:3] for nb in NOTEBOOKS] == ["01_", "02_", "03_", "04_", "05_"]


def test_notebooks_are_committed_stripped():
    result = subprocess.run([str(ROOT / "scripts" / "check-notebooks-stripped.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_each_notebook_opens_model_from_one_variable_reading_moebench_model():
    for nb in NOTEBOOKS:
        code = "\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
        assert 'MODEL = os.environ.get("MOEBENCH_MODEL") or' in code and "moebench.load(MODEL)" in code, nb.name
