"""argparse types for the command's numeric flags. A value out of range is argparse's usage error (exit 2, one
line naming the flag) before anything runs, checked by the same function the Python API calls, so both refuse
alike: `--seed -1`, `--hidden 0`, `--steps -1`, `--balance-coef nan`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from ..decode.sampling import check_seed
from ..errors import ConfigError, MoebenchError


def whole_number(value: object, name: str, minimum: int = 1) -> int:
    """`value` when it is an integer (not a bool) >= `minimum`; anything else is a ConfigError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def finite_number(value: object, name: str, minimum: float | None = None) -> float:
    """`value` when it is a finite number (not a bool), above `minimum` when given; else a ConfigError naming
    `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            minimum is not None and not value > minimum):
        above = "" if minimum is None else f" above {minimum:g}"
        raise ConfigError(f"{name} must be a finite number{above}, got {value!r}")
    return value


def flag(check: Callable[[Any], Any], parse: type = int) -> Callable[[str], Any]:
    """An argparse `type`: the text parsed as `parse` (int or float), then `check`ed; either failing is argparse's
    error for the flag (exit 2), with the check's own words."""
    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if parse is int else 'a number'}, got "
                                             f"{text!r}") from None
        try:
            return check(value)
        except MoebenchError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__  # argparse names the type in its own messages
    return convert


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer flag >= minimum."""
    return flag(lambda value: whole_number(value, "the value", minimum))


def finite(minimum: float | None = None) -> Callable[[str], float]:
    """A finite number flag (NaN and Inf refused), above `minimum` when given."""
    return flag(lambda value: finite_number(value, "the value", minimum), float)


SEED = flag(check_seed)  # --seed: 0 to 2**64 - 1, what MLX's and numpy's generators take
