"""Running a notebook leaves git clean: scripts/setup.sh installs the output filter .gitattributes names.

The real run: a notebook executed in a kernel and saved in place, as Jupyter saves it (outputs, execution
counts, widget state, the kernel's language_info), inside a scratch repository that uses this checkout's
filter settings; `git diff` must then be empty. (The browser test does the same with JupyterLab's save.)
"""

from __future__ import annotations

import json
import subprocess
import sys

from gitfilter import ROOT, assert_git_clean_after_run, checkout_filter, git, scratch_repo

NOTEBOOK = "05_interventions.ipynb"  # among the quickest to run


def test_setup_installed_the_filter_that_gitattributes_names():
    settings = dict(checkout_filter())
    assert "nbstripout" in settings["filter.nbstripout.clean"]
    assert "metadata.language_info.version" in settings["filter.nbstripout.extrakeys"]
    check = git(ROOT, "check-attr", "filter", "--", f"notebooks/{NOTEBOOK}").stdout
    assert check.strip().endswith("filter: nbstripout")


def test_a_notebook_run_and_saved_in_place_leaves_git_diff_empty(tmp_path):
    path = scratch_repo(tmp_path, NOTEBOOK)
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", "--inplace",
                    "--ExecutePreprocessor.timeout=300", str(path)], check=True, capture_output=True, cwd=tmp_path)
    saved = json.loads(path.read_text())
    assert any(c.get("outputs") for c in saved["cells"]) and "version" in saved["metadata"]["language_info"]
    assert_git_clean_after_run(tmp_path, NOTEBOOK)
