"""`moebench notebooks DIR`: the workbench's notebooks, copied out of the installed package into a folder of the
user's, where they run and are saved (the package keeps its copies as shipped). The wheel carries them under
moebench/notebooks, a link to the checkout's notebooks/ (as kernel_sources and shipped link theirs)."""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

from ..errors import MoebenchError


def shipped_notebooks() -> dict[str, bytes]:
    """Each notebook the package carries, by file name, in order."""
    folder = resources.files("moebench") / "notebooks"
    found = {nb.name: nb.read_bytes() for nb in sorted(folder.iterdir(), key=lambda p: p.name)
             if nb.name.endswith(".ipynb")} if folder.is_dir() else {}
    if not found:
        raise MoebenchError(f"{folder}: this moebench carries no notebooks (an install without its package data)")
    return found


def copy_notebooks(folder: str | Path, replace: bool = False) -> list[Path]:
    """The notebooks written into `folder` (made when missing); one already there is replaced only with
    `replace`, else a MoebenchError names them before anything is written."""
    folder = Path(folder)
    notebooks = shipped_notebooks()
    if folder.exists() and not folder.is_dir():
        raise MoebenchError(f"{folder}: not a folder")
    there = [name for name in notebooks if (folder / name).exists()]
    if there and not replace:
        raise MoebenchError(f"{folder}: {', '.join(there)} already there (--force replaces them)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in notebooks.items():
            (folder / name).write_bytes(data)
    except OSError as e:
        raise MoebenchError(f"{folder}: cannot write the notebooks: {e}") from e
    return [folder / name for name in notebooks]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("notebooks", help="copy the workbench's notebooks into a folder, to open in JupyterLab")
    p.add_argument("folder", help="where to write them (made when missing)")
    p.add_argument("--force", action="store_true", help="replace notebooks of the same names already there")
    p.set_defaults(run=_run)


def _run(a: argparse.Namespace) -> int:
    written = copy_notebooks(a.folder, a.force)
    print(f"wrote {len(written)} notebooks to {Path(a.folder)}: {', '.join(p.name for p in written)}")
    print(f"open them with: jupyter lab {Path(a.folder)}   (JupyterLab: pip install 'moebench[lab]')")
    return 0
