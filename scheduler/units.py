"""Byte sizes as people write them ("20GiB", "512 MB") and back."""

from __future__ import annotations

import math
import re
from numbers import Integral, Real

from ooc.scheduler import checks
from ooc.scheduler.errors import SizeError

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
_EXAMPLES = "write e.g. 20GiB, 512MiB, 1.5GB or 1048576"


def parse_bytes(value: int | float | str, *, what: str = "a budget or byte size") -> int:
    """Return a byte count from a number or a string such as ``"20GiB"`` or ``"1.5 GB"``.

    Raises :class:`SizeError` (a ``ValueError``) naming ``what`` for a negative, infinite or NaN
    size, a bool (``True`` would read as one byte), a size between 0 and 1 byte (a fraction such as
    ``0.5``, which would read as 0 bytes) or a string without a unit that is no whole number (``"1.5"``)."""
    if isinstance(value, bool):
        raise SizeError(f"{what} must be a number or a string like '20GiB', not a bool")
    if isinstance(value, Integral):
        if value < 0:
            raise SizeError(f"{what} must be a number of bytes >= 0, got {value!r}; {_EXAMPLES}")
        return int(value)
    if isinstance(value, Real):
        number, unit = float(value), None  # a float computed in code (0.5 * some bytes) rounds down
    else:
        match = _SIZE.match(str(value))
        if match is None or match.group(2).lower() not in _UNITS:
            raise SizeError(f"cannot read {value!r} as {what}; {_EXAMPLES}")
        unit = match.group(2).lower()
        number = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(number) or number < 0:
        raise SizeError(f"{what} must be a finite number of bytes >= 0, got {value!r}; {_EXAMPLES}")
    if 0 < number < 1:  # "0.5" meant as half of something read as 0 bytes: a budget nothing fits, or none at all
        raise SizeError(f"{what} is a number of bytes, not a fraction: {value!r} is less than one byte; {_EXAMPLES}")
    if unit in ("", "b") and not number.is_integer():
        # "1.5" (--budget 1.5) read as 1 byte: a budget nothing fits, refused only at the first backward.
        # With a unit ("1.5GB", "0.3KiB"), or a float computed in code, a part of a byte rounds down.
        raise SizeError(f"{what} without a unit must be a whole number of bytes, got {value!r} (a unit was meant?); "
                        f"{_EXAMPLES}")
    return int(number)


def check_budget(budget: float | None) -> None:
    """Raise :class:`SizeError` unless ``budget`` is None (no limit) or a finite number of bytes >= 0
    (a planner's budget: NaN would make every comparison false, infinity every plan fit)."""
    if budget is not None:
        checks.number(budget, "the budget", SizeError, hint="give a number of bytes (None for no limit)")


def format_bytes(count: int | float) -> str:
    """``1536 -> '1.50 KiB'``; binary units, three significant decimals."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
