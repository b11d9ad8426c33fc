"""Shared by the benchmark scripts: machine header, medians, tables."""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch

from ooc.calibrate import median_seconds


def machine_header(title: str) -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"# {title}\n"
        f"# host {platform.node()} | {platform.processor() or platform.machine()} | {os.cpu_count()} cores | "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads) | {device} | "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}"
    )


def median_time(fn: Callable[[], None], reps: int, warmup: int = 3) -> float:
    return median_seconds(fn, reps, warmup=warmup)


def interleaved_medians(fns: dict[str, Callable[[], None]], reps: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds of each function, measured in turns so drifts in machine load hit all alike;
    each turn runs them in a fresh (seeded) random order, so none always follows the same neighbour."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    shuffle = random.Random(0).shuffle
    for _ in range(reps):
        shuffle(order)
        for name, fn in order:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def demo_gpt(device: torch.device):  # noqa: ANN201
    """The demo GPT on the sonnets, seeded, and one 16 x 64 batch: ``(config, model, batch)``."""
    from ooc.apps.demo import CharData, demo_config, load_text
    from ooc.models.gpt import GPT

    torch.manual_seed(0)
    data = CharData.from_text(load_text())
    cfg = demo_config(data)
    return cfg, GPT(cfg).to(device), data.batch(16, 64, torch.Generator().manual_seed(0), device)
