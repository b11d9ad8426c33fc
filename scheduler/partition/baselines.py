"""The placements a user would otherwise pick: contiguous pipeline stages over the op order, HEFT
(earliest-finish-time list scheduling) and a balanced min-cut. Each is a pure function
``(graph, devices) -> Placement``; each returns its best attempt even when it does not fit, and the
simulator says whether it does."""

from __future__ import annotations

import heapq

import numpy as np

from ooc.scheduler.partition.devices import Devices, Placement
from ooc.scheduler.partition.graph import OpGraph
from ooc.scheduler.partition.paths import edge_seconds, top_bottom_levels


def contiguous(graph: OpGraph, devices: Devices) -> Placement:
    """Pipeline stages: cut the program order (``graph.order``) into K contiguous stages, stage i on
    device i, minimising the longest stage's time subject to each stage's bytes (the sum of what its
    ops hold: a bound on its peak) fitting its device. Without any such cut, the time-balanced cut.

    Bisection over the longest stage's time; each probe extends every stage greedily, which is
    exact for two additive, monotone limits (time and bytes): O(K log n) per probe."""
    order = graph.order
    cut = _stage_cuts(graph.time_s[order], graph.held_bytes[order], np.asarray(devices.capacities, dtype=float))
    if cut is None:
        cut = _stage_cuts(graph.time_s[order], np.zeros(graph.n), np.full(devices.k, np.inf))
    device = np.empty(graph.n, dtype=np.int64)
    device[order] = np.searchsorted(cut, np.arange(graph.n), side="right")
    return Placement.of("contiguous", device, devices.k, graph.n)


def _stage_cuts(time: np.ndarray, size: np.ndarray, caps: np.ndarray) -> np.ndarray | None:
    """``(K-1,)`` stage boundaries (stage i is ``[cut[i-1], cut[i])``), or None if no cut fits."""
    k, n = caps.shape[0], time.shape[0]
    ct = np.concatenate([[0.0], np.cumsum(time)])
    cs = np.concatenate([[0.0], np.cumsum(size)])

    def probe(limit: float) -> np.ndarray | None:
        cuts, at = [], 0
        for d in range(k):
            end_t = np.searchsorted(ct, ct[at] + limit * (1 + 1e-12), side="right") - 1
            end_s = np.searchsorted(cs, cs[at] + caps[d] * (1 + 1e-12), side="right") - 1
            at = int(max(at, min(end_t, end_s, n)))
            cuts.append(at)
        return np.asarray(cuts[:-1]) if at >= n else None

    hi = float(ct[-1])
    best = probe(hi)
    if best is None:
        return None
    lo = float(time.max()) if n else 0.0
    for _ in range(60):
        if hi - lo <= 1e-9 * max(hi, 1e-30):
            break
        mid = 0.5 * (lo + hi)
        got = probe(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return best


def heft(graph: OpGraph, devices: Devices) -> Placement:
    """HEFT (Topcuoglu et al. 2002) without insertion: ops by decreasing upward rank (the bottom
    level with every edge cut), each to the device where it finishes earliest. A device whose
    placed ops' bytes would then exceed its capacity is passed over while another one has room (a
    cheap guard: the bytes placed bound the peak from above)."""
    n, k = graph.n, devices.k
    comm = edge_seconds(graph, devices).tolist()
    _, rank = top_bottom_levels(graph, np.asarray(comm))
    pos = np.empty(n, dtype=np.int64)
    pos[graph.order] = np.arange(n)
    queue = np.lexsort((pos, -rank)).tolist()   # rank ties keep program order, so inputs come first
    time = graph.time_s.tolist()
    held = graph.held_bytes.tolist()
    caps = [float(c) for c in devices.capacities]
    pptr, pnode, pedge = (a.tolist() for a in graph.pred)
    device = [0] * n
    finish = [0.0] * n
    free = [0.0] * k
    used = [0.0] * k
    for u in queue:
        best_d, best_f, best_fits = 0, float("inf"), False
        for d in range(k):
            ready = free[d]
            for i in range(pptr[u], pptr[u + 1]):
                p = pnode[i]
                t = finish[p] + (comm[pedge[i]] if device[p] != d else 0.0)
                if t > ready:
                    ready = t
            f = ready + time[u]
            fits = used[d] + held[u] <= caps[d]
            if (fits and not best_fits) or (fits == best_fits and f < best_f):
                best_d, best_f, best_fits = d, f, fits
        device[u] = best_d
        finish[u] = best_f
        free[best_d] = best_f
        used[best_d] += held[u]
    return Placement.of("heft", device, k, n)


def mincut(graph: OpGraph, devices: Devices, *, imbalance: float = 0.05, passes: int = 8,
           patience: int = 200) -> Placement:
    """A balanced min-cut of the bytes crossing devices, each device's time within ``imbalance`` of
    an even share (plus one op). Neither pymetis nor kahip is installed here, so: the contiguous
    stages, refined first by greedy passes (every op with a positive gain, the bytes of cut edges it
    would uncut, moves to its best device, largest gain first, if that device keeps the balance
    and its capacity; an op whose neighbour moved waits for the next pass), then by k-way
    Fiduccia-Mattheyses passes, which also make losing moves (best gain first, ties towards the
    lighter device, each op once a pass) and keep the best prefix, so they climb out of the local minima the greedy passes stop
    in; a pass ends ``patience`` moves after its last improvement."""
    n, k = graph.n, devices.k
    weight = graph.edge_bytes + devices.latency_s * devices.bandwidth_Bps
    if k == 1 or n == 0:
        return Placement.of("mincut", np.zeros(n, dtype=np.int64), k, n)
    device = contiguous(graph, devices).device.copy()
    time, held = graph.time_s, graph.held_bytes
    caps = np.asarray(devices.capacities, dtype=float)
    limit = (1 + imbalance) * graph.total_time() / k + float(time.max())
    load = np.bincount(device, weights=time, minlength=k)
    used = np.bincount(device, weights=held, minlength=k)
    u_all = np.concatenate([graph.src, graph.dst])
    v_all = np.concatenate([graph.dst, graph.src])
    w_all = np.concatenate([weight, weight])
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(u_all, minlength=n), out=ptr[1:])
    nbr = v_all[np.argsort(u_all, kind="stable")].tolist()
    ptr_l = ptr.tolist()
    for _ in range(passes):
        conn = np.bincount(u_all * k + device[v_all], weights=w_all, minlength=n * k).astype(float).reshape(n, k)
        own = conn[np.arange(n), device]
        conn[np.arange(n), device] = -np.inf
        target = conn.argmax(axis=1)
        gain = conn[np.arange(n), target] - own
        cand = np.flatnonzero(gain > 0)
        if cand.size == 0:
            break
        cand = cand[np.argsort(-gain[cand], kind="stable")].tolist()
        locked = np.zeros(n, dtype=bool)
        moved = 0
        tgt = target.tolist()
        for u in cand:
            if locked[u]:
                continue
            d, q = int(device[u]), tgt[u]
            if not _may_move(u, d, q, load, used, time, held, caps, limit):
                continue
            _move(u, d, q, device, load, used, time, held)
            locked[nbr[ptr_l[u]:ptr_l[u + 1]]] = True
            moved += 1
        if moved == 0:
            break
    w_l = w_all[np.argsort(u_all, kind="stable")].tolist()
    dev, ld, us = device.tolist(), load.tolist(), used.tolist()
    for _ in range(passes):
        if _fm_pass(dev, ld, us, k, ptr_l, nbr, w_l, time.tolist(), held.tolist(), caps.tolist(), limit,
                    patience) <= 0:
            break
    return Placement.of("mincut", dev, k, n)


def _fm_pass(device: list[int], load: list[float], used: list[float], k: int, ptr: list[int], nbr: list[int],
             weight: list[float], time: list[float], held: list[float], caps: list[float], limit: float,
             patience: int) -> float:
    """One k-way FM pass over lists it updates in place; returns the cut bytes it saved (>= 0)."""
    n = len(device)

    def best(u: int) -> tuple[float, int]:
        conn = [0.0] * k
        for i in range(ptr[u], ptr[u + 1]):
            conn[device[nbr[i]]] += weight[i]
        d = device[u]
        q = max((x for x in range(k) if x != d), key=conn.__getitem__)
        return conn[q] - conn[d], q

    heap = []
    for u in range(n):
        if ptr[u] < ptr[u + 1]:
            g, q = best(u)
            heap.append((-g, load[q] - load[device[u]], u, q))
    heapq.heapify(heap)
    locked = [False] * n
    moves: list[tuple[int, int, int]] = []
    total = best_total = 0.0
    best_len = 0
    while heap and len(moves) - best_len < patience:
        neg, _, u, q = heapq.heappop(heap)
        if locked[u]:
            continue
        g, q_now = best(u)
        if g != -neg or q_now != q:   # stale: a neighbour moved since this entry was pushed
            heapq.heappush(heap, (-g, load[q_now] - load[device[u]], u, q_now))
            continue
        locked[u] = True
        d = device[u]
        if not _may_move(u, d, q, load, used, time, held, caps, limit):
            continue
        _move(u, d, q, device, load, used, time, held)
        moves.append((u, d, q))
        total += g
        if total > best_total + 1e-9:
            best_total, best_len = total, len(moves)
        for i in range(ptr[u], ptr[u + 1]):
            v = nbr[i]
            if not locked[v]:
                gv, qv = best(v)
                heapq.heappush(heap, (-gv, load[qv] - load[device[v]], v, qv))
    for u, d, q in reversed(moves[best_len:]):
        _move(u, q, d, device, load, used, time, held)
    return best_total


def _may_move(u: int, d: int, q: int, load, used, time, held, caps, limit: float) -> bool:  # noqa: ANN001
    """Moving op ``u`` from device ``d`` to ``q`` keeps ``q``'s time within ``limit`` and its memory
    within its capacity, or no fuller than ``d`` is now (numpy arrays or lists alike)."""
    return load[q] + time[u] <= limit and used[q] + held[u] <= max(caps[q], used[d] - held[u])


def _move(u: int, d: int, q: int, device, load, used, time, held) -> None:  # noqa: ANN001
    """Op ``u`` moves from device ``d`` to ``q``: its placement, the devices' time and memory."""
    device[u] = q
    load[d] -= time[u]
    load[q] += time[u]
    used[d] -= held[u]
    used[q] += held[u]
