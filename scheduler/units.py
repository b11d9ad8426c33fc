"""Byte sizes as people write them ("20GiB", "512 MB") and back."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Return a byte count from an int or a string such as ``"20GiB"`` or ``"1.5 GB"``."""
    if isinstance(value, bool):
        raise TypeError("a byte size must be a number or a string like '20GiB', not a bool")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a byte size must be >= 0, got {value}")
        return int(value)
    match = _SIZE.match(str(value))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {value!r} as a byte size; write e.g. 20GiB, 512MiB, 1.5GB or 1048576"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(count: int | float) -> str:
    """``1536 -> '1.50 KiB'``; binary units, three significant decimals."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
