"""`--json`, one convention for every command: `--json FILE` writes the command's whole record to FILE beside its
text report; `--json -` (or `--json` alone) prints the record to stdout instead of the text report, so stdout is one
JSON document a script can parse. A FILE that cannot be written is named before the command runs, not after."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from ..errors import MoebenchError

STDOUT = "-"


def add_json_option(p: argparse.ArgumentParser, what: str) -> None:
    """--json [FILE] on `p`; `what` says what the record holds."""
    p.add_argument("--json", metavar="FILE", nargs="?", const=STDOUT, default=None,
                   help=f"write {what} as JSON to FILE ('-', or no FILE: to stdout, instead of the text report)")


def to_stdout(target: str | None) -> bool:
    """Whether the record replaces the text report on stdout."""
    return target == STDOUT


def check_json_target(target: str | None) -> None:
    """A MoebenchError naming --json when FILE cannot be written (a folder, a missing or read-only folder), before
    anything runs."""
    if target is None or to_stdout(target):
        return
    path = Path(target)
    folder = path.parent
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK) or (
            path.exists() and not os.access(path, os.W_OK)):
        raise MoebenchError(f"--json {path}: cannot write a file there")


def _plain(value: Any) -> Any:
    """numpy's scalars (pandas tables hand them over) as the Python numbers they hold."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def write_json(target: str, record: Any) -> None:
    """The record, indented, to stdout or to FILE (a write that fails is a MoebenchError naming --json)."""
    text = json.dumps(record, indent=2, default=_plain) + "\n"
    if to_stdout(target):
        print(text, end="", flush=True)
        return
    try:
        Path(target).write_text(text)
    except OSError as e:
        raise MoebenchError(f"--json {target}: cannot write the record: {e}") from e
