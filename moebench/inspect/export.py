"""Traces as long-format pandas DataFrames (one per record type) and as parquet or JSON files.

Frames, keyed by `step` (StepRecord.index) and `layer`:
    tokens      one row per token position: phase, position, input and chosen token, timing, switch state
    candidates  one row per (step, rank): the top next-token candidates and their probabilities
    routing     one row per (step, layer, rank): the selected experts by score, the path that ran
    router      one row per (step, layer, expert): router logit and probability over all experts
    layers      one row per (step, layer): shared gate, residual and output norms, path, reason and note,
                the attention's path and reason
    vectors     one row per (step, layer, name[, rank]): the recorded vectors (hook names), as lists
Any other frames (comparisons, statistics) can be saved beside them with save_frames.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import MoebenchError
from ..models import hooks
from .record import Trace

FORMATS = ("parquet", "json")
VECTOR_HOOKS = (hooks.EXPERT_OUT, hooks.ROUTED_OUT, hooks.SHARED_OUT, hooks.BLOCK_OUT,
                hooks.RESID_PRE, hooks.RESID_MID, hooks.RESID_POST)


def _norm(v: np.ndarray | None) -> float:
    return float(np.linalg.norm(v)) if v is not None else float("nan")


def to_frames(trace: Trace, vectors: bool = True) -> dict[str, pd.DataFrame]:
    """Every record type of a trace as a long-format DataFrame (see the module docstring)."""
    rows: dict[str, list[dict]] = {k: [] for k in ("tokens", "candidates", "routing", "router", "layers", "vectors")}
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
            })
            if vectors:
                for rank, e in enumerate(r.topk_ids):
                    rows["vectors"].append({**key, "name": hooks.EXPERT_OUT, "rank": rank, "expert": int(e),
                                            "values": r.expert_out[rank].tolist()})
                for h in VECTOR_HOOKS[1:]:
                    v = getattr(r, h)
                    if v is not None:
                        rows["vectors"].append({**key, "name": h, "rank": None, "expert": None, "values": v.tolist()})
    frames = {k: pd.DataFrame(v) for k, v in rows.items() if k != "vectors" or vectors}
    for name in ("tokens", "vectors"):
        if name in frames and not frames[name].empty:
            ints = ["token_id"] if name == "tokens" else ["rank", "expert"]
            frames[name] = frames[name].astype({c: "Int64" for c in ints})
    return frames


def save_frames(frames: dict[str, pd.DataFrame], folder: str | Path, fmt: str = "parquet") -> list[Path]:
    """Write each frame to `folder/{name}.parquet` or `.json` (records orientation); returns the paths."""
    if fmt not in FORMATS:
        raise MoebenchError(f"export format must be one of {FORMATS}, got {fmt!r}")
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission, a read-only disk
        raise MoebenchError(f"{folder}: cannot make the export folder: {e}") from e
    paths = []
    for name, frame in frames.items():
        path = folder / f"{name}.{fmt}"
        try:
            if fmt == "parquet":
                frame.to_parquet(path, index=False)
            else:
                frame.to_json(path, orient="records", indent=1)
        except OSError as e:
            raise MoebenchError(f"{path}: cannot write the {name} frame: {e}") from e
        paths.append(path)
    return paths


def save_trace(trace: Trace, folder: str | Path, fmt: str = "parquet", vectors: bool = True) -> list[Path]:
    """to_frames + save_frames."""
    return save_frames(to_frames(trace, vectors), folder, fmt)


def read_frames(folder: str | Path) -> dict[str, pd.DataFrame]:
    """Read back every .parquet / .json frame in a folder, keyed by file stem."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MoebenchError(f"{folder}: not a folder of exported frames")
    frames = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".parquet":
            frames[path.stem] = pd.read_parquet(path)
        elif path.suffix == ".json":
            frames[path.stem] = pd.read_json(path, orient="records")
    return frames
