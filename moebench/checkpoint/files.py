"""Checkpoint folders: safetensors files or shards, header checks, the tensor store.

Every safetensors header is validated in Python (sizes, offsets, dtypes) before MLX touches the
file, so a truncated or corrupt file raises CheckpointError naming it instead of aborting MLX.
Tensors load lazily (mx.load), so stacking experts never holds two full copies in memory.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

import mlx.core as mx
from tqdm.auto import tqdm

from ..errors import CheckpointError

SAFETENSORS_DTYPES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U64": 8, "I32": 4, "U32": 4,
    "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_FILE = "model.safetensors.index.json"


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Parse and validate a safetensors header; returns {tensor name: {dtype, shape, data_offsets}}."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > MAX_HEADER_BYTES or n > size - 8:
                raise CheckpointError(f"{path}: corrupt header length {n} for a file of {size} bytes")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON): {e}") from e
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
    return tensors


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: from the shard index when present, else every *.safetensors."""
    index = folder / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({str(v) for v in weight_map.values()})
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: unreadable shard index: {e}") from e
        if not files:
            raise CheckpointError(f"{index}: the weight_map lists no shard files")
        missing = [f for f in files if not (folder / f).exists()]
        if missing:
            raise CheckpointError(f"{index}: shard {folder / missing[0]} is missing")
        return [folder / f for f in files]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no model.safetensors or shards found")
    return files


class TensorStore:
    """Lazily loaded tensors of a checkpoint, taken one by one so that leftovers can be reported."""

    def __init__(self, folder: Path, progress: bool | None = None):
        self.folder = folder
        self._tensors: dict[str, mx.array] = {}
        self._file_of: dict[str, Path] = {}
        files = checkpoint_files(folder)
        show = len(files) > 1 if progress is None else progress
        for path in tqdm(files, desc="loading shards", unit="file", disable=not show):
            header = read_safetensors_header(path)
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

    def put(self, name: str, array: mx.array, where: str | Path) -> None:
        """Add a tensor made from stored ones (experts stacked), with the file it came from."""
        if name in self._tensors:
            raise CheckpointError(f"{where}: tensor {name!r} is stored twice")
        self._tensors[name] = array
        self._file_of[name] = Path(where)

    def check_all_used(self) -> None:
        """Leftover tensors mean the checkpoint does not match the config (e.g. an extra layer)."""
        leftover = sorted(n for n in self._tensors if not n.endswith("rotary_emb.inv_freq"))
        if leftover:
            more = f" and {len(leftover) - 1} more" if len(leftover) > 1 else ""
            raise CheckpointError(
                f"{self.where(leftover[0])}: unexpected tensor {leftover[0]!r}{more} not used by the model"
            )
