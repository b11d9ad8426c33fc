"""Claim (issue 16): ParDNN's method places a 100k-node training graph in <= 10 s, fits where the
baselines (contiguous stages, HEFT, min-cut) overflow, and is within 5% of the best makespan
elsewhere.

Analytic training graphs (``ooc.scheduler.partition.synthetic``: a stacked LSTM unrolled like
ParDNN's Word-RNN, a transformer with per-head branches, a 3D CNN with grouped residual blocks) of
about 1k, 10k and 100k nodes, on K = 2, 4, 8 devices joined by 50 GB/s + 10 us links. Capacities are
fractions of the graph's peak on one device: 1 (generous), 2/K, 1.2/K, and (up to 10k nodes) the
tightest at which any method fits, found by bisection. Each cell: the method's makespan / the best
fitting makespan, or "over x" (peak / capacity) when it does not fit; then the seconds it took.
Run: ``python benchmarks/bench_partition.py [--quick] [--sizes 1000,10000,100000]``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import table  # noqa: E402
from ooc.scheduler.partition import METHODS, Devices, Placement, minimum_capacity, run_methods, simulate  # noqa: E402
from ooc.scheduler.partition.synthetic import SHAPES, synthetic  # noqa: E402

BANDWIDTH, LATENCY = 50e9, 10e-6


def one_device_peak(graph) -> float:
    alone = Devices((int(graph.total_bytes()) + 1,), BANDWIDTH, LATENCY)
    return float(simulate(graph, Placement.of("one", np.zeros(graph.n, dtype=np.int64), 1, graph.n), alone).peak_bytes[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1k and 10k nodes, K = 2 and 4")
    ap.add_argument("--sizes", default=None, help="comma-separated node counts (default 1000,10000,100000)")
    ap.add_argument("--ks", default=None, help="comma-separated device counts (default 2,4,8)")
    args = ap.parse_args()
    sizes = [int(s) for s in (args.sizes or ("1000,10000" if args.quick else "1000,10000,100000")).split(",")]
    ks = [int(k) for k in (args.ks or ("2,4" if args.quick else "2,4,8")).split(",")]
    print(f"# bench_partition: ParDNN's method vs contiguous stages, HEFT, min-cut (simulated)\n"
          f"# host {platform.node()} | {platform.processor() or platform.machine()} | numpy {np.__version__} | "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n"
          f"# links {BANDWIDTH / 1e9:g} GB/s + {LATENCY * 1e6:g} us; capacity as a fraction of the one-device peak")
    methods = list(METHODS)
    rows = [["graph", "nodes", "K", "capacity", *methods]]
    pardnn_seconds: dict[int, float] = {}
    pardnn_cpu: dict[int, float] = {}
    fits_alone = within_5 = cases = 0
    misses = []
    for shape in SHAPES:
        for size in sizes:
            graph = synthetic(shape, size)
            peak = one_device_peak(graph)
            for k in ks:
                fractions = [("1", 1.0)] + ([("2/K", 2.0 / k)] if k > 2 else []) + [("1.2/K", 1.2 / k)]
                if graph.n <= 20_000:
                    tight, _ = minimum_capacity(graph, Devices.uniform(k, int(peak / k), bandwidth_Bps=BANDWIDTH,
                                                                       latency_s=LATENCY), tolerance=0.02)
                    fractions.append(("tightest", tight.capacities[0] / peak))
                for label, frac in fractions:
                    devices = Devices.uniform(k, int(peak * frac), bandwidth_Bps=BANDWIDTH, latency_s=LATENCY)
                    outcomes = {o.method: o for o in run_methods(graph, devices, methods)}
                    pardnn_seconds[size] = max(pardnn_seconds.get(size, 0.0), outcomes["pardnn"].seconds)
                    pardnn_cpu[size] = max(pardnn_cpu.get(size, 0.0), outcomes["pardnn"].cpu_seconds)
                    fitting = [o.simulation.makespan for o in outcomes.values() if o.fits]
                    best = min(fitting) if fitting else None
                    cells = []
                    for m in methods:
                        o = outcomes[m]
                        if o.fits:
                            cells.append(f"{o.simulation.makespan / best:.3f} {o.seconds:.2f}s")
                        else:
                            cells.append(f"over {o.simulation.peak_bytes.max() / devices.capacities[0]:.2f} {o.seconds:.2f}s")
                    rows.append([shape, str(graph.n), str(k), f"{label} ({frac:.3f})", *cells])
                    if best is not None:
                        cases += 1
                        mine = outcomes["pardnn"]
                        others_fit = any(outcomes[m].fits for m in methods if m != "pardnn")
                        if mine.fits and not others_fit:
                            fits_alone += 1
                        if mine.fits and mine.simulation.makespan <= 1.05 * best:
                            within_5 += 1
                        else:
                            ratio = f"{mine.simulation.makespan / best:.3f}" if mine.fits else "over"
                            misses.append(f"{shape} {graph.n} K={k} {label}: {ratio}")
                    print(rows[-1], flush=True, file=sys.stderr)
    print(table(rows))
    print()
    for n, s in sorted(pardnn_seconds.items()):
        print(f"ParDNN's method at about {n} nodes: at most {s:.2f} s to place, {pardnn_cpu[n]:.2f} s of CPU "
              f"(goal <= 10 s at 100k; the wall time counts other processes' turns on a shared machine)")
    print(f"cases where some method fits: {cases}; ParDNN's method fits alone in {fits_alone}, "
          f"is within 5% of the best in {within_5} (goal: all)")
    for miss in misses:
        print(f"  not within 5%: {miss}")


if __name__ == "__main__":
    main()
