"""Path lengths on a graph whose every edge is cut: the top and bottom levels that ParDNN and HEFT
rank ops by."""

from __future__ import annotations

import numpy as np

from ooc.scheduler.partition.devices import Devices
from ooc.scheduler.partition.graph import OpGraph


def edge_seconds(graph: OpGraph, devices: Devices) -> np.ndarray:
    """``(m,)`` seconds each edge costs when it crosses devices: latency + bytes / bandwidth."""
    return devices.latency_s + graph.edge_bytes / devices.bandwidth_Bps


def top_bottom_levels(graph: OpGraph, comm_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(n,)`` top level (longest path from an entry to the op's start) and ``(n,)`` bottom level
    (longest path from the op's start to an exit, its own time included), edges costing
    ``comm_s``. Their sum is the length of the longest path through the op."""
    n = graph.n
    time = graph.time_s.tolist()
    comm = comm_s.tolist()
    top, bottom = [0.0] * n, [0.0] * n
    pptr, pnode, pedge = (a.tolist() for a in graph.pred)
    sptr, snode, sedge = (a.tolist() for a in graph.succ)
    order = graph.order.tolist()
    for u in order:
        best = 0.0
        for i in range(pptr[u], pptr[u + 1]):
            p = pnode[i]
            t = top[p] + time[p] + comm[pedge[i]]
            if t > best:
                best = t
        top[u] = best
    for u in reversed(order):
        best = 0.0
        for i in range(sptr[u], sptr[u + 1]):
            t = comm[sedge[i]] + bottom[snode[i]]
            if t > best:
                best = t
        bottom[u] = time[u] + best
    return np.asarray(top), np.asarray(bottom)
