"""Run the partitioners on one graph, simulate each placement, and say which fit; when none does,
find the smallest capacity that one would fit in."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ooc.scheduler.errors import OocError, PlanError
from ooc.scheduler.partition.baselines import contiguous, heft, mincut
from ooc.scheduler.partition.devices import Devices, Placement
from ooc.scheduler.partition.graph import OpGraph
from ooc.scheduler.partition.pardnn_method import pardnn
from ooc.scheduler.partition.simulate import Simulation, simulate
from ooc.scheduler.units import format_bytes

METHODS: dict[str, Callable[[OpGraph, Devices], Placement]] = {
    "pardnn": pardnn,
    "contiguous": contiguous,
    "heft": heft,
    "mincut": mincut,
}
"""Every partitioner by name; each is a pure function ``(graph, devices) -> Placement``."""


class InfeasiblePartition(OocError, ValueError):
    """No method's placement fits the devices' memory; ``minimum`` is a machine like the one asked
    for, every capacity scaled by one factor, on which ``method`` fits."""

    def __init__(self, devices: Devices, minimum: Devices, method: str) -> None:
        self.devices, self.minimum, self.method = devices, minimum, method
        asked = ", ".join(format_bytes(c) for c in devices.capacities)
        need = ", ".join(format_bytes(c) for c in minimum.capacities)
        super().__init__(f"no placement over {devices.k} devices fits their memory ({asked}); the method "
                         f"{method!r} fits with {need} (pass --capacity {-(-minimum.capacities[0] // 2**20)}MiB or more "
                         "devices)")


@dataclass(frozen=True, eq=False)
class Outcome:
    """One method's placement, its simulation and how long the method took to place: ``seconds``
    of wall time, ``cpu_seconds`` of this process's CPU time (what it would take on an idle machine,
    where the wall time counts other processes' turns on a shared one)."""

    placement: Placement
    simulation: Simulation
    seconds: float
    fits: bool
    cpu_seconds: float = 0.0

    @property
    def method(self) -> str:
        return self.placement.method


def run_methods(graph: OpGraph, devices: Devices, methods: Sequence[str] = tuple(METHODS)) -> list[Outcome]:
    """Each of ``methods`` on ``graph``: placed, timed, simulated."""
    _check(methods)
    out = []
    for name in methods:
        t0, c0 = time.perf_counter(), time.process_time()
        placement = METHODS[name](graph, devices)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        sim = simulate(graph, placement, devices)
        out.append(Outcome(placement, sim, seconds, sim.fits(devices), cpu))
    return out


def _check(methods: Sequence[str]) -> None:
    """Refuse an empty or unknown list of methods before any is run."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        what = f"no partitioning method {unknown[0]!r}" if unknown else "no partitioning method given"
        raise PlanError(f"{what}; choose from {sorted(METHODS)}")


def partition(graph: OpGraph, devices: Devices, methods: Sequence[str] = tuple(METHODS)) -> Outcome:
    """The fitting placement with the shortest makespan among ``methods``. Raises
    :class:`InfeasiblePartition` (with the smallest capacity found to fit) when none fits."""
    outcomes = run_methods(graph, devices, methods)
    fitting = [o for o in outcomes if o.fits]
    if not fitting:
        minimum, method = minimum_capacity(graph, devices, methods)
        raise InfeasiblePartition(devices, minimum, method)
    return min(fitting, key=lambda o: o.simulation.makespan)


def minimum_capacity(graph: OpGraph, devices: Devices, methods: Sequence[str] = tuple(METHODS), *,
                     tolerance: float = 0.01) -> tuple[Devices, str]:
    """The smallest machine (``devices`` with every capacity scaled by one factor, to within
    ``tolerance``) on which one of ``methods`` fits, found by bisection over the factor, and that
    method. A method that fits at one factor need not fit at every larger one, so the answer is a
    capacity that was seen to fit, not a proven minimum."""
    _check(methods)
    # A device of 0 bytes scales from 1 byte, so that every device grows with the factor.
    devices = Devices(tuple(max(int(c), 1) for c in devices.capacities), devices.bandwidth_Bps, devices.latency_s)
    floor_ = float(min(devices.capacities))
    # Every op on the largest device, holding all it ever holds at once, fits when that device's
    # capacity is the sum of all bytes: the contiguous stages then find a cut.
    hi = max(graph.total_bytes() / floor_, 1.0) * (1 + tolerance)
    lo = 0.0

    def fitting(factor: float) -> str | None:
        scaled = devices.scaled(factor)
        for name in methods:
            placement = METHODS[name](graph, scaled)
            if simulate(graph, placement, scaled).fits(scaled):
                return name
        return None

    found = fitting(hi)
    for _ in range(64):
        if found is not None:
            break
        hi *= 2
        found = fitting(hi)
    if found is None:
        raise OocError("no method fits even with every op on one device; this is a bug, please report it")
    while hi - lo > tolerance * hi:
        mid = 0.5 * (lo + hi)
        got = fitting(mid)
        if got is None:
            lo = mid
        else:
            hi, found = mid, got
    return devices.scaled(hi), found
