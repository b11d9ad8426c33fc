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
a priced search over the chain can prefer), those where it bends most between plain RECOMPUTE and
keeping the whole block (``selective_sets``); the hull's points are the prefixes of
the ops sorted by seconds saved per byte (the fractional knapsack's breakpoints), which makes the
options of a 50-op block cost microseconds, where the full frontier (hundreds of points) costs
milliseconds: :func:`pareto_frontier` is the exact reference the tests hold the hull to.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
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
    free, items = _worth_caching(ops)
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


def _worth_caching(ops: Sequence[OpProfile]) -> tuple[list[int], list[int]]:
    """The free ops (cacheable, no storage, some time: every point caches them) and the other
    cacheable ops with time and bytes, in order; only ops a re-run reaches (``OpProfile.replayed``:
    caching one after the block's last save skips nothing)."""
    worth = [k for k, op in enumerate(ops) if op.cacheable and op.replayed and op.forward_s > 0]
    return [k for k in worth if ops[k].output_bytes == 0], [k for k in worth if ops[k].output_bytes > 0]


def _hull_order(ops: Sequence[OpProfile]) -> tuple[list[int], list[int]]:
    """``_worth_caching``'s free ops and the others most seconds per byte first (ties: by index)."""
    free, items = _worth_caching(ops)
    items.sort(key=lambda k: (-ops[k].forward_s / ops[k].output_bytes, k))
    return free, items


def _prefix(ops: Sequence[OpProfile], free: list[int], items: list[int], length: int,
            graph: tuple | None = None) -> CachedSet:
    """The first ``length`` items with the free ops (``graph``: the block's ``_rerun_graph``)."""
    chosen = _without_skipped(graph, sorted(free + items[:length]))
    return CachedSet(tuple(chosen), sum(ops[k].output_bytes for k in chosen), _saved_s(ops, graph, chosen),
                     sum(ops[k].saved_bytes for k in chosen))


def rerun_skipped(ops: Sequence[OpProfile], cached: Collection[int]) -> frozenset[int]:
    """The uncached ops a selective re-run with ``cached`` leaves out (NOTE [ops a re-run skips]);
    empty when the profile did not record what each op reads (``OpProfile.reads``)."""
    graph = _rerun_graph(ops)
    return dead_ops(frozenset(cached), *graph) if graph is not None else frozenset()


def _rerun_graph(ops: Sequence[OpProfile]) -> tuple[list[list[int]], list[bool], list[bool]] | None:
    """What ``dead_ops`` reads of a block's profile (its readers, skippable and passive ops), made
    once per block; ``None`` when the profile did not record what each op reads."""
    if not ops or any(op.reads is None for op in ops):
        return None
    returned = _returned(ops)
    readers: list[list[int]] = [[] for _ in ops]
    for r, op in enumerate(ops):
        for k in op.reads:
            readers[k].append(r)
    skippable = [op.cacheable and op.output_bytes > 0 and op.saved_bytes == 0 and k not in returned
                 and not op.outlives_forward for k, op in enumerate(ops)]
    # A profile records no reads for a view op (what reads through the view reads the storage), so
    # every reader it records computes: one that holds no byte on the device (an empty result, a
    # copy to the host) is no view (it is cacheable, a view is not), and the runtime runs it.
    passive = [False] * len(ops)
    return readers, skippable, passive


def dead_ops(cached: frozenset[int], readers: Sequence[Sequence[int]], skippable: Sequence[bool],
             passive: Sequence[bool]) -> frozenset[int]:
    """The ops of a block's re-run whose outputs nothing needs, given the ``cached`` ops.

    NOTE [ops a re-run skips]
    A selective re-run takes the cached ops' outputs from the cache, so an uncached op whose
    output only cached ops read computes something nobody uses: the re-run hands its readers an
    uninitialised tensor of the same shape, strides and dtype instead (allocated as the op would,
    so the re-run's memory walk is unchanged, and no kernel runs). Op ``k`` is left out when:
    - it is ``skippable[k]``: deterministic (cacheable), creates storages, none of which autograd
      saves or the block returns (so no backward and no later block ever reads those bytes), nor
      anything else holds after the forward (``OpProfile.outlives_forward``: autocast's cache, an
      attribute; what holds the forward's output would hold the re-run's);
    - some op that computes reads its storages, and every op that reads them (``readers[k]``, all
      later than ``k``) is cached, left out itself, or ``passive``: an op that makes only views
      (what reads it through the view is a reader of the same storage, so it is in ``readers[k]``
      too). An output no computing op reads is not left out: what reads it then reads it where no
      dispatch is seen (a Triton kernel launched directly, ``.tolist()``), or the block stores it
      aside (an attribute, a hook's list), where a re-run must put what the forward put.
    One pass from the last op back decides it (readers come later). The planner prices the re-run
    with these ops' time saved (``rerun_saved_s``), from the profile's ``OpProfile.reads``; the
    runtime decides the same with this function from what the block's forward did (NOTE [the
    re-run leaves ops out] in ``ooc.op_profile``), and refuses a re-run in which a computing op
    reads a left-out output or autograd saves one."""
    dead: set[int] = set()
    for k in reversed(range(len(readers))):
        if k in cached or not skippable[k]:
            continue
        computing = [r for r in readers[k] if not passive[r]]
        if computing and all(r in cached or r in dead for r in computing):
            dead.add(k)
    return frozenset(dead)


def rerun_saved_s(ops: Sequence[OpProfile], cached: Collection[int]) -> float:
    """Forward seconds a selective re-run with ``cached`` does not spend: the cached ops and the ops
    it leaves out (NOTE [ops a re-run skips]); none with nothing cached (a plain re-run)."""
    return _saved_s(ops, _rerun_graph(ops), cached)


def _saved_s(ops: Sequence[OpProfile], graph: tuple | None, cached: Collection[int]) -> float:
    if not cached:
        return 0.0
    skipped = dead_ops(frozenset(cached), *graph) if graph is not None else frozenset()
    return sum(ops[k].forward_s for k in set(cached) | skipped if ops[k].replayed)


def _without_skipped(graph: tuple | None, cached: list[int]) -> list[int]:
    """``cached`` less the ops a re-run caching the others would leave out anyway; it skips the
    same ops, holding less. One pass from the last op back, as ``dead_ops`` (whose rule it is, with
    cached ops eligible too): whether an op can go depends only on the later ops that read it, so
    dropping one never changes the fate of a later one."""
    if not cached or graph is None:
        return cached
    readers, skippable, passive = graph
    kept, dead = set(cached), set()
    for k in reversed(range(len(readers))):
        if not skippable[k]:
            continue
        computing = [r for r in readers[k] if not passive[r]]
        if computing and all(r in kept or r in dead for r in computing):
            kept.discard(k)
            dead.add(k)
    return sorted(kept)


def hull_prefixes(ops: Sequence[OpProfile]) -> list[CachedSet]:
    """The upper concave hull of the frontier, fast: the fractional knapsack's breakpoints are the
    prefixes of the ops sorted by seconds per byte, so those prefixes are the hull's points (the
    vertices, and points on its edges where ops tie). Equal to :func:`upper_hull` of
    :func:`pareto_frontier` up to points on edges (a test holds it)."""
    free, items = _hull_order(ops)
    return [_prefix(ops, free, items, length) for length in range(len(items) + 1)]


def _vertices(points: list[tuple[int, float]], keep: int) -> list[int]:
    """Indices of the ``keep`` interior points of a concave polyline (first and last fixed) that
    lose the least when the others are dropped: repeatedly drop the interior point nearest (in
    seconds, vertically) to the chord of its neighbours. That distance is the most a block loses
    by not having the point at any price of memory (at the chord's slope), so what stays are the
    sharp bends of the frontier, wherever they are (Visvalingam's simplification, measured
    vertically)."""
    alive = list(range(len(points)))

    def loss(a: int, j: int, c: int) -> float:
        (wa, va), (wj, vj), (wc, vc) = points[a], points[j], points[c]
        return vj - (va + (vc - va) * (wj - wa) / (wc - wa)) if wc > wa else 0.0

    while len(alive) - 2 > keep:
        worst = min(range(1, len(alive) - 1), key=lambda t: loss(alive[t - 1], alive[t], alive[t + 1]))
        del alive[worst]
    return alive[1:-1]


def selective_sets(ops: Sequence[OpProfile], count: int = 4, keep: tuple[int, float] | None = None) -> tuple[CachedSet, ...]:
    """Up to ``count`` non-empty cached sets for the chain planner (NOTE [op-level options]): points
    of the frontier's upper hull (:func:`hull_prefixes`). When it has more, the ``count`` that bend
    it most (:func:`_vertices`) between plain RECOMPUTE (nothing cached) and ``keep``: (bytes held
    beyond RECOMPUTE's, forward seconds) of keeping the whole block, the option the chain planner
    has beside these (default: caching every cacheable op). Hull points that keeping the block
    beats at every price are dropped first. Empty when the block has no op worth caching.

    Where the profile records what each op reads, each prefix leaves out the cached ops its re-run
    would skip anyway (NOTE [ops a re-run skips]: a GPT block that caches the softmax need not also
    hold the scores it was computed from), and is priced with the ops its re-run skips; those
    prefixes are no longer sorted by bytes, so the ones another beats on both counts go first."""
    if count <= 0 or not ops:
        return ()
    free, items = _hull_order(ops)
    first = 0 if free else 1
    graph = _rerun_graph(ops)
    candidates = _undominated([_prefix(ops, free, items, length, graph) for length in range(first, len(items) + 1)])
    if len(candidates) <= count:
        return tuple(candidates)
    # The origin: the free ops alone (a candidate), or nothing cached (plain RECOMPUTE, not one).
    sets = candidates if free else [CachedSet((), 0, 0.0), *candidates]
    points = [(c.bytes, c.saved_s) for c in sets]
    end = keep if keep is not None else points[-1]
    # Only the points above the chord to ``end`` can be chosen at some price; the rest go first.
    hull = [0]
    for j in range(1, len(points)):
        if points[j][0] < end[0]:
            while len(hull) >= 2 and _below(points[hull[-2]], points[hull[-1]], points[j]):
                hull.pop()
            hull.append(j)
    while len(hull) >= 2 and _below(points[hull[-2]], points[hull[-1]], end):
        hull.pop()
    room = count - (1 if free else 0)  # caching the free ops alone is always worth a slot
    chosen = _vertices([points[j] for j in hull] + [end], room) if len(hull) - 1 > room else list(range(1, len(hull)))
    return tuple(sets[j] for j in ([0] if free else []) + [hull[t] for t in chosen])


def _undominated(sets: list[CachedSet]) -> list[CachedSet]:
    """``sets`` sorted by bytes, without those another holds no more bytes for and saves at least as
    much time (nor duplicates)."""
    kept: list[CachedSet] = []
    for c in sorted(sets, key=lambda c: (c.bytes, -c.saved_s, c.ops)):
        if not kept or c.saved_s > kept[-1].saved_s:
            kept.append(c)
    return kept


def _below(a: tuple[int, float], b: tuple[int, float], c: tuple[int, float]) -> bool:
    """``b`` lies on or under the chord from ``a`` to ``c`` (points sorted by bytes)."""
    return (b[1] - a[1]) * (c[0] - a[0]) <= (c[1] - a[1]) * (b[0] - a[0])


def window_swaps(ops: Sequence[OpProfile], cached: Sequence[int], *, window_s: float, bandwidth: float,
                 latency_s: float = 0.0, taken_s: float = 0.0) -> tuple[int, ...]:
    """Which of a selective RECOMPUTE's ``cached`` ops to swap (``BlockPlan.swapped_ops``).

    NOTE [window swaps]
    A swapped cached output (NOTE [swapped cached ops] in ``ooc.scheduler.schedule``) leaves the
    device at the RELEASE after the next block's forward and comes back before the block's
    re-run: the re-run still skips it, and the bytes stop counting in between. Its copy out runs
    under the next block's forward (``window_s``, less the link's ``latency_s`` and ``taken_s``:
    the copy of what the block swaps already, its input with ``swap_input``); its copy back runs
    under the backward of the blocks in the prefetch window, about twice as long, so the way out is
    the binding window. The rule:
    - the cached ops are taken most seconds saved per byte first (the outputs most worth caching
      are the ones most worth keeping cached by moving them rather than dropping them), and each
      one whose copy (``output_bytes / bandwidth``) still fits what is left of the window is swapped
      (first fit: a large op that no longer fits does not stop smaller ones after it);
    - an op slower to re-run than to copy out and back (``forward_s > 2 * output_bytes /
      bandwidth``) is swapped even past the window: an exposed copy costs less than not caching it;
    - never an op whose output the block returns (the next block's input, which the runtime does
      not swap as a cached output): those marked ``returned`` in a measured profile, else the
      block's last op and its last op that creates a storage; nor ops that create no storage.
    The chain planner then decides, with the exact peak and the copies' exposed time in its model,
    whether the swapped variant is worth its copies (``ooc.scheduler.costmodel._add_selective``)."""
    if bandwidth <= 0:
        return ()
    returned = _returned(ops)
    candidates = [k for k in cached if k not in returned and 0 <= k < len(ops) and ops[k].output_bytes > 0
                  and ops[k].replayed]
    candidates.sort(key=lambda k: (-ops[k].forward_s / ops[k].output_bytes, k))
    room = window_s - latency_s - taken_s
    chosen = []
    for k in candidates:
        copy_s = ops[k].output_bytes / bandwidth
        if copy_s <= room:
            chosen.append(k)
            room -= copy_s
        elif ops[k].forward_s > 2 * copy_s:
            chosen.append(k)
    return tuple(sorted(chosen))


def _returned(ops: Sequence[OpProfile]) -> set[int]:
    """The ops whose outputs the block returns: those a measured profile marks; in a profile
    without marks (analytic, hand-written, or measured before ``OpProfile.returned``), the last op
    and the last op that creates a storage (a block returning a view of its residual add ends with
    the view, which creates none)."""
    marked = {k for k, op in enumerate(ops) if op.returned}
    if marked or not ops:
        return marked
    storing = [k for k, op in enumerate(ops) if op.output_bytes > 0]
    return {len(ops) - 1, *storing[-1:]}


@dataclass(frozen=True)
class SwappedSet:
    """A cached set with some of its outputs swapped (``BlockPlan.cached_ops`` / ``swapped_ops``);
    ``resident``: the bytes its cached outputs hold on the device once the swapped ones are released."""

    cached: CachedSet
    swapped: tuple[int, ...]
    resident: int


def swapped_sets(ops: Sequence[OpProfile], sets: Sequence[CachedSet], count: int, *, window_s: float, bandwidth: float,
                 latency_s: float = 0.0, taken_s: float = 0.0) -> list[SwappedSet]:
    """Up to ``count`` swapped variants of a block's selective options ``sets`` (NOTE [window
    swaps]), fewest resident bytes first.

    The candidates: each unswapped point (the free ops alone, then each of ``sets``: prefixes of
    the ops by seconds per byte) as it is, and extended by the next ops of that order whose copies
    still fit the window (first fit; never an op the block returns); :func:`window_swaps` picks what of each
    goes to the host. Kept: those that skip more seconds than any unswapped point holding no more
    (else the link buys nothing), then the vertices of the upper hull of (resident bytes, seconds
    skipped) (the points a priced search over the chain can prefer), the ``count`` holding least:
    the tight budgets, where the window's bytes matter most, choose among them."""
    if count <= 0 or bandwidth <= 0:
        return []
    free, items = _hull_order(ops)
    returned = _returned(ops)
    graph = _rerun_graph(ops)
    plain = [(sum(ops[k].output_bytes for k in free), sum(ops[k].forward_s for k in free))]
    plain += [(s.bytes, s.saved_s) for s in sets]
    lengths = sorted({0, *(len(s.ops) - len(free) for s in sets)})
    found: dict[tuple[int, ...], SwappedSet] = {}
    for length, extend in ((length, extend) for length in lengths for extend in (False, True)):
        room = window_s - latency_s - taken_s
        chosen = list(items[:length])
        for k in items[length:] if extend else ():
            copy_s = ops[k].output_bytes / bandwidth
            if k not in returned and copy_s <= room:
                chosen.append(k)
                room -= copy_s
        cached = _prefix(ops, free, chosen, len(chosen), graph)
        swapped = window_swaps(ops, cached.ops, window_s=window_s, bandwidth=bandwidth, latency_s=latency_s, taken_s=taken_s)
        if not swapped or cached.ops in found:
            continue
        resident = cached.bytes - sum(ops[k].output_bytes for k in swapped)
        if cached.saved_s > max((s for b, s in plain if b <= resident), default=0.0):
            found[cached.ops] = SwappedSet(cached, swapped, resident)
    hull: list[SwappedSet] = []
    for p in sorted(found.values(), key=lambda v: (v.resident, -v.cached.saved_s)):
        if hull and p.cached.saved_s <= hull[-1].cached.saved_s:
            continue  # as many resident bytes or more for no more seconds: not Pareto-optimal
        while len(hull) >= 2 and _below((hull[-2].resident, hull[-2].cached.saved_s), (hull[-1].resident, hull[-1].cached.saved_s),
                                        (p.resident, p.cached.saved_s)):
            hull.pop()
        hull.append(p)
    return hull[:count]
