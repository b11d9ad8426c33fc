"""An event simulation of one step's schedule on a machine: the concurrency model.

Each resource (compute stream, D2H engine, H2D engine, the network between ranks, the host
optimizer's thread) runs its ops in issue order; an op starts when its resource is free and its
dependencies are done. A "floating" op (issued by a host thread when its dependencies end) may pass
ops queued before it. Copies pay a fixed latency, then move bytes at the one-way bandwidth, or at
the duplex bandwidth while the opposite engine moves bytes too. While any copy moves bytes, compute
runs ``1 + hardware.compute_slowdown`` times slower (zero on GPUs with dedicated copy engines; on
the CPU backend the copy threads share the cores); while two of compute, the host update and the
exchange run at once, each runs ``1 + hardware.host_contention`` times slower (they share the
cores on the CPU backend). Network and host ops take their durations.
"""

from __future__ import annotations

from dataclasses import dataclass

from ooc.scheduler.hardware import Hardware
from ooc.scheduler.schedule import Op, OpKind, Resource, Schedule, build_schedule
from ooc.scheduler.units import format_bytes

_EPS = 1e-15


@dataclass(frozen=True)
class Interval:
    op: int
    label: str
    resource: Resource
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    step_time_s: float
    peak_bytes: int
    busy_s: dict[Resource, float]
    compute_stall_s: float
    """Time the compute stream had work queued but waited for a copy."""
    timeline: tuple[Interval, ...]
    memory: tuple[tuple[float, int], ...]
    """(time, device bytes) after each change, in time order."""

    def summary(self) -> str:
        busy = ", ".join(f"{r.value} {s * 1e3:.2f} ms" for r, s in self.busy_s.items() if s > 0 or r.value in ("compute", "d2h", "h2d"))
        return (
            f"step {self.step_time_s * 1e3:.2f} ms, peak {format_bytes(self.peak_bytes)}, "
            f"compute stalled {self.compute_stall_s * 1e3:.2f} ms; busy: {busy}"
        )


class _Running:
    __slots__ = ("op", "latency", "remaining", "start")

    def __init__(self, op: Op, latency: float, remaining: float, start: float) -> None:
        self.op = op
        self.latency = latency
        self.remaining = remaining  # seconds (compute) or bytes (copies)
        self.start = start


def simulate(schedule: Schedule, hardware: Hardware, *, keep_timeline: bool = True) -> SimResult:
    ops = schedule.ops
    queues: dict[Resource, list[Op]] = {r: [] for r in Resource}
    for op in ops:
        if op.resource not in queues:
            raise ValueError(f"the simulator has no model for resource {op.resource.value} (op {op.label})")
        queues[op.resource].append(op)
    heads = {r: 0 for r in queues}
    done = [-1.0] * len(ops)
    running: dict[Resource, _Running] = {}
    busy = {r: 0.0 for r in queues}
    timeline: list[Interval] = []
    stall = 0.0
    t = 0.0
    finished = 0
    slow = 1.0 + hardware.compute_slowdown

    started = [False] * len(ops)
    copies = (Resource.D2H, Resource.H2D)

    def ready(op: Op) -> bool:
        return not started[op.index] and all(0.0 <= done[d] <= t + _EPS for d in op.deps)

    while finished < len(ops):
        for r, queue in queues.items():
            while heads[r] < len(queue) and started[queue[heads[r]].index]:
                heads[r] += 1
            if r in running or heads[r] >= len(queue):
                continue
            op = queue[heads[r]]
            if not ready(op):
                op = next((o for o in queue[heads[r] + 1:] if o.floating and ready(o)), None)
                if op is None:
                    continue
            started[op.index] = True
            if r in copies:
                running[r] = _Running(op, hardware.copy_latency_s, float(op.bytes_moved), t)
            else:
                running[r] = _Running(op, 0.0, op.duration_s, t)
        if not running:
            raise ValueError("the schedule deadlocks: an op waits on one that can never finish")

        moving = {r for r, run in running.items() if r in copies and run.latency <= _EPS}
        duplex = Resource.D2H in moving and Resource.H2D in moving
        # Compute, the host update and a host-side exchange (gloo) share the cores where
        # host_contention > 0 (the CPU backend): any two of them at once slow each other.
        on_cores = [r for r in (Resource.COMPUTE, Resource.HOST, Resource.NET) if r in running]
        shared = 1.0 + hardware.host_contention if len(on_cores) >= 2 else 1.0
        rates: dict[Resource, float] = {}
        step = float("inf")
        for r, run in running.items():
            if r is Resource.COMPUTE:
                rates[r] = (1.0 / slow if moving else 1.0) / shared
                step = min(step, run.remaining / rates[r])
            elif r is Resource.HOST:
                rates[r] = 1.0 / shared
                step = min(step, run.remaining / rates[r])
            elif r is Resource.NET:
                rates[r] = 1.0 / shared
                step = min(step, run.remaining / rates[r])
            elif run.latency > _EPS:
                step = min(step, run.latency)
            else:
                if r is Resource.D2H:
                    rates[r] = hardware.d2h_duplex if duplex else hardware.d2h
                else:
                    rates[r] = hardware.h2d_duplex if duplex else hardware.h2d
                step = min(step, run.remaining / rates[r])
        if Resource.COMPUTE not in running and heads[Resource.COMPUTE] < len(queues[Resource.COMPUTE]):
            stall += step
        t += step
        for r in list(running):
            run = running[r]
            busy[r] += step
            if r in copies and run.latency > _EPS:
                run.latency -= step
                continue
            run.remaining -= step * rates[r]
            scale = max(1.0, float(run.op.bytes_moved)) if r in copies else 1.0
            if run.remaining <= _EPS * scale + 1e-12:
                done[run.op.index] = t
                finished += 1
                if keep_timeline:
                    timeline.append(Interval(run.op.index, run.op.label, r, run.start, t))
                del running[r]

    memory: list[tuple[float, int]] = []
    if keep_timeline:
        starts = {iv.op: iv.start for iv in timeline}
        current = 0
        events = []
        for op in ops:
            # A copy back allocates when the host issues it (its compute dependency ends), not when
            # the engine gets to it; everything else when it starts.
            issued = max((done[d] for d in op.deps if ops[d].resource is Resource.COMPUTE), default=0.0)
            events.append((issued if op.kind is OpKind.SWAP_IN else starts.get(op.index, done[op.index]), op.alloc_bytes))
            events.append((done[op.index], -op.free_bytes))
        # At equal times frees come first: in program order an op frees before the next allocates.
        for when, delta in sorted(events, key=lambda e: (e[0], e[1])):
            if delta:
                current += delta
                memory.append((when, current))
    return SimResult(
        step_time_s=t,
        peak_bytes=schedule.peak_bytes,
        busy_s=busy,
        compute_stall_s=stall,
        timeline=tuple(sorted(timeline, key=lambda iv: (iv.start, iv.op))),
        memory=tuple(memory),
    )


def predict(plan, profile, hardware: Hardware) -> SimResult:
    """Build the schedule of ``plan`` on ``profile`` and simulate it on ``hardware``."""
    return simulate(build_schedule(plan, profile, hardware), hardware, keep_timeline=False)


__all__ = ["Interval", "OpKind", "SimResult", "predict", "simulate"]
