"""Quantities written for a person to read: bytes in the unit that suits their size (8.8 MB, not 0.008812 GB)."""

from __future__ import annotations

UNITS = ("B", "KB", "MB", "GB", "TB")  # decimal, as MLX's memory counters and model cards count


def byte_size(n: int | float) -> str:
    """`n` bytes in the largest unit it reaches, one decimal below 100 of it: 8812000 -> '8.8 MB', 123.4e6 ->
    '123 MB'."""
    if n < 0:
        raise ValueError(f"byte_size: a size cannot be negative, got {n}")
    if n < 1000:
        return f"{int(n)} B"
    value, unit = float(n), UNITS[0]
    for unit in UNITS[1:]:
        value /= 1000
        if round(value) < 1000 or unit == UNITS[-1]:  # 999.6 KB reads 1.0 MB, not 1000 KB
            break
    return f"{value:.1f} {unit}" if round(value, 1) < 100 else f"{value:.0f} {unit}"
