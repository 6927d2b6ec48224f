"""Traces as long-format pandas DataFrames (one per record type) and as parquet or JSON files.

Frames, keyed by `step` (StepRecord.index) and `layer`:
    tokens      one row per token position: phase, position, input and chosen token, timing, switch state
    candidates  one row per (step, rank): the top next-token candidates and their probabilities
    routing     one row per (step, layer, rank): the selected experts by score, the path that ran
    router      one row per (step, layer, expert): router logit and probability over all experts
    layers      one row per (step, layer): shared gate, residual and output norms, path, reason and note,
                the attention's path and reason, the token mixing's kind ('' for a family with one kind)
    mixer       one row per (step, layer, head) of a hybrid's token mixing: its kind, decay, beta and state
                norm (linear layers; NaN elsewhere, the state norm also before a call's last position) and
                the output gate's mean over the head; no rows for other families
    vectors     one row per (step, layer, name[, rank]): the recorded vectors (hook names), as lists (the
                output gate [H, Dh] flattened row by row)
Any other frames (comparisons, statistics) can be saved beside them with save_frames.

save_frames makes the folder it is given (with its parents) and writes only regular files there; read_frames
reads only regular files (a FIFO would block the read). A path that cannot be used (a NUL byte, a file where a
folder belongs or the reverse, a corrupt file) is a MoebenchError naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import MoebenchError
from ..models import hooks
from .record import LayerRecord, Trace

FORMATS = ("parquet", "json")
VECTOR_HOOKS = (hooks.EXPERT_OUT, hooks.ROUTED_OUT, hooks.SHARED_OUT, hooks.BLOCK_OUT,
                hooks.RESID_PRE, hooks.RESID_MID, hooks.RESID_POST)
MIXER_COLUMNS = ("step", "layer", hooks.MIXER_KIND, "head", hooks.DECAY, hooks.BETA, hooks.STATE_NORM,
                 hooks.OUTPUT_GATE)


def _path(value: object, what: str) -> Path:
    """`value` as a Path, once it is one (str or os.PathLike) the operating system can take."""
    if not isinstance(value, (str, os.PathLike)):
        raise MoebenchError(f"{what} must be a path (str or Path), got {type(value).__name__}")
    path = Path(value)
    if "\0" in str(path):
        raise MoebenchError(f"{what} {str(path)!r}: a path cannot hold a NUL byte")
    return path


def _regular_or_absent(path: Path) -> bool:
    """Whether a regular file (or a link to one) is at `path`; False when nothing is. Anything else (a folder, a
    FIFO that would block, a link that dangles) is a MoebenchError naming it."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            raise MoebenchError(f"{path}: a link to {os.readlink(path)}, which does not exist") from None
        return False
    except OSError as e:
        raise MoebenchError(f"{path}: cannot use it: {e}") from e
    if not stat.S_ISREG(mode):
        raise MoebenchError(f"{path}: not a regular file")
    return True


def _norm(v: np.ndarray | None) -> float:
    return float(np.linalg.norm(v)) if v is not None else float("nan")


def to_frames(trace: Trace, vectors: bool = True) -> dict[str, pd.DataFrame]:
    """Every record type of a trace as a long-format DataFrame (see the module docstring)."""
    if not isinstance(trace, Trace):
        raise MoebenchError(f"to_frames takes a Trace (Stepper.trace, decode(..., record=True)), got "
                            f"{type(trace).__name__}")
    rows: dict[str, list[dict]] = {k: [] for k in ("tokens", "candidates", "routing", "router", "layers", "mixer",
                                                   "vectors")}
    for s in trace.steps:
        rows["tokens"].append({
            "step": s.index, "phase": s.phase, "position": s.position, "input_id": s.input_id,
            "input_text": s.input_text, "token_id": s.token_id, "token_text": s.token_text, "seconds": s.seconds,
            "fused_switch": s.fused_switch,
            "interventions": json.dumps({str(i): dataclasses.asdict(v) for i, v in s.interventions.items()}),
        })
        for rank, c in enumerate(s.candidates):
            rows["candidates"].append({"step": s.index, "rank": rank, "token_id": c.token_id, "text": c.text,
                                       "prob": c.prob})
        for layer, r in s.layers.items():
            key = {"step": s.index, "layer": layer}
            path = {"path": r.path.path, "fused": r.path.fused, "reason": r.path.reason,
                    "note": r.path.note or ""}  # "" (not None): an all-None column reads back from JSON as NaN
            attention = {"attn_path": r.attn_path.path if r.attn_path else "",
                         "attn_reason": (r.attn_path.reason or "") if r.attn_path else ""}
            for rank, (e, score) in enumerate(zip(r.topk_ids, r.topk_scores, strict=True)):
                rows["routing"].append({**key, "rank": rank, "expert": int(e), "score": float(score), **path})
            for e, (logit, prob) in enumerate(zip(r.router_logits, r.router_probs, strict=True)):
                rows["router"].append({**key, "expert": e, "logit": float(logit), "prob": float(prob)})
            rows["layers"].append({
                **key, **path, **attention, "top_k": len(r.topk_ids), "shared_gate": r.shared_gate,
                **{f"{h}_norm": _norm(getattr(r, h)) for h in VECTOR_HOOKS if h != hooks.EXPERT_OUT},
                hooks.MIXER_KIND: r.mixer_kind or "",
            })
            rows["mixer"].extend(_mixer_rows(key, r))
            if vectors:
                for rank, e in enumerate(r.topk_ids):
                    rows["vectors"].append({**key, "name": hooks.EXPERT_OUT, "rank": rank, "expert": int(e),
                                            "values": r.expert_out[rank].tolist()})
                for h in (*VECTOR_HOOKS[1:], hooks.OUTPUT_GATE):
                    v = getattr(r, h)
                    if v is not None:
                        rows["vectors"].append({**key, "name": h, "rank": None, "expert": None,
                                                "values": v.reshape(-1).tolist()})
    frames = {k: pd.DataFrame(v, columns=MIXER_COLUMNS if k == "mixer" else None) for k, v in rows.items()
              if k != "vectors" or vectors}
    for name in ("tokens", "vectors"):
        if name in frames and not frames[name].empty:
            ints = ["token_id"] if name == "tokens" else ["rank", "expert"]
            frames[name] = frames[name].astype({c: "Int64" for c in ints})
    return frames


def _mixer_rows(key: dict, r: LayerRecord) -> list[dict]:
    """One row per head of a layer record's token-mixing values (none when it has none)."""
    per_head = {hooks.DECAY: r.decay, hooks.BETA: r.beta, hooks.STATE_NORM: r.state_norm,
                hooks.OUTPUT_GATE: r.output_gate_means}
    heads = max((len(v) for v in per_head.values() if v is not None), default=0)
    return [{**key, hooks.MIXER_KIND: r.mixer_kind or "", "head": head,
             **{h: float("nan") if v is None else float(v[head]) for h, v in per_head.items()}}
            for head in range(heads)]


def save_frames(frames: dict[str, pd.DataFrame], folder: str | Path, fmt: str = "parquet") -> list[Path]:
    """Write each frame to `folder/{name}.parquet` or `.json` (records orientation); returns the paths. The folder
    is made when missing (with its parents); every name must be a plain file name and every frame a DataFrame,
    all checked before anything is written."""
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise MoebenchError(f"export format must be one of {FORMATS}, got {fmt!r}")
    folder = _path(folder, "export folder")
    if not isinstance(frames, Mapping):
        raise MoebenchError(f"frames must be a mapping of name to DataFrame (to_frames' result), got "
                            f"{type(frames).__name__}")
    for name, frame in frames.items():
        if not isinstance(name, str) or not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0"):
            raise MoebenchError(f"frame name {name!r}: must be a plain file name")
        if not isinstance(frame, pd.DataFrame):
            raise MoebenchError(f"frame {name!r}: expected a pandas DataFrame, got {type(frame).__name__}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission, a read-only disk
        raise MoebenchError(f"{folder}: cannot make the export folder: {e}") from e
    paths = []
    for name, frame in frames.items():
        path = folder / f"{name}.{fmt}"
        _regular_or_absent(path)  # never write into a FIFO (the write would block) or onto a folder
        try:
            if fmt == "parquet":
                frame.to_parquet(path, index=False)
            else:
                frame.to_json(path, orient="records", indent=1)
        except (OSError, ValueError, TypeError) as e:  # a full disk; columns parquet cannot store
            raise MoebenchError(f"{path}: cannot write the {name} frame: {e}") from e
        paths.append(path)
    return paths


def save_trace(trace: Trace, folder: str | Path, fmt: str = "parquet", vectors: bool = True) -> list[Path]:
    """to_frames + save_frames."""
    return save_frames(to_frames(trace, vectors), folder, fmt)


def read_frames(folder: str | Path) -> dict[str, pd.DataFrame]:
    """Read back every .parquet / .json frame in a folder, keyed by file stem. Each must be a regular file (checked
    before it is opened: a FIFO would block) that its reader can parse; else a MoebenchError naming it."""
    folder = _path(folder, "frames folder")
    if not folder.is_dir():
        raise MoebenchError(f"{folder}: not a folder of exported frames")
    frames = {}
    for path in sorted(folder.iterdir()):
        if path.suffix not in (".parquet", ".json"):
            continue
        _regular_or_absent(path)
        try:
            if path.suffix == ".parquet":
                frames[path.stem] = pd.read_parquet(path)
            else:
                frames[path.stem] = pd.read_json(path, orient="records")
        except Exception as e:  # noqa: BLE001 -- pyarrow and pandas raise many kinds for a corrupt file
            raise MoebenchError(f"{path}: cannot read it as an exported {path.suffix[1:]} frame: "
                                f"{type(e).__name__}: {e}") from e
    return frames
