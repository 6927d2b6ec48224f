"""`moebench notebooks DIR`: the package's notebooks (the checkout's notebooks/ through the moebench/notebooks link)
copied into a folder of the user's, none replaced unless asked, every problem named."""

from __future__ import annotations

from pathlib import Path

import pytest

from moebench.cli import main
from moebench.tools import notebooks

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def test_the_notebooks_are_copied_byte_for_byte_and_kept_unless_forced(tmp_path, capsys):
    folder = tmp_path / "work" / "notebooks"
    assert main(["notebooks", str(folder)]) == 0
    expected = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert len(expected) == 6 and sorted(p.name for p in folder.iterdir()) == expected
    assert all((folder / name).read_bytes() == (NOTEBOOKS / name).read_bytes() for name in expected)
    assert f"jupyter lab {folder}" in capsys.readouterr().out
    saved = folder / expected[0]
    saved.write_text("{}")  # the user's own work in it
    assert main(["notebooks", str(folder)]) == 2
    assert f"{folder}: {', '.join(expected)} already there (--force replaces them)" in capsys.readouterr().err
    assert saved.read_text() == "{}"
    assert main(["notebooks", str(folder), "--force"]) == 0
    assert saved.read_bytes() == (NOTEBOOKS / saved.name).read_bytes()


def test_a_file_in_the_way_or_a_package_without_notebooks_is_named(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["notebooks", str(blocker)]) == 2
    assert capsys.readouterr().err.strip() == f"moebench: error: {blocker}: not a folder"
    assert main(["notebooks", str(blocker / "below")]) == 2
    assert f"{blocker / 'below'}: cannot write the notebooks" in capsys.readouterr().err
    monkeypatch.setattr(notebooks.resources, "files", lambda package: tmp_path / "empty")
    with pytest.raises(notebooks.MoebenchError, match="carries no notebooks"):
        notebooks.copy_notebooks(tmp_path / "out")
    assert not (tmp_path / "out").exists()
