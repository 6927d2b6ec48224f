"""Run one command as N processes of this machine joined by MLX's ring backend (mx.distributed over 127.0.0.1).

mlx.launch does the same, but its launcher polls its children's pipes without blocking and keeps one of this
2-core machine's cores busy (measured: mlx.launch at 125% CPU; each of two training ranks then ran at half
speed). Here the processes inherit this terminal, so the parent only waits. The environment is what
mlx.launch's ring backend gives each rank: MLX_RANK and MLX_HOSTFILE, a JSON list of one address per rank.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import MoebenchError


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n consecutive ports that were free a moment ago (the ring backend listens on one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            first = s.getsockname()[1]
        if first + n > 65535:
            continue
        try:
            for port in range(first, first + n):
                with socket.socket() as s:
                    s.bind((host, port))
            return list(range(first, first + n))
        except OSError:
            continue
    raise MoebenchError(f"no {n} consecutive free ports on {host}")


def is_rank() -> bool:
    """True inside a process that mlx.launch or run_local_group started."""
    return "MLX_RANK" in os.environ


def run_local_group(argv: Sequence[str], n: int, env: Mapping[str, str]) -> int:
    """Start `argv` n times as ranks 0..n-1 and wait for all; the first failure stops the others."""
    if n < 2:
        raise MoebenchError(f"processes: need at least 2 for a group, got {n}")
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
        procs = [subprocess.Popen(list(argv), env={**env, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)})
                 for r in range(n)]
        codes: dict[int, int] = {}
        try:
            while len(codes) < n:
                pid, status = os.wait()
                rank = next((r for r, p in enumerate(procs) if p.pid == pid), None)
                if rank is None:
                    continue
                procs[rank].returncode = codes[rank] = os.waitstatus_to_exitcode(status)
                if codes[rank]:
                    break
        finally:
            for p in procs:
                if p.returncode is None:
                    p.terminate()
                    p.wait()
    failed = {r: c for r, c in codes.items() if c}
    if failed:
        rank, code = next(iter(failed.items()))
        raise MoebenchError(f"rank {rank} of {n} exited with code {code}; the other ranks were stopped")
    return 0
