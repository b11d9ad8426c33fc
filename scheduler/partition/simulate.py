"""The makespan and per-device peak memory of a placement.

# NOTE [the event model of a placed graph]
Ops are issued in one program order (the graph's topological order), like the step schedule's ops
on its resources: each device runs its ops in that order, one at a time; an op starts when its
device is free and each of its inputs has arrived. An input made on the same device arrives when
its producer finishes. A tensor that crosses to another device is sent once per destination
device, when its producer finishes, on the directed link ``(source, destination)``; each link sends
one tensor at a time, in program order, for ``latency + bytes / bandwidth``.

Memory: an op's output occupies ``held_bytes`` on its device from the op's start until its last
consumer (on any device) has finished and its last outgoing copy is done. As in ParDNN, a tensor is
charged to its producer's device only: the buffer a copy lands in is not counted (an executor that
receives just in time, or a ring of receive buffers, keeps that small; it is a known gap of this
model). At one instant frees come before allocations, so an op may reuse what its finished inputs
held.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ooc.scheduler.errors import PlanError
from ooc.scheduler.partition.devices import Devices, Placement
from ooc.scheduler.partition.graph import OpGraph


@dataclass(frozen=True, eq=False)
class Simulation:
    """``start``/``finish``/``release``: ``(n,)`` seconds each op starts, ends, and frees its output
    on its own device; ``transfers``: ``(t, 6)`` rows ``(node, source, destination, start, end,
    bytes)``; ``peak_bytes``: ``(K,)``; ``peak_time``: ``(K,)`` when each peak is first reached."""

    makespan: float
    start: np.ndarray
    finish: np.ndarray
    release: np.ndarray
    transfers: np.ndarray
    peak_bytes: np.ndarray
    peak_time: np.ndarray

    def fits(self, devices: Devices) -> bool:
        return bool(np.all(self.peak_bytes <= np.asarray(devices.capacities, dtype=float)))

    def overflow(self, devices: Devices) -> np.ndarray:
        """``(K,)`` bytes by which each device's peak exceeds its capacity (0 where it fits)."""
        return np.maximum(self.peak_bytes - np.asarray(devices.capacities, dtype=float), 0.0)


def simulate(graph: OpGraph, placement: Placement, devices: Devices) -> Simulation:
    """Run the event model of NOTE [the event model of a placed graph] over ``placement``."""
    n, k = graph.n, devices.k
    device = placement.device
    if device.shape != (n,):
        raise PlanError(f"the placement places {device.shape[0]} ops; the graph has {n}: place this graph")
    if n and device.max() >= k:
        raise PlanError(f"the placement names device {int(device.max())}; the machine has {k} (0..{k - 1}): "
                        f"place the graph on these devices")
    order = graph.order
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    # The copies, one per (tensor, destination device) with the bytes of its largest edge there,
    # in the order they are sent: their producers' program order, then by destination.
    cross = device[graph.src] != device[graph.dst]
    key = position[graph.src[cross]] * k + device[graph.dst[cross]]
    sends, inverse = np.unique(key, return_inverse=True)
    size = np.zeros(sends.shape[0])
    np.maximum.at(size, inverse, graph.edge_bytes[cross])
    send_node = order[sends // k]
    send_dst = sends % k
    send_ptr = np.searchsorted(sends // k, np.arange(n + 1)).tolist()   # by program position
    seconds = (devices.latency_s + size / devices.bandwidth_Bps).tolist()
    # Where each op's inputs become available: ``avail[p]`` (the producer's finish) on its own
    # device, ``avail[n + s]`` (the arrival of copy s) elsewhere.
    where = graph.src.copy()
    where[cross] = n + inverse
    pptr, _, pedge = graph.pred
    inputs = where[pedge].tolist()
    pptr = pptr.tolist()
    dev = device.tolist()
    time = graph.time_s.tolist()
    dst_l, src_dev = send_dst.tolist(), device[send_node].tolist()
    avail = [0.0] * (n + len(dst_l))
    send_start = [0.0] * len(dst_l)
    dev_free = [0.0] * k
    link_free = [0.0] * (k * k)
    start, finish = [0.0] * n, [0.0] * n
    for at, u in enumerate(order.tolist()):
        d = dev[u]
        ready = dev_free[d]
        for i in range(pptr[u], pptr[u + 1]):
            t = avail[inputs[i]]
            if t > ready:
                ready = t
        start[u] = ready
        end = ready + time[u]
        finish[u] = avail[u] = dev_free[d] = end
        for j in range(send_ptr[at], send_ptr[at + 1]):
            link = d * k + dst_l[j]
            s0 = link_free[link]
            if end > s0:
                s0 = end
            send_start[j] = s0
            avail[n + j] = link_free[link] = s0 + seconds[j]
    transfers = np.stack([send_node.astype(float), np.asarray(src_dev, dtype=float), send_dst.astype(float),
                          np.asarray(send_start), np.asarray(avail[n:]), size], axis=1).reshape(-1, 6)
    start_a, finish_a = np.asarray(start), np.asarray(finish)
    release = finish_a.copy()
    np.maximum.at(release, graph.src, finish_a[graph.dst])
    if transfers.shape[0]:
        np.maximum.at(release, transfers[:, 0].astype(np.int64), transfers[:, 4])
    peak, when = _peaks(placement.device, start_a, release, graph.held_bytes, k)
    makespan = float(finish_a.max()) if n else 0.0
    return Simulation(makespan, start_a, finish_a, release, transfers, peak, when)


def _peaks(device: np.ndarray, start: np.ndarray, release: np.ndarray, held: np.ndarray,
           k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each device's highest level of :func:`held_events` and when it is first reached."""
    peak = np.zeros(k)
    when = np.zeros(k)
    for d in range(k):
        mine = device == d
        times, sizes = held_events(start[mine], release[mine], held[mine])
        if not times.size:
            continue
        level = np.cumsum(sizes)
        i = int(np.argmax(level))
        peak[d], when[d] = level[i], times[i]
    return peak, when


def held_events(start: np.ndarray, release: np.ndarray, held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One device's allocations (``+held`` at ``start``) and frees (``-held`` at ``release``) as
    ``(times, sizes)`` in the order of the sweep: at one instant frees of lifetimes with positive
    length come first, then allocations, then frees of zero-length ones (an op that holds its output
    only for the instant it runs still needs the room). Their running sum is the device's memory."""
    keep = held > 0
    lo, hi, size = start[keep], release[keep], held[keep]
    times = np.concatenate([lo, hi])
    kinds = np.concatenate([np.ones(lo.size), np.where(hi > lo, 0, 2)])
    order = np.lexsort((kinds, times))
    return times[order], np.concatenate([size, -size])[order]
