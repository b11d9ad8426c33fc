"""Selective-recompute options of one block: which op outputs a RECOMPUTE block should cache.

NOTE [op-level options]
A RECOMPUTE block with cached set ``C`` (``BlockPlan.cached_ops``, NOTE [op-level profile] in
``ooc.scheduler.profile``) holds ``sum(output_bytes[c] for c in C)`` more bytes on the device from
its forward to its backward, and its re-run at backward skips ``sum(forward_s[c] for c in C)``
seconds. Choosing ``C`` is a 0/1 knapsack over the block's cacheable ops (weight: output bytes,
value: forward seconds); which point of it is best depends on the rest of the chain and the budget,
so the chain planner is handed a few of its exact Pareto-optimal points and picks one per block
(as Rockmate hands Rotor a block's options). The frontier is computed exactly by the
Nemhauser-Ullmann sweep: add the ops one at a time, keep only the (bytes, seconds) pairs no other
subset beats on both. The points handed on lie on the frontier's upper concave hull (the only ones
a priced search over the chain can prefer), spread along it; the hull's points are the prefixes of
the ops sorted by seconds saved per byte (the fractional knapsack's breakpoints), which makes the
options of a 50-op block cost microseconds, where the full frontier (hundreds of points) costs
milliseconds: :func:`pareto_frontier` is the exact reference the tests hold the hull to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ooc.scheduler.profile import OpProfile


@dataclass(frozen=True)
class CachedSet:
    """One point of a block's frontier.

    - ``ops``: increasing op indices into the block's ``ops`` (a ``BlockPlan.cached_ops``).
    - ``bytes``: device bytes the cached outputs hold from the forward to the backward.
    - ``saved_s``: seconds of the block's forward the re-run no longer spends.
    - ``autograd_bytes``: the part of ``bytes`` autograd saves anyway (the re-run need not
      allocate it again).
    """

    ops: tuple[int, ...]
    bytes: int
    saved_s: float
    autograd_bytes: int = 0


def pareto_frontier(ops: Sequence[OpProfile]) -> list[CachedSet]:
    """Every Pareto-optimal cached set of a block's ``ops``: sorted by bytes, strictly increasing in
    both bytes and seconds saved, starting with the empty set (or the set of the free ops: cacheable
    ops that create no storage but take time, which every point includes). Exact."""
    free = [k for k, op in enumerate(ops) if op.cacheable and op.output_bytes == 0 and op.forward_s > 0]
    items = [k for k, op in enumerate(ops) if op.cacheable and op.output_bytes > 0 and op.forward_s > 0]
    weight = np.zeros(1, dtype=np.int64)
    value = np.array([sum(ops[k].forward_s for k in free)])
    parents: list[np.ndarray] = []
    took: list[np.ndarray] = []
    for k in items:
        w = np.concatenate([weight, weight + ops[k].output_bytes])
        v = np.concatenate([value, value + ops[k].forward_s])
        parent = np.concatenate([np.arange(len(weight)), np.arange(len(weight))])
        added = np.concatenate([np.zeros(len(weight), dtype=bool), np.ones(len(weight), dtype=bool)])
        order = np.lexsort((-v, w))  # by bytes, then most seconds first
        w, v, parent, added = w[order], v[order], parent[order], added[order]
        best_before = np.concatenate([[-np.inf], np.maximum.accumulate(v)[:-1]])
        keep = v > best_before  # no lighter-or-equal subset saves as much
        weight, value = w[keep], v[keep]
        parents.append(parent[keep])
        took.append(added[keep])
    points = []
    for p in range(len(weight)):
        chosen, row = list(free), p
        for layer in range(len(items) - 1, -1, -1):
            if took[layer][row]:
                chosen.append(items[layer])
            row = parents[layer][row]
        points.append(CachedSet(tuple(sorted(chosen)), int(weight[p]), float(value[p])))
    return points


def upper_hull(points: Sequence[CachedSet]) -> list[CachedSet]:
    """The vertices of the upper concave hull of a frontier (sorted by bytes), from its first point."""
    hull: list[CachedSet] = []
    for p in points:
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b lies on or under the chord from a to p: it is no vertex.
            if (b.saved_s - a.saved_s) * (p.bytes - a.bytes) <= (p.saved_s - a.saved_s) * (b.bytes - a.bytes):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def _hull_order(ops: Sequence[OpProfile]) -> tuple[list[int], list[int]]:
    """The free ops (cacheable, no storage, some time: every point caches them) and the other
    cacheable ops with time and bytes, most seconds per byte first (ties: by index)."""
    free = [k for k, op in enumerate(ops) if op.cacheable and op.output_bytes == 0 and op.forward_s > 0]
    items = [k for k, op in enumerate(ops) if op.cacheable and op.output_bytes > 0 and op.forward_s > 0]
    items.sort(key=lambda k: (-ops[k].forward_s / ops[k].output_bytes, k))
    return free, items


def _prefix(ops: Sequence[OpProfile], free: list[int], items: list[int], length: int) -> CachedSet:
    chosen = sorted(free + items[:length])
    return CachedSet(tuple(chosen), sum(ops[k].output_bytes for k in chosen), sum(ops[k].forward_s for k in chosen),
                     sum(ops[k].saved_bytes for k in chosen))


def hull_prefixes(ops: Sequence[OpProfile]) -> list[CachedSet]:
    """The upper concave hull of the frontier, fast: the fractional knapsack's breakpoints are the
    prefixes of the ops sorted by seconds per byte, so those prefixes are the hull's points (the
    vertices, and points on its edges where ops tie). Equal to :func:`upper_hull` of
    :func:`pareto_frontier` up to points on edges (a test holds it)."""
    free, items = _hull_order(ops)
    return [_prefix(ops, free, items, length) for length in range(len(items) + 1)]


def selective_sets(ops: Sequence[OpProfile], count: int = 4) -> tuple[CachedSet, ...]:
    """Up to ``count`` non-empty cached sets for the chain planner (NOTE [op-level options]): points
    of the frontier's upper hull (:func:`hull_prefixes`), spread evenly along it (by index) when it
    has more. Empty when the block has no op worth caching. ``O(k log k + count * k)`` for ``k`` ops."""
    if count <= 0 or not ops:
        return ()
    free, items = _hull_order(ops)
    lengths = list(range(0 if free else 1, len(items) + 1))
    if len(lengths) > count:
        last = len(lengths) - 1
        lengths = [lengths[i] for i in sorted({round(j * last / max(1, count - 1)) for j in range(count)})]
    return tuple(_prefix(ops, free, items, length) for length in lengths)
