"""Routings as files: what experts a model chose, per token and MoE layer, in the layouts engines export.

A Routing holds `ids` [tokens, layers, top_k] (highest score first), and where the source had them the fed
`tokens`, each token's sequence (`seq`), the top-k `scores` and the router's probabilities over all experts
(`probs`). Formats written and read back:

    moebench   parquet, one row per (token, layer): seq, pos, token, ids, scores, probs (lists), and the layer
               numbers in the file's metadata: everything a Routing holds but the logits
    sglang     SGLang's `routed_experts`: int32 [tokens, layers, top_k] as a .npy file
    sglang-raw the same int32 values as bare bytes (their shape is not in the file: read_routing needs
               layers and top_k)
    sglang-b64 those bytes in base64 text, as SGLang's meta_info carries them (layers and top_k needed too)
    vllm       ids only, as JSON nested lists [tokens][layers][top_k] (a bare list, or an object whose
               "routed_experts" holds it)

read_routing detects the format from the file's content; a file it cannot read is a MoebenchError naming it.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import MoebenchError

FORMATS = ("moebench", "sglang", "sglang-raw", "sglang-b64", "vllm")
SCHEMA = "moebench.routing/1"
_BASE64 = re.compile(rb"^[A-Za-z0-9+/\s]*={0,2}\s*$")


@dataclass
class Routing:
    """One variant's routing over concatenated token sequences (see the module docstring).

    layers: the MoE layer numbers of the layer axis. logits: next-token logits [tokens, vocab] where a model
    produced the routing (never written to a file). choice: what a selection-biased router chose by [tokens, layers,
    experts] (the probabilities plus its bias, -inf outside the groups kept; hooks' choice_scores), where a model
    with one produced the routing (never written either). source: where it came from, for messages and reprs.
    """

    ids: np.ndarray
    layers: tuple[int, ...]
    tokens: np.ndarray | None = None
    seq: np.ndarray | None = None
    scores: np.ndarray | None = None
    probs: np.ndarray | None = None
    logits: np.ndarray | None = None
    source: str = ""
    choice: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int32)
        if self.ids.ndim != 3:
            raise MoebenchError(f"{self.source or 'routing'}: ids must be [tokens, layers, top_k], got shape "
                                f"{list(self.ids.shape)}")
        t, n_layers, k = self.ids.shape
        self.layers = tuple(int(i) for i in self.layers)
        if len(self.layers) != n_layers:
            raise MoebenchError(f"{self.source or 'routing'}: {len(self.layers)} layer numbers for {n_layers} layers")
        for name, shape in (("tokens", (t,)), ("seq", (t,)), ("scores", (t, n_layers, k)),
                            ("probs", (t, n_layers, None)), ("logits", (t, None)), ("choice", (t, n_layers, None))):
            value = getattr(self, name)
            if value is None:
                continue
            value = np.asarray(value, dtype=np.int64 if name in ("tokens", "seq") else np.float32)
            if value.ndim != len(shape) or any(s is not None and s != v for s, v in zip(shape, value.shape,
                                                                                         strict=True)):
                raise MoebenchError(f"{self.source or 'routing'}: {name} has shape {list(value.shape)}, expected "
                                    f"{[s if s is not None else '*' for s in shape]}")
            setattr(self, name, value)

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    def bias_made(self) -> np.ndarray | None:
        """[tokens, layers, top_k]: which chosen experts a selection bias alone put in (not among the top-k of the
        unbiased probabilities within the same groups); None without the choice and probabilities."""
        if self.choice is None or self.probs is None:
            return None
        top = unbiased_top(self.probs, self.choice, self.top_k)
        return ~(self.ids[..., :, None] == top[..., None, :]).any(-1)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __repr__(self) -> str:
        """A summary: shape and what the routing carries; the arrays stay in the fields."""
        have = [n for n in ("tokens", "scores", "probs", "logits") if getattr(self, n) is not None]
        seqs = 1 if self.seq is None else len(np.unique(self.seq))
        return (f"Routing from {self.source or 'memory'}: {len(self)} tokens in {seqs} sequence(s), MoE layers "
                f"{list(self.layers)}, top-{self.top_k}; carries ids{''.join(', ' + n for n in have)}")


def unbiased_top(probs: np.ndarray, choice: np.ndarray, k: int) -> np.ndarray:
    """[..., k]: the experts a selection-biased router would choose without its bias, highest first: the top-k of
    the probabilities `probs` [..., E] within the groups its choice `choice` [..., E] kept (finite there)."""
    return np.argsort(-np.where(np.isfinite(choice), probs, -np.inf), axis=-1, kind="stable")[..., :k]


def write_routing(routing: Routing, path: str | Path, fmt: str = "moebench") -> Path:
    """Write `routing` in format `fmt` (FORMATS); formats that keep ids only drop the rest."""
    if fmt not in FORMATS:
        raise MoebenchError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = np.ascontiguousarray(routing.ids, dtype="<i4")
    if fmt == "moebench":
        pq.write_table(_table(routing), path)
    elif fmt == "sglang":
        with path.open("wb") as f:
            np.save(f, ids)
    elif fmt == "sglang-raw":
        path.write_bytes(ids.tobytes())
    elif fmt == "sglang-b64":
        path.write_bytes(base64.b64encode(ids.tobytes()))
    else:
        path.write_text(json.dumps({"routed_experts": ids.tolist()}))
    return path


def _table(r: Routing) -> pa.Table:
    t, n_layers, _ = r.ids.shape
    pos = np.arange(t)
    seq = r.seq if r.seq is not None else np.zeros(t, np.int64)
    columns = {
        "seq": pa.array(np.repeat(seq, n_layers), pa.int64()),
        "pos": pa.array(np.repeat(pos, n_layers), pa.int64()),
        "layer": pa.array(np.tile(np.array(r.layers, np.int64), t), pa.int64()),
        "ids": _lists(r.ids.reshape(t * n_layers, -1), pa.int32()),
    }
    if r.tokens is not None:
        columns["token"] = pa.array(np.repeat(r.tokens, n_layers), pa.int64())
    for name in ("scores", "probs"):
        value = getattr(r, name)
        if value is not None:
            columns[name] = _lists(value.reshape(t * n_layers, -1), pa.float32())
    meta = {"schema": SCHEMA, "layers": list(r.layers), "source": r.source, "has_seq": r.seq is not None}
    return pa.table(columns).replace_schema_metadata({"moebench": json.dumps(meta)})


def _lists(rows: np.ndarray, kind: pa.DataType) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1), kind), rows.shape[1])


def read_routing(path: str | Path, layers: int | None = None, top_k: int | None = None) -> Routing:
    """Any FORMATS file back as a Routing; `layers` and `top_k` give the shape of a bare-bytes or base64 file."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise MoebenchError(f"{path}: cannot read the routing file: {e}") from e
    if not blob:
        raise MoebenchError(f"{path}: the routing file is empty")
    if blob[:4] == b"PAR1":
        return _from_table(path, blob)
    if blob[:6] == b"\x93NUMPY":
        return _from_npy(path, blob)
    if blob.lstrip()[:1] in (b"[", b"{"):
        return _from_json(path, blob)
    if _BASE64.match(blob):
        try:
            raw = base64.b64decode(b"".join(blob.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            raise MoebenchError(f"{path}: looks like base64 text but does not decode: {e}") from e
        return _from_bytes(path, raw, layers, top_k, "sglang-b64")
    return _from_bytes(path, blob, layers, top_k, "sglang-raw")


def _ids(path: Path, ids: np.ndarray, what: str) -> Routing:
    if ids.ndim != 3 or 0 in ids.shape:
        raise MoebenchError(f"{path}: {what} must hold [tokens, layers, top_k] expert ids, got shape "
                            f"{list(ids.shape)}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise MoebenchError(f"{path}: {what} holds {ids.dtype} values, expected integer expert ids")
    if ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:
        raise MoebenchError(f"{path}: {what} holds expert id {int(ids.min() if ids.min() < 0 else ids.max())}")
    return Routing(ids.astype(np.int32), tuple(range(ids.shape[1])), source=f"{path} ({what})")


def _from_npy(path: Path, blob: bytes) -> Routing:
    try:
        ids = np.load(io.BytesIO(blob), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise MoebenchError(f"{path}: a corrupt .npy routing file: {e}") from e
    return _ids(path, ids, "sglang")


def _from_bytes(path: Path, raw: bytes, layers: int | None, top_k: int | None, what: str) -> Routing:
    if layers is None or top_k is None:
        raise MoebenchError(f"{path}: {what} routing bytes carry no shape: give layers and top_k (the model's MoE "
                            "layer count and experts per token)")
    if layers < 1 or top_k < 1:
        raise MoebenchError(f"{path}: layers and top_k must be >= 1, got {layers} and {top_k}")
    row = 4 * layers * top_k
    if len(raw) % row:
        raise MoebenchError(f"{path}: {len(raw)} bytes is not a whole number of tokens of {layers} layers x top-"
                            f"{top_k} int32 ids ({row} bytes a token)")
    return _ids(path, np.frombuffer(raw, "<i4").reshape(-1, layers, top_k), what)


def _from_json(path: Path, blob: bytes) -> Routing:
    try:
        data = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MoebenchError(f"{path}: not valid JSON: {e}") from e
    if isinstance(data, dict):
        if "routed_experts" not in data:
            raise MoebenchError(f"{path}: a JSON object without the field 'routed_experts'")
        data = data["routed_experts"]
    try:
        ids = np.array(data)
    except ValueError as e:
        raise MoebenchError(f"{path}: 'routed_experts' is not a [tokens][layers][top_k] list: {e}") from e
    return _ids(path, ids, "vllm")


def _from_table(path: Path, blob: bytes) -> Routing:
    try:
        table = pq.read_table(pa.BufferReader(blob))
        meta = json.loads((table.schema.metadata or {}).get(b"moebench", b"{}"))
    except (pa.ArrowException, OSError, json.JSONDecodeError) as e:
        raise MoebenchError(f"{path}: a corrupt parquet routing file: {e}") from e
    if meta.get("schema") != SCHEMA:
        raise MoebenchError(f"{path}: a parquet file without moebench routing metadata (schema {SCHEMA})")
    missing = {"seq", "pos", "layer", "ids"} - set(table.column_names)
    if missing:
        raise MoebenchError(f"{path}: the routing table lacks the column(s) {sorted(missing)}")
    layers = tuple(meta["layers"])
    n_layers = len(layers)
    if n_layers == 0 or table.num_rows % n_layers:
        raise MoebenchError(f"{path}: {table.num_rows} rows are not whole tokens of {n_layers} layers")
    t = table.num_rows // n_layers

    def lists(name: str, dtype) -> np.ndarray | None:
        if name not in table.column_names:
            return None
        column = table.column(name).combine_chunks()
        return column.flatten().to_numpy(zero_copy_only=False).astype(dtype).reshape(t, n_layers, -1)

    def per_token(name: str) -> np.ndarray | None:
        if name not in table.column_names:
            return None
        return table.column(name).to_numpy()[::n_layers].astype(np.int64)

    try:
        return Routing(lists("ids", np.int32), layers, tokens=per_token("token"),
                       seq=per_token("seq") if meta.get("has_seq") else None, scores=lists("scores", np.float32),
                       probs=lists("probs", np.float32), source=meta.get("source") or f"{path} (moebench)")
    except MoebenchError as e:
        raise MoebenchError(f"{path}: {e}") from e
