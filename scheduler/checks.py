"""Checks of the numbers and flags that enter planning from users and JSON files.

A NaN or an infinity in a profile, a hardware description or a budget does not fail loudly
downstream: comparisons with NaN are all false, so the simulator's clock never advances and the
planners loop forever. So every such value is checked where it enters (the constructors of
``Profile``, ``BlockProfile``, ``Hardware``, ``Plan``, ``BlockPlan``, and ``parse_bytes``), and the
error names the field and says what to do.
"""

from __future__ import annotations

import math
from numbers import Integral, Real


def number(value: object, field: str, error: type[Exception], *, where: str = "", hint: str = "", positive: bool = False) -> float:
    """``value`` as a float if it is a finite real number >= 0 (> 0 with ``positive``); else raise
    ``error`` naming ``field`` (prefixed by ``where``) and ending with ``hint``."""
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, bool) or not isinstance(value, Real):
        raise error(f"{where}{field} must be a number {bound}, got {value!r} ({type(value).__name__}){_then(hint)}")
    result = float(value)
    if not math.isfinite(result) or result < 0 or (positive and result == 0):
        raise error(f"{where}{field} must be a finite number {bound}, got {value!r}{_then(hint)}")
    return result


def count(value: object, field: str, error: type[Exception], *, where: str = "", hint: str = "", positive: bool = False) -> int:
    """``value`` as an int if it is an integer >= 0 (> 0 with ``positive``): a byte or item count;
    else raise ``error``."""
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise error(f"{where}{field} must be a whole number {bound}, got {value!r} ({type(value).__name__}){_then(hint)}")
    if value < 0 or (positive and value == 0):
        raise error(f"{where}{field} must be {bound}, got {value!r}{_then(hint)}")
    return int(value)


def flag(value: object, field: str, error: type[Exception], *, where: str = "", hint: str = "") -> bool:
    """``value`` if it is a bool (JSON ``true``/``false``, not the string ``"false"``); else raise ``error``."""
    if not isinstance(value, bool):
        raise error(f"{where}{field} must be true or false, got {value!r} ({type(value).__name__}){_then(hint)}")
    return value


def text(value: object, field: str, error: type[Exception], *, where: str = "", hint: str = "") -> str:
    """``value`` if it is a string; else raise ``error``."""
    if not isinstance(value, str):
        raise error(f"{where}{field} must be a string, got {value!r} ({type(value).__name__}){_then(hint)}")
    return value


_FILES = {
    "ooc.plan": ("plan", "ooc plan --out"),
    "ooc.profile": ("profile", "ooc profile --out"),
    "ooc.hardware": ("hardware description", "ooc calibrate --out"),
}
"""Each ooc JSON file's ``"format"``: what it is and the command that writes one."""


def file_format(data: object, expected: str, error: type[Exception]) -> dict:
    """``data`` if it is a dict whose ``"format"`` is ``expected`` (a key of ``_FILES``); else raise
    ``error`` saying what the JSON is instead: a plan given where a profile goes is named a plan."""
    if isinstance(data, dict) and data.get("format") == expected:
        return data
    noun, command = _FILES[expected]
    found = data.get("format") if isinstance(data, dict) else None
    if found in _FILES:
        what = f"this JSON is an ooc {_FILES[found][0]} (from `{_FILES[found][1]}`)"
    elif found is not None:
        what = f"its \"format\" is {found!r:.40}, not {expected!r}"
    else:
        what = f"the JSON has no \"format\": \"{expected}\" field"
    raise error(f"not an ooc {noun}: {what}; an ooc {noun} comes from `{command}`")


def _then(hint: str) -> str:
    return f"; {hint}" if hint else ""
