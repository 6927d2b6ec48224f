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
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import MoebenchError

HOST = "127.0.0.1"


def free_ports(n: int, host: str = HOST) -> list[int]:
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
        hostfile.write_text(json.dumps([[f"{HOST}:{p}"] for p in free_ports(n)]))
        procs = [subprocess.Popen(list(argv), env={**env, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)})
                 for r in range(n)]
        try:  # a poll a fifth of a second, not os.wait(): that could reap a child this process did not start here
            while True:
                failed = [r for r, p in enumerate(procs) if p.poll()]
                if failed or all(p.returncode is not None for p in procs):
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    p.wait()
    if failed:
        rank = failed[0]
        raise MoebenchError(f"rank {rank} of {n} exited with code {procs[rank].returncode}; the other ranks were "
                            "stopped")
    return 0
