"""``ooc partition``: place a training graph on K devices with every method, print how each does,
and draw the best placement as a Gantt chart per device with its cut edges."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ooc.scheduler.partition import (
    METHODS,
    Devices,
    InfeasiblePartition,
    OpGraph,
    Outcome,
    minimum_capacity,
    read_pardnn,
    run_methods,
    write_pardnn,
)
from ooc.scheduler.partition.simulate import held_events
from ooc.scheduler.partition.synthetic import SHAPES, profile_graph, synthetic
from ooc.scheduler.profile import Profile
from ooc.scheduler.units import format_bytes, parse_bytes


@dataclass(frozen=True)
class PartitionConfig:
    graph: str
    devices: int = 2
    capacity: str | None = None
    methods: tuple[str, ...] = tuple(METHODS)
    bandwidth_GBps: float = 50.0
    latency_us: float = 10.0
    batch: int = 8
    seq: int | None = None
    """A captured GPT's sequence length; None: ``reference_model``'s default."""
    export_pardnn: str | None = None
    gantt: str | None = None
    placement: str | None = None


def load_graph(spec: str, *, batch: int = 8, seq: int | None = None) -> OpGraph:
    """``lstm:N`` / ``transformer:N`` / ``cnn3d:N`` (an analytic graph of about N nodes), ``gpt:<preset>``,
    ``cnn`` or ``mlp`` (a reference model's step, captured and timed here), an ooc profile (``.json``:
    its chain op by op, e.g. an analytic preset) or a folder in ParDNN's format."""
    shape, _, size = spec.partition(":")
    if shape in SHAPES:
        if not size.isdigit():
            raise ValueError(f"--graph {spec}: give the node count, e.g. {shape}:10000")
        return synthetic(shape, int(size))
    if Path(spec).is_dir():
        return read_pardnn(spec)
    if spec.endswith(".json"):
        return profile_graph(Profile.load(spec))
    if shape in ("gpt", "cnn", "mlp"):
        from ooc.apps.cli import reference_model
        from ooc.partition_capture import capture

        model, sample = reference_model(spec, batch, seq)
        return capture(model, sample)
    raise ValueError(f"--graph {spec}: not a folder in ParDNN's format; use one of {[f'{s}:N' for s in SHAPES]}, "
                     "gpt:<preset>, cnn, mlp, a profile (.json, e.g. profiles/analytic-h100-sxm-gpt2-xl-s1024.json) or a folder")


def run_partition(cfg: PartitionConfig) -> int:
    graph = load_graph(cfg.graph, batch=cfg.batch, seq=cfg.seq)
    if graph.n == 0:
        raise ValueError(f"--graph {cfg.graph}: the graph has no ops; there is nothing to place")
    capacity = parse_bytes(cfg.capacity, what="--capacity") if cfg.capacity is not None else int(np.ceil(graph.total_bytes()))
    devices = Devices.uniform(cfg.devices, capacity, bandwidth_Bps=cfg.bandwidth_GBps * 1e9,
                              latency_s=cfg.latency_us * 1e-6)
    print(f"{cfg.graph}: {graph.n} ops, {graph.m} edges, {graph.total_time() * 1e3:.3f} ms of work on one "
          f"device, {format_bytes(graph.total_bytes())} held in all; {devices.k} devices of "
          f"{format_bytes(capacity)}, links {cfg.bandwidth_GBps:g} GB/s + {cfg.latency_us:g} us")
    if cfg.export_pardnn:
        write_pardnn(graph, cfg.export_pardnn, devices=devices.k, capacity_bytes=capacity,
                     bandwidth_Bps=devices.bandwidth_Bps, latency_s=devices.latency_s)
        print(f"wrote ParDNN's files to {cfg.export_pardnn}")
    outcomes = run_methods(graph, devices, cfg.methods)
    print(table(graph, outcomes))
    fitting = [o for o in outcomes if o.fits]
    if not fitting:
        minimum, method = minimum_capacity(graph, devices, cfg.methods)
        raise InfeasiblePartition(devices, minimum, method)
    best = min(fitting, key=lambda o: o.simulation.makespan)
    # "0.29x one device" read as 29% of one device's time where it meant 3.4 times as long.
    work = graph.total_time()
    ratio = f"{best.simulation.makespan / work:.2f}x" if work > 0 else "-"
    print(f"best: {best.method}, {best.simulation.makespan * 1e3:.3f} ms, "
          f"{ratio} the work of one device ({work * 1e3:.3f} ms)")
    if cfg.placement:
        Path(cfg.placement).write_text("".join(f"{n} {d}\n" for n, d in zip(graph.names, best.placement.device.tolist())))
        print(f"wrote {cfg.placement}")
    if cfg.gantt:
        plot_placement(graph, best, cfg.gantt, title=f"{cfg.graph}: {best.method} on {devices.k} devices")
        print(f"wrote {cfg.gantt}")
    return 0


def table(graph: OpGraph, outcomes: list[Outcome]) -> str:
    """One row per method: time to place, makespan, x the best fitting makespan, per-device peaks,
    cut edges, fits."""
    fitting = [o.simulation.makespan for o in outcomes if o.fits] or [o.simulation.makespan for o in outcomes]
    best = min(fitting)
    rows = [("method", "place s", "makespan ms", "x best", "peak per device", "cut edges", "fits")]
    for o in outcomes:
        d = o.placement.device
        rows.append((o.method, f"{o.seconds:.2f}", f"{o.simulation.makespan * 1e3:.3f}",
                     f"{o.simulation.makespan / best:.3f}" if best > 0 else "-",
                     " ".join(format_bytes(b) for b in o.simulation.peak_bytes),
                     str(int((d[graph.src] != d[graph.dst]).sum())), "yes" if o.fits else "no"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_placement(graph: OpGraph, outcome: Outcome, path: str | Path, *, title: str) -> None:
    """Write a PNG: one row per device (its ops), one row per link in use (the cut edges' copies),
    each device's held bytes underneath."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never opens a window
    import matplotlib.pyplot as plt

    sim, device = outcome.simulation, outcome.placement.device
    k = int(sim.peak_bytes.shape[0])
    links = sorted({(int(s), int(d)) for s, d in sim.transfers[:, 1:3].tolist()})
    rows = [f"device {d}" for d in range(k)] + [f"link {s}->{d}" for s, d in links]
    colors = matplotlib.colormaps["tab10"]
    fig, (gantt, memory) = plt.subplots(2, 1, figsize=(12, 5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for d in range(k):
        mine = device == d
        widths = (sim.finish[mine] - sim.start[mine]) * 1e3
        gantt.barh(np.full(int(mine.sum()), d), widths, left=sim.start[mine] * 1e3, color=colors(d % 10),
                   edgecolor="white", linewidth=0.2)
    for row, link in enumerate(links, start=k):
        t = sim.transfers[(sim.transfers[:, 1] == link[0]) & (sim.transfers[:, 2] == link[1])]
        gantt.barh(np.full(t.shape[0], row), (t[:, 4] - t[:, 3]) * 1e3, left=t[:, 3] * 1e3, color="#8C8C8C",
                   edgecolor="white", linewidth=0.2)
    gantt.set_yticks(range(len(rows)), labels=rows)
    gantt.invert_yaxis()
    gantt.set_title(f"{title}: {sim.makespan * 1e3:.2f} ms, {len(sim.transfers)} copies")
    for d in range(k):
        mine = device == d
        # The simulator's own sweep, so the rows reach its peaks.
        times, sizes = held_events(sim.start[mine], sim.release[mine], graph.held_bytes[mine])
        memory.step(np.concatenate([[0.0], times * 1e3]), np.concatenate([[0.0], np.cumsum(sizes) / 2**20]),
                    where="post", color=colors(d % 10), label=f"device {d}")
    memory.set_ylabel("held MiB")
    memory.set_xlabel("ms")
    memory.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(Path(path), dpi=120)
    plt.close(fig)
