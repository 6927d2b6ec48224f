"""`--json`, one convention for every command: `--json FILE` writes the command's whole record to FILE beside its
text report; `--json -` (or `--json` alone) prints the record to stdout instead of the text report, so stdout is one
JSON document a script can parse. A FILE that cannot be written (as any file a command is told to write) is named
before the command runs, not after."""

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


def check_output_file(option: str, path: Path, make_folder: bool = False) -> None:
    """A MoebenchError naming `option` when a command could not write `path`: something there that is no regular
    file (a folder; a FIFO, where a write would block), a file it may not write, or no folder to write it in (with
    `make_folder`, the nearest folder above that exists must take a new one)."""
    if path.exists() or path.is_symlink():
        if not path.is_file() or not os.access(path, os.W_OK):
            raise MoebenchError(f"{option} {path}: cannot write a file there (not a regular file it may write)")
        return
    folder = path.parent
    while make_folder and not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise MoebenchError(f"{option} {path}: cannot write a file there ({folder} is no folder it may write in)")


def check_json_target(target: str | None) -> None:
    """check_output_file for --json FILE (its folder must exist), before anything runs."""
    if target is not None and not to_stdout(target):
        check_output_file("--json", Path(target))


def _plain(value: Any) -> Any:
    """numpy's scalars (pandas tables hand them over) as the Python numbers they hold."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def report(target: str | None, text: str, record: Any) -> None:
    """A command's results: its text report on stdout, and its record where --json `target` says (FILE beside the
    report, or stdout instead of it)."""
    if not to_stdout(target):
        print(text)
    if target is not None:
        write_json(target, record)


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
