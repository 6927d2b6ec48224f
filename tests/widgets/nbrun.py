"""Run a notebook's code cells in this process, as the kernel would, and hand back its namespace and the
outputs it displayed, so tests can inspect the widgets the notebook built (nbmake runs the same notebooks
in a real kernel)."""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
from pathlib import Path

from IPython.core.displaypub import DisplayPublisher
from IPython.core.interactiveshell import InteractiveShell
from IPython.display import display

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


class Outputs(DisplayPublisher):
    """Keeps every display and display update instead of printing it: (data, display_id, update)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.published: list[tuple[dict, str | None, bool]] = []

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
        self.published.append((data, (transient or {}).get("display_id"), update))


def code_cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def run_notebook(name: str) -> dict:
    """Every code cell of notebooks/{name}.ipynb in order, inside one event loop (top-level await allowed);
    a cell's last expression is displayed as Jupyter does. Returns the namespace, with `_shown` (each
    cell's displayed result) and `_outputs` (the Outputs publisher: everything displayed)."""
    path = next(p for p in NOTEBOOKS if p.stem == name)
    shell = InteractiveShell.instance()
    outputs = shell.display_pub = Outputs(shell=shell)
    namespace: dict = {"display": display, "_shown": [], "_outputs": outputs}

    async def cells():
        for source in code_cells(path):
            tree = ast.parse(source)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            for part in (tree, ast.Expression(last.value) if last is not None else None):
                if part is None:
                    continue
                mode = "eval" if isinstance(part, ast.Expression) else "exec"
                value = eval(compile(part, f"{name}.ipynb", mode, flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT), namespace)
                if inspect.iscoroutine(value):
                    value = await value
                if mode == "eval" and value is not None:
                    namespace["_shown"].append(value)
                    display(value)

    asyncio.run(cells())
    return namespace
