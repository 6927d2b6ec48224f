"""A model's kernel settings: fused kernels on or off, rows per threadgroup, the expert-width cap.

They belong to a model (moebench.execution.executor.Executor holds them) and are read once per plan,
not per layer and token. Environment variables give the defaults, read when a model is opened:
MOEBENCH_FUSED_MOE (on by default; 1/true/on/yes or 0/false/off/no), MOEBENCH_FUSED_MOE_ROWS
(1..32, default 8) and MOEBENCH_FUSED_MOE_MAX_DFF (the expert-width cap; default per backend). A value
they do not understand is an error naming the variable, never a silent default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ConfigError
from .moe import DEFAULT_ROWS, MAX_ROWS

ENV_SWITCH = "MOEBENCH_FUSED_MOE"
ENV_ROWS = "MOEBENCH_FUSED_MOE_ROWS"
ENV_MAX_DFF = "MOEBENCH_FUSED_MOE_MAX_DFF"
ON_WORDS = ("1", "true", "on", "yes")
OFF_WORDS = ("0", "false", "off", "no")


def parse_switch(value: object, what: str) -> bool:
    """True / False from a bool (numpy's too) or one of ON_WORDS / OFF_WORDS; anything else is a ConfigError."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ON_WORDS + OFF_WORDS:
        return value.strip().lower() in ON_WORDS
    raise ConfigError(f"{what}: expected True or False (or one of {ON_WORDS + OFF_WORDS}), got {value!r}")


def _env_int(name: str, low: int, high: int | None) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise ConfigError(f"{name}={raw!r}: expected an integer {bound}")
    return value


@dataclass(frozen=True)
class KernelSettings:
    """fused: run the fused decode kernels where they can; rows: output rows per threadgroup of the MoE
    kernels; max_dff: the expert-width cap above which the GPU MoE kernels decline (None: the backend's);
    attention_kernel: False keeps the token-mixing kernels (decode attention, gated delta) off while the MoE
    kernels run (to see what each part of the fused path is worth)."""

    fused: bool = True
    rows: int = DEFAULT_ROWS
    max_dff: int | None = None
    attention_kernel: bool = True

    def __post_init__(self) -> None:
        parse_switch(self.fused, "KernelSettings.fused")
        parse_switch(self.attention_kernel, "KernelSettings.attention_kernel")
        if isinstance(self.rows, bool) or not isinstance(self.rows, int) or not 1 <= self.rows <= MAX_ROWS:
            raise ConfigError(f"KernelSettings.rows: expected an integer from 1 to {MAX_ROWS}, got {self.rows!r}")
        if self.max_dff is not None and (isinstance(self.max_dff, bool) or not isinstance(self.max_dff, int)
                                         or self.max_dff < 1):
            raise ConfigError(f"KernelSettings.max_dff: expected a positive integer or None, got {self.max_dff!r}")

    @classmethod
    def from_env(cls) -> KernelSettings:
        """The defaults the environment gives (see the module docstring)."""
        raw = os.environ.get(ENV_SWITCH)
        fused = True if raw is None or not raw.strip() else parse_switch(raw, ENV_SWITCH)
        rows = _env_int(ENV_ROWS, 1, MAX_ROWS)
        return cls(fused, DEFAULT_ROWS if rows is None else rows, _env_int(ENV_MAX_DFF, 1, None))
