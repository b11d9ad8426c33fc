"""NVTX ranges for Nsight Systems, through the ``nvtx`` package (``torch.cuda.nvtx`` raises on CPU
builds). Ranges can also be recorded in-process, which is how the tests check names and nesting.

Ranges are start/end pairs rather than push/pop, because a block's backward range opens in one
autograd hook and closes in another.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

try:  # the package is a dependency, but a missing one must never break training
    import nvtx as _nvtx
except ImportError:  # pragma: no cover
    _nvtx = None

_DOMAIN = "ooc"
_lock = threading.Lock()
_recorders: list["RangeRecorder"] = []
_ids = itertools.count()


@dataclass
class RecordedRange:
    name: str
    start: int
    end: int | None = None
    parent: str | None = None


@dataclass
class RangeRecorder:
    """Ranges seen while recording, in start order; ``parent`` is the innermost range still open."""

    ranges: list[RecordedRange] = field(default_factory=list)
    _open: list[RecordedRange] = field(default_factory=list)

    def names(self) -> list[str]:
        return [r.name for r in self.ranges]


class Range:
    __slots__ = ("name", "_handle", "_records")

    def __init__(self, name: str) -> None:
        self.name = name
        self._handle = _nvtx.start_range(message=name, domain=_DOMAIN) if _nvtx is not None else None
        self._records: list[tuple[RangeRecorder, RecordedRange]] = []
        if _recorders:
            stamp = next(_ids)
            with _lock:
                for recorder in _recorders:
                    parent = recorder._open[-1].name if recorder._open else None
                    record = RecordedRange(name, stamp, parent=parent)
                    recorder.ranges.append(record)
                    recorder._open.append(record)
                    self._records.append((recorder, record))

    def end(self) -> None:
        if self._handle is not None:
            _nvtx.end_range(self._handle)
            self._handle = None
        if self._records:
            stamp = next(_ids)
            with _lock:
                for recorder, record in self._records:
                    record.end = stamp
                    if record in recorder._open:
                        recorder._open.remove(record)
            self._records = []


def start(name: str) -> Range:
    return Range(name)


@contextlib.contextmanager
def range(name: str) -> Iterator[None]:  # noqa: A001 - mirrors nvtx.annotate / torch.cuda.nvtx.range
    r = Range(name)
    try:
        yield
    finally:
        r.end()


@contextlib.contextmanager
def record() -> Iterator[RangeRecorder]:
    """Record every ooc range opened in this block: ``with ooc.nvtx.record() as r: step()``."""
    recorder = RangeRecorder()
    with _lock:
        _recorders.append(recorder)
    try:
        yield recorder
    finally:
        with _lock:
            _recorders.remove(recorder)
