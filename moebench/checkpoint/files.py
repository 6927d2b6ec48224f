"""Checkpoint folders: safetensors files or shards, header checks, the tensor store.

Every safetensors header is validated in Python (sizes, offsets that neither overlap nor repeat a name,
dtypes) before MLX touches the file, so a truncated or corrupt file raises CheckpointError naming it
instead of aborting MLX; no message quotes a file's bytes. Every file read must be a regular file inside
the checkpoint folder (checkpoint_file): a shard index cannot name a path outside it, and a FIFO cannot
block the loader. Tensors load lazily (mx.load), so stacking experts never holds two full copies in memory.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections import Counter
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

import mlx.core as mx
import numpy as np
from tqdm.auto import tqdm

from ..errors import CheckpointError, MoebenchError

SAFETENSORS_DTYPES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U64": 8, "I32": 4, "U32": 4,
    "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}
NUMPY_DTYPES = {  # how narrow() reads raw rows; bfloat16 as its bits, viewed as bfloat16 in MLX
    "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "U64": "<u8", "I32": "<i4", "U32": "<u4", "I16": "<i2",
    "U16": "<u2", "I8": "i1", "U8": "u1", "BOOL": "?",
}
MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_file(path: Path, folder: Path, error: type[MoebenchError] = CheckpointError) -> Path:
    """`path`, once it is known to be a regular file inside `folder`: a link may point anywhere inside it, or into
    the blob store of the Hugging Face cache when `folder` is one of its snapshots (snapshots/REV/x links to
    ../../blobs/HASH). Anything else (a FIFO would block the read forever, a device, a folder, a file elsewhere)
    is an `error` naming the path, and so is a link that dangles (a broken download is not an absent file); a
    missing file raises FileNotFoundError for the caller to word."""
    try:
        mode = path.stat().st_mode
        target, root = path.resolve(), folder.resolve()
    except FileNotFoundError:
        if path.is_symlink():
            raise error(f"{path}: a link to {os.readlink(path)}, which does not exist") from None
        raise
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        raise error(f"{path}: cannot read: {e}") from e
    roots = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
    if not any(target.is_relative_to(r) for r in roots):
        raise error(f"{path}: resolves to {target}, outside the checkpoint folder {folder}")
    if not stat.S_ISREG(mode):
        raise error(f"{path}: not a regular file")
    return path


def is_present(path: Path) -> bool:
    """Whether anything is at `path`: a file, or a link, even one that dangles or loops (checkpoint_file then
    refuses it, naming it; Path.exists alone would call such a link absent)."""
    return path.exists() or path.is_symlink()


def parse_json(text: str | bytes, path: Path, error: type[MoebenchError], **options: Any) -> Any:
    """json.loads(text, **options); JSON nested too deeply for Python's parser (a RecursionError) is an `error`
    naming the file. Other JSON errors pass through for the caller to word."""
    try:
        return json.loads(text, **options)
    except RecursionError:
        raise error(f"{path}: JSON nested too deeply to read") from None


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Parse and validate a safetensors header; returns {tensor name: {dtype, shape, data_offsets}}."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > MAX_HEADER_BYTES or n > size - 8:  # the number itself is the file's bytes: not quoted
                raise CheckpointError(f"{path}: corrupt header length (not a safetensors file? its first 8 bytes give "
                                      f"none that fits the file's {size} bytes and the {MAX_HEADER_BYTES} byte limit)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    try:
        header = parse_json(raw.decode("utf-8"), path, CheckpointError, object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON: not UTF-8 at byte {8 + e.start})") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON: {e.msg} at byte {8 + e.pos})") from e
    except _DuplicateKey as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: key {e.args[0]!r} appears twice") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not an object)")
    data_size = size - 8 - n
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise CheckpointError(f"{path}: tensor {name!r}: header entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {name!r}: invalid shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise CheckpointError(f"{path}: tensor {name!r}: invalid data_offsets {offsets!r}")
        if offsets[1] > data_size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {offsets[1]} but the file holds {data_size} data bytes "
                "(truncated file?)"
            )
        expected = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
        if offsets[1] - offsets[0] != expected:
            raise CheckpointError(
                f"{path}: tensor {name!r}: {offsets[1] - offsets[0]} bytes stored, shape {shape} {dtype} "
                f"needs {expected}"
            )
        tensors[name] = info
    spans = sorted((info["data_offsets"], name) for name, info in tensors.items()
                   if info["data_offsets"][0] < info["data_offsets"][1])  # an empty tensor overlaps nothing
    for (before, first), (after, second) in zip(spans, spans[1:], strict=False):
        if after[0] < before[1]:
            raise CheckpointError(f"{path}: tensors {first!r} (bytes {before[0]}..{before[1]}) and {second!r} (bytes "
                                  f"{after[0]}..{after[1]}) overlap")
    return tensors


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json.loads' object hook: a key given twice is corrupt (the safetensors format forbids it; parsers keep one
    or the other)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: from the shard index when present, else every *.safetensors; each a
    regular file inside the folder (checkpoint_file)."""
    index = folder / INDEX_FILE
    if is_present(index):
        try:
            weight_map = parse_json(checkpoint_file(index, folder).read_text(), index, CheckpointError)["weight_map"]
            names = set(weight_map.values())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: unreadable shard index: {e}") from e
        if not names:
            raise CheckpointError(f"{index}: the weight_map lists no shard files")
        files = []
        for name in sorted(names, key=str):
            path = _shard_path(folder, index, name)
            try:
                files.append(checkpoint_file(path, folder))
            except FileNotFoundError as e:
                raise CheckpointError(f"{index}: shard {path} is missing") from e
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no model.safetensors or shards found")
    return [checkpoint_file(f, folder) for f in files]


def _shard_path(folder: Path, index: Path, name: object) -> Path:
    """A weight_map value as a path in `folder`: relative, and never up out of it (no '..', no absolute path)."""
    if not isinstance(name, str) or not name.strip():
        raise CheckpointError(f"{index}: weight_map names a shard {name!r}, expected a file name")
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts or "\\" in name or "\0" in name:
        raise CheckpointError(f"{index}: shard {name!r} is not a file name inside the checkpoint folder {folder}")
    return folder / relative


def _read_at(f, offset: int, size: int) -> bytes:
    f.seek(offset)
    return f.read(size)


class TensorStore:
    """Lazily loaded tensors of a checkpoint, taken one by one so that leftovers can be reported."""

    def __init__(self, folder: Path, progress: bool | None = None):
        self.folder = folder
        self._tensors: dict[str, mx.array] = {}
        self._file_of: dict[str, Path] = {}
        self._stored: dict[str, tuple[int, dict]] = {}  # name -> (its first byte in its file, its header entry)
        self.skipped: Counter[str] = Counter()  # tensors left out on purpose, by why (skip)
        files = checkpoint_files(folder)
        show = len(files) > 1 if progress is None else progress
        for path in tqdm(files, desc="loading shards", unit="file", disable=not show):
            header = read_safetensors_header(path)
            with path.open("rb") as f:
                data_start = 8 + struct.unpack("<Q", f.read(8))[0]  # checked by read_safetensors_header
            try:
                arrays = mx.load(str(path))
            except (RuntimeError, ValueError) as e:
                raise CheckpointError(f"{path}: MLX could not open it: {e}") from e
            for name in header:
                if name in self._file_of:
                    raise CheckpointError(f"{path}: tensor {name!r} also stored in {self._file_of[name]}")
                if name not in arrays:
                    raise CheckpointError(f"{path}: tensor {name!r} in the header could not be loaded")
                self._tensors[name] = arrays[name]
                self._file_of[name] = path
                self._stored[name] = data_start + header[name]["data_offsets"][0], header[name]

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> Iterable[str]:
        return self._tensors.keys()

    def where(self, name: str) -> str:
        return str(self._file_of.get(name, self.folder))

    def peek(self, name: str) -> mx.array:
        return self._tensors[name]

    def take(self, name: str) -> mx.array:
        """Remove and return a tensor; a missing one is an error naming it."""
        if name not in self._tensors:
            raise CheckpointError(f"{self.folder}: missing tensor {name!r}")
        return self._tensors.pop(name)

    def take_optional(self, name: str) -> mx.array | None:
        return self._tensors.pop(name, None)

    def skip(self, name: str, why: str) -> None:
        """Leave out a tensor the model does not run (a multimodal folder's vision tower), counted under `why` for
        the load summary to say."""
        self.take(name)
        self.skipped[why] += 1

    def narrow(self, name: str, first: int, end: int) -> None:
        """Keep only rows [first, end) of a stored tensor's first axis (a rank's span of stacked experts), read
        from its file alone: the other rows are never read. A tensor made from stored ones (put: gpt-oss's
        interleaved gate/up split) is already read, and is cut in memory."""
        self.narrow_spans(name, ((first, end),))

    def narrow_spans(self, name: str, spans: tuple[tuple[int, int], ...]) -> None:
        """Keep only the rows of `spans` ([first, end) each, in order) of a tensor's first axis, as narrow does for
        one span (a rank's rows where they are several: a hybrid's [q | k | v] channels)."""
        if name not in self._tensors:
            raise CheckpointError(f"{self.where(name)}: missing tensor {name!r}")
        start, info = self._stored.get(name, (0, {"shape": list(self._tensors[name].shape)}))
        shape = info["shape"]
        for first, end in spans:
            if not shape or not 0 <= first < end <= shape[0]:
                raise CheckpointError(f"{self.where(name)}: tensor {name!r} of shape {tuple(shape)} has no rows "
                                      f"{first}..{end - 1}")
        if name not in self._stored:
            self._tensors[name] = mx.contiguous(mx.concatenate([self._tensors[name][a:b] for a, b in spans]))
            return
        row = math.prod(shape[1:]) * SAFETENSORS_DTYPES[info["dtype"]]
        with checkpoint_file(self._file_of[name], self.folder).open("rb") as f:
            raw = b"".join(_read_at(f, start + first * row, (end - first) * row) for first, end in spans)
        held = sum(end - first for first, end in spans)
        rows = mx.array(np.frombuffer(raw, dtype=NUMPY_DTYPES[info["dtype"]]).reshape(held, *shape[1:]))
        self._tensors[name] = mx.view(rows, mx.bfloat16) if info["dtype"] == "BF16" else rows

    def rename(self, name: str, new: str) -> None:
        """Give a tensor another name (a family's stored names -> moebench's), still stored where it was, so a
        rank can narrow it (read its rows alone) under the new name."""
        self.put(new, self.take(name), self._file_of.pop(name))
        if name in self._stored:
            self._stored[new] = self._stored.pop(name)

    def put(self, name: str, array: mx.array, where: str | Path) -> None:
        """Add a tensor made from stored ones (experts stacked), with the file it came from. It is no longer as
        stored, even under a stored tensor's name (a transformers conv weight turned): narrow cuts it in memory."""
        if name in self._tensors:
            raise CheckpointError(f"{where}: tensor {name!r} is stored twice")
        self._tensors[name] = array
        self._file_of[name] = Path(where)
        self._stored.pop(name, None)

    def check_all_used(self) -> None:
        """Leftover tensors mean the checkpoint does not match the config (e.g. an extra layer)."""
        leftover = sorted(n for n in self._tensors if not n.endswith("rotary_emb.inv_freq"))
        if leftover:
            more = f" and {len(leftover) - 1} more" if len(leftover) > 1 else ""
            raise CheckpointError(
                f"{self.where(leftover[0])}: unexpected tensor {leftover[0]!r}{more} not used by the model"
            )
