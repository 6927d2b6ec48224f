"""A scratch git repository with this checkout's notebook output filter, to check that a notebook run as
users run it leaves `git diff` empty (shared by test_notebook_filter and the browser test)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILTER_KEYS = r"^(filter\.nbstripout\.|diff\.ipynb\.)"


def git(folder: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, check=check)


def checkout_filter() -> list[tuple[str, str]]:
    """This checkout's nbstripout filter settings, as (key, value); fails saying how to install them."""
    if shutil.which("git") is None or git(ROOT, "rev-parse", "--show-toplevel", check=False).returncode:
        pytest.skip("not a git checkout: there is no git status to keep clean")
    found = git(ROOT, "config", "--local", "--get-regexp", FILTER_KEYS, check=False).stdout.splitlines()
    settings = [tuple(line.split(" ", 1)) for line in found]
    assert {key for key, _ in settings} >= {"filter.nbstripout.clean", "filter.nbstripout.extrakeys"}, (
        "the notebook output filter is not installed in this checkout: run scripts/setup.sh (or its nbstripout "
        "lines) so that running a notebook does not dirty git")
    return settings


def scratch_repo(folder: Path, notebook: str) -> Path:
    """A repository in `folder` holding .gitattributes and the committed (stripped) notebook, with this
    checkout's filter; returns the notebook's path in it."""
    settings = checkout_filter()
    (folder / "notebooks").mkdir(parents=True)
    shutil.copy(ROOT / ".gitattributes", folder / ".gitattributes")
    shutil.copy(ROOT / "notebooks" / notebook, folder / "notebooks" / notebook)
    git(folder, "init", "-q")
    for key, value in settings:
        git(folder, "config", key, value)
    git(folder, "add", "-A")
    git(folder, "-c", "user.name=test", "-c", "user.email=test@localhost", "commit", "-qm", "stripped notebook")
    return folder / "notebooks" / notebook


def assert_git_clean_after_run(folder: Path, notebook: str) -> None:
    """The run shows as a change without the filter (so this can fail) and as none with it."""
    unfiltered = git(folder, "-c", "filter.nbstripout.clean=cat", "diff", "--stat", check=False).stdout
    assert notebook in unfiltered, "the run left the notebook as it was: nothing was checked"
    diff = git(folder, "diff", check=False)
    assert diff.returncode == 0 and diff.stdout == "", diff.stdout[:3000]
    git(folder, "add", "-A")  # git status may list the file by its size until the index is refreshed
    assert git(folder, "status", "--porcelain").stdout == ""
