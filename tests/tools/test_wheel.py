"""A normal (non-editable) install works: the wheel, installed into a fresh virtual environment, carries the kernel
sources, the shipped model and the notebooks, passes `moebench selfcheck` and hands out the notebooks
(`moebench notebooks DIR`).

The rest of the suite runs against the editable install, which reads kernels/ and data/ straight from the checkout,
so a wheel that lacks them (a package-data glob that misses a file, a link that does not resolve) passes every other
test. On a CPU the fused path runs as the MLX reference and never reads the kernel sources, so selfcheck alone
cannot see them missing: the first test compares the installed files with the source tree's.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KERNELS = Path("moebench/kernel_sources")  # inside the package: links to kernels/, data/ and notebooks/ in the checkout
MODEL = Path("moebench/shipped/tiny-qwen2-moe")
NOTEBOOKS = Path("moebench/notebooks")
SELFCHECK = ["--prompt-tokens", "3", "--gen-tokens", "4", "--repeats", "1", "--no-progress"]
PROBE = """
import json, moebench
from importlib import resources
package = resources.files("moebench")  # how the code finds the kernel sources and the shipped model
print(json.dumps({"moebench": moebench.__file__, "kernels": str(package / "kernel_sources"),
                  "model": str(package / "shipped" / "tiny-qwen2-moe"), "notebooks": str(package / "notebooks")}))
"""


def run(*argv: str | Path, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def copy_checkout(dest: Path) -> Path:
    """What a fresh clone would hold (tracked and new files, links kept as links), so the build sees neither the
    checkout's build/ and *.egg-info (setuptools packs stale files left in build/lib) nor anyone's junk, and writes
    nothing into the checkout."""
    listed = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=REPO).stdout
    for name in sorted(set(listed.split("\0")) - {""}):
        source, target = REPO / name, dest / name
        if not source.is_symlink() and not source.is_file():
            continue  # deleted in the work tree but not yet in the index
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """The wheel built from a copy of the checkout and installed, alone, into a new venv outside the checkout."""
    root = tmp_path_factory.mktemp("wheel")
    assert not root.resolve().is_relative_to(REPO), "the install must happen outside the checkout"
    source, dist, venv, work = copy_checkout(root / "src"), root / "dist", root / "venv", root / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items()  # no PYTHONPATH into a checkout, no MOEBENCH_MODEL elsewhere
           if not k.startswith(("MOEBENCH_", "PYTHON")) and k not in ("VIRTUAL_ENV", "PIP_USER", "PIP_TARGET",
                                                                        "PIP_PREFIX")}
    pip = ["-m", "pip", "-q", "--disable-pip-version-check"]
    run(sys.executable, *pip, "wheel", "--no-deps", "-w", dist, source, cwd=work, env=env)
    (wheel,) = dist.glob("moebench-*.whl")
    run(sys.executable, "-m", "venv", venv, cwd=work, env=env)
    python = venv / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=work, env=env)
    purelib = Path(purelib.stdout.strip())
    # The dependencies come from this interpreter's site folders (its own venv's too, where --system-site-packages
    # would reach only the base interpreter's); they are appended after the venv's, so its moebench comes first.
    folders = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    folders = [d for d in folders if Path(d).is_dir()]
    (purelib / "_test_wheel_deps.pth").write_text(f"import site; list(map(site.addsitedir, {folders!r}))\n")
    run(python, *pip, "install", "--no-deps", wheel, cwd=work, env=env)
    probe = json.loads(run(python, "-c", PROBE, cwd=work, env=env).stdout)
    return {"source": source, "venv": venv, "work": work, "env": env, "purelib": purelib, "probe": probe}


def test_the_wheel_installs_the_package_with_every_kernel_source_the_shipped_model_and_the_notebooks(installed):
    """The venv's own copy must win over the editable install's finder (it sits in the site folders the venv reads)
    and hold every file of kernels/, of the shipped model and of notebooks/, byte for byte."""
    probe, package = installed["probe"], installed["purelib"] / "moebench"
    assert Path(probe["moebench"]) == package / "__init__.py", f"imported {probe['moebench']}, not the venv's copy"
    for folder, key in ((KERNELS, "kernels"), (MODEL, "model"), (NOTEBOOKS, "notebooks")):
        installed_folder = installed["purelib"] / folder
        assert Path(probe[key]) == installed_folder and installed_folder.is_dir(), f"the wheel has no {folder}"
        expected = sorted(p.name for p in (installed["source"] / folder).iterdir() if p.is_file())
        assert expected and sorted(p.name for p in installed_folder.iterdir()) == expected
        _, mismatch, errors = filecmp.cmpfiles(installed["source"] / folder, installed_folder, expected,
                                                   shallow=False)
        assert (mismatch, errors) == ([], []), f"{folder}: differ {mismatch}, missing {errors}"


def test_selfcheck_passes_on_the_shipped_model_from_the_installed_wheel(installed):
    """What a user runs first after `pip install moebench`: the console script, the shipped model, no checkout."""
    out = installed["work"] / "selfcheck.json"
    run(installed["venv"] / "bin" / "moebench", "selfcheck", "--json", out, *SELFCHECK, cwd=installed["work"],
        env=installed["env"])
    record = json.loads(out.read_text())
    assert record["passed"] and record["platform"]["backend"] == "reference"
    assert record["decode"]["dispatch"]["fused"].get("reference", 0) > 0, record["decode"]["dispatch"]
    assert Path(record["model"]["path"]) == installed["purelib"] / MODEL


def test_the_installed_command_hands_out_the_notebooks(installed):
    """`moebench notebooks DIR` from the wheel: the notebooks it carries, where a user runs and saves them."""
    folder = installed["work"] / "my-notebooks"
    run(installed["venv"] / "bin" / "moebench", "notebooks", folder, cwd=installed["work"], env=installed["env"])
    source = installed["source"] / "notebooks"
    names = sorted(p.name for p in source.glob("*.ipynb"))
    assert names and sorted(p.name for p in folder.iterdir()) == names
    assert all((folder / n).read_bytes() == (source / n).read_bytes() for n in names)
