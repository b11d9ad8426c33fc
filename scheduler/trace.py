"""A simulated step as a Chrome / Perfetto trace (``chrome://tracing``, ui.perfetto.dev)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ooc.scheduler.simulate import SimResult

_TIDS = {"compute": 1, "d2h": 2, "h2d": 3, "net": 4, "host": 5}


def chrome_trace(result: SimResult, *, name: str = "ooc step") -> dict[str, Any]:
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": name}},
        *({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": res}} for res, tid in _TIDS.items()),
    ]
    for iv in result.timeline:
        events.append({
            "ph": "X", "pid": 1, "tid": _TIDS[iv.resource.value], "name": iv.label,
            "ts": iv.start * 1e6, "dur": (iv.end - iv.start) * 1e6, "cat": iv.label.split("/")[0],
        })
    for when, nbytes in result.memory:
        events.append({"ph": "C", "pid": 1, "name": "device bytes", "ts": when * 1e6, "args": {"saved activations": nbytes}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(result: SimResult, path: str | Path, *, name: str = "ooc step") -> None:
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(chrome_trace(result, name=name)))
    tmp.replace(path)
