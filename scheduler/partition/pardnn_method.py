"""ParDNN's method (Qararyah, Wahib, Unat et al., Parallel Computing 2021), in O(m log n):

1. slice the graph into linear clusters along critical paths (longest paths, every edge cut);
2. map the clusters to devices, primary (longest) ones first, each by level-aware load balancing:
   to the device where it adds the least delay (overflow of its levels) plus transfer time with the
   clusters already placed (memory is not looked at before step 4, as in ParDNN);
3. refine: an op whose neighbours mostly sit on another device joins them if that saves more
   transfer time than the delay it adds there;
4. repair memory: while a device's simulated peak exceeds its capacity, move the ops alive at its
   fullest point (earliest made first) to a device with room over their lifetime;
5. refine the makespan on the simulator's critical path (``critical.refine_makespan``): move the
   ops whose copies or device contention make the path wait, keeping every device within memory.

"Levels" are time bins of each op's top level: two ops in one bin would run at about the same time
on an ideal machine, so a device whose bin is already full delays what else lands there.
"""

from __future__ import annotations

import heapq

import numpy as np

from ooc.scheduler.partition.critical import refine_makespan
from ooc.scheduler.partition.devices import Devices, Placement
from ooc.scheduler.partition.graph import OpGraph
from ooc.scheduler.partition.paths import edge_seconds, top_bottom_levels
from ooc.scheduler.partition.simulate import Simulation, simulate

BINS = 4096
"""Time bins of the level-aware balance and of the memory repair's lifetime profile."""
REPAIR_ROUNDS = 12
EVALUATIONS = 32
REFINE_WORK = 4_000_000
"""The critical-path refinement spends at most ``EVALUATIONS`` simulations, fewer on large graphs:
``REFINE_WORK / (n + m)`` of them, but at least 8 (a simulation visits every op and edge; 10 of
them at 100k ops, 400k edges take about 2 s here)."""


def pardnn(graph: OpGraph, devices: Devices, *, evaluations: int | None = None) -> Placement:
    """ParDNN's placement of ``graph`` on ``devices`` (see the module docstring)."""
    n, k = graph.n, devices.k
    if n == 0 or k == 1:
        return Placement.of("pardnn", np.zeros(n, dtype=np.int64), k, n)
    comm = edge_seconds(graph, devices)
    top, bottom = top_bottom_levels(graph, comm)
    clusters = linear_clusters(graph, top, bottom, comm)
    device = _map_clusters(graph, devices, clusters, top, comm)
    device = _refine(graph, devices, device, top, comm)
    device, sim = repair_memory(graph, devices, device)
    if evaluations is None:
        evaluations = min(EVALUATIONS, max(8, REFINE_WORK // (graph.n + graph.m)))
    device, _ = refine_makespan(graph, devices, device, sim, evaluations=evaluations)
    return Placement.of("pardnn", device, k, n)


def linear_clusters(graph: OpGraph, top: np.ndarray, bottom: np.ndarray, comm: np.ndarray) -> list[np.ndarray]:
    """Disjoint paths covering the graph, longest first: take the unclustered op on the longest
    path (top + bottom level), then extend the path forward through the unclustered successor with
    the longest remaining path and backward through the unclustered predecessor whose path reaches
    it latest. Each path is in program order."""
    n = graph.n
    time = graph.time_s.tolist()
    comm_l = comm.tolist()
    top_l, bottom_l = top.tolist(), bottom.tolist()
    pptr, pnode, pedge = (a.tolist() for a in graph.pred)
    sptr, snode, sedge = (a.tolist() for a in graph.succ)
    done = [False] * n
    heap = list(zip((-(top + bottom)).tolist(), range(n)))
    heapq.heapify(heap)
    clusters = []
    while heap:
        _, s = heapq.heappop(heap)
        if done[s]:
            continue
        done[s] = True
        forward = [s]
        u = s
        while True:
            best, nxt = -1.0, -1
            for i in range(sptr[u], sptr[u + 1]):
                v = snode[i]
                if not done[v]:
                    t = comm_l[sedge[i]] + bottom_l[v]
                    if t > best:
                        best, nxt = t, v
            if nxt < 0:
                break
            done[nxt] = True
            forward.append(nxt)
            u = nxt
        backward = []
        u = s
        while True:
            best, prv = -1.0, -1
            for i in range(pptr[u], pptr[u + 1]):
                p = pnode[i]
                if not done[p]:
                    t = top_l[p] + time[p] + comm_l[pedge[i]]
                    if t > best:
                        best, prv = t, p
            if prv < 0:
                break
            done[prv] = True
            backward.append(prv)
            u = prv
        backward.reverse()
        clusters.append(np.asarray(backward + forward, dtype=np.int64))
    return clusters


def _bins(graph: OpGraph, top: np.ndarray) -> tuple[np.ndarray, float]:
    span = float((top + graph.time_s).max())
    bins = min(BINS, max(graph.n, 1))
    width = span / bins if span > 0 else 1.0
    return np.minimum((top / width).astype(np.int64), bins - 1), width


def _map_clusters(graph: OpGraph, devices: Devices, clusters: list[np.ndarray], top: np.ndarray,
                  comm: np.ndarray) -> np.ndarray:
    n, k = graph.n, devices.k
    time = graph.time_s
    bin_of, width = _bins(graph, top)
    load = np.zeros((k, int(bin_of.max()) + 1))
    device = np.full(n, -1, dtype=np.int64)
    work = np.fromiter((time[c].sum() for c in clusters), dtype=float, count=len(clusters))
    ptr, nbr, cst = _neighbours(graph, comm)
    for ci in np.argsort(-work, kind="stable").tolist():
        c = clusters[ci]
        b, t = bin_of[c], time[c]
        before = load[:, b]
        delay = (np.maximum(before + t - width, 0) - np.maximum(before - width, 0)).sum(axis=1)
        cost = delay + 1e-9 * load.sum(axis=1) + _comm_cost(c, device, k, ptr, nbr, cst)
        d = int(np.argmin(cost))
        device[c] = d
        np.add.at(load[d], b, t)
    return device


def _lifetimes(graph: OpGraph) -> tuple[np.ndarray, np.ndarray, int]:
    """Each op's lifetime in program order, in bins: ``(lo (n,), hi (n,), bins)``, an op held from
    its position to its last consumer's (which no placement changes)."""
    position = np.empty(graph.n, dtype=np.int64)
    position[graph.order] = np.arange(graph.n)
    last = position.copy()
    np.maximum.at(last, graph.src, position[graph.dst])
    bins = min(BINS, graph.n)
    return position * bins // graph.n, last * bins // graph.n, bins


def _comm_cost(c: np.ndarray, device: np.ndarray, k: int, ptr: np.ndarray, nbr: np.ndarray,
               cst: np.ndarray) -> np.ndarray:
    """``(K,)`` seconds of transfers placing cluster ``c`` on each device adds with its placed
    neighbours (``ptr``/``nbr``/``cst``: the undirected CSR of :func:`_neighbours`)."""
    at = _ranges(ptr, c)
    if at.size == 0:
        return np.zeros(k)
    where = device[nbr[at]]
    placed = where >= 0
    cost = cst[at][placed]
    return cost.sum() - np.bincount(where[placed], weights=cost, minlength=k)


def _ranges(ptr: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """The CSR positions of ``nodes``' rows, concatenated."""
    a, b = ptr[nodes], ptr[nodes + 1]
    lens = b - a
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offs = np.repeat(a - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    return np.arange(total) + offs


def _refine(graph: OpGraph, devices: Devices, device: np.ndarray, top: np.ndarray, comm: np.ndarray) -> np.ndarray:
    """One pass in program order: an op moves to the device holding most of its neighbours'
    communication when the transfer time that saves exceeds the delay it adds there (the overflow
    of its time bin, as in the mapping) less the delay it removes where it was. Memory is left to
    the repair, as in ParDNN."""
    n, k = graph.n, devices.k
    bin_of, width = _bins(graph, top)
    load = np.zeros((k, int(bin_of.max()) + 1))
    np.add.at(load, (device, bin_of), graph.time_s)
    u_all = np.concatenate([graph.src, graph.dst])
    v_all = np.concatenate([graph.dst, graph.src])
    c_all = np.concatenate([comm, comm])
    perm = np.argsort(u_all, kind="stable")
    nbr, cst = v_all[perm].tolist(), c_all[perm].tolist()
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(u_all, minlength=n), out=ptr[1:])
    ptr_l = ptr.tolist()
    time, bins = graph.time_s.tolist(), bin_of.tolist()
    dev = device.tolist()
    for u in graph.order.tolist():
        a, b = ptr_l[u], ptr_l[u + 1]
        if a == b:
            continue
        tie = [0.0] * k
        for i in range(a, b):
            tie[dev[nbr[i]]] += cst[i]
        d = dev[u]
        q = max(range(k), key=tie.__getitem__)
        if q == d:
            continue
        t, j = time[u], bins[u]
        added = max(load[q, j] + t - width, 0.0) - max(load[q, j] - width, 0.0)
        removed = max(load[d, j] - width, 0.0) - max(load[d, j] - t - width, 0.0)
        if tie[q] - tie[d] <= added - removed:
            continue
        load[d, j] -= t
        load[q, j] += t
        dev[u] = q
    return np.asarray(dev, dtype=np.int64)


def repair_memory(graph: OpGraph, devices: Devices, device: np.ndarray) -> tuple[np.ndarray, Simulation]:
    """ParDNN's memory step: simulate; while a device's peak exceeds its capacity, take the ops it
    holds at its fullest bin, earliest made first, and move each to a device whose fullest bin over
    the op's lifetime has room for it, the one its neighbours' transfers favour most, until the bin
    fits. Earliest first, not largest first: the oldest tensors at a training step's peak are the
    first layers' saved activations, so the moves take whole early layers along (their neighbours
    follow them), and the cut stays a few tensors wide; largest first scattered same-sized tensors
    of every layer and made the step wait on copies (1.1-1.45x the makespan of HEFT on the 3D CNN
    and LSTM at tight capacity in bench_partition).
    Lifetimes are taken in program order (an op is held from its position to its last consumer's),
    which no move changes (lifetimes in simulated time did: moved ops wait for copies, and the
    repair chased its own tail), in bins (an op counts in every bin it touches); each round
    re-simulates, with a margin 2% wider."""
    k = devices.k
    caps = np.asarray(devices.capacities, dtype=float)
    ptr, nbr, cst = _neighbours(graph, edge_seconds(graph, devices))
    lo, hi, bins = _lifetimes(graph)
    held = graph.held_bytes
    device = device.copy()
    sim = simulate(graph, Placement.of("pardnn", device, k, graph.n), devices)
    for round_ in range(REPAIR_ROUNDS):
        if sim.fits(devices):
            break
        target = caps * (1.0 - 0.02 * round_)
        profile = _profile(device, lo, hi, held, k, bins)
        moved = False
        alive_order = np.argsort(lo, kind="stable")
        for d in np.argsort(-(sim.peak_bytes - caps)).tolist():
            for _ in range(graph.n):
                peak_bin = int(np.argmax(profile[d]))
                if profile[d, peak_bin] <= target[d]:
                    break
                mine = alive_order[(device[alive_order] == d) & (lo[alive_order] <= peak_bin)
                                   & (hi[alive_order] >= peak_bin) & (held[alive_order] > 0)]
                progress = False
                for u in mine.tolist():
                    if profile[d, peak_bin] <= target[d]:
                        break
                    room = target - profile[:, lo[u]:hi[u] + 1].max(axis=1)
                    room[d] = -np.inf
                    ok = room >= held[u]
                    if not ok.any():
                        continue
                    a, b = ptr[u], ptr[u + 1]
                    tie = np.bincount(device[nbr[a:b]], weights=cst[a:b], minlength=k)
                    q = int(np.argmax(np.where(ok, tie + 1e-12 * room / max(float(target.max()), 1.0), -np.inf)))
                    profile[d, lo[u]:hi[u] + 1] -= held[u]
                    profile[q, lo[u]:hi[u] + 1] += held[u]
                    device[u] = q
                    progress = moved = True
                if not progress:
                    break
        sim = simulate(graph, Placement.of("pardnn", device, k, graph.n), devices)
        if not moved:
            break
    return device, sim


def _neighbours(graph: OpGraph, comm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Undirected CSR: ``(ptr (n+1,), neighbour (2m,), edge seconds (2m,))``."""
    u_all = np.concatenate([graph.src, graph.dst])
    perm = np.argsort(u_all, kind="stable")
    ptr = np.zeros(graph.n + 1, dtype=np.int64)
    np.cumsum(np.bincount(u_all, minlength=graph.n), out=ptr[1:])
    return ptr, np.concatenate([graph.dst, graph.src])[perm], np.concatenate([comm, comm])[perm]


def _profile(device, lo, hi, size, k: int, bins: int) -> np.ndarray:
    diff = np.zeros((k, bins + 1))
    np.add.at(diff, (device, lo), size)
    np.add.at(diff, (device, hi + 1), -size)
    return np.cumsum(diff, axis=1)[:, :bins]
