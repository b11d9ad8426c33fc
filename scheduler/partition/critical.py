"""ParDNN's makespan refinement, driven by the simulator: walk the simulated critical path and move
the ops that make it wait.

# NOTE [critical-path refinement]
In a simulation each op starts when the last of its constraints is met: its device finishing the op
before it (program order on that device), or an input arriving (made on the same device, or copied
over a link). The critical path is the chain of those binding constraints back from the op that
finishes last; the makespan is its length. Two kinds of link on it can be cut by moving one op:

- a copy: ``u`` waits for its input from ``p`` on another device. Moving ``u`` to ``p``'s device
  removes the copy (``u`` then waits for ``p`` itself);
- contention: ``u`` waits for an op ``w`` of its device that it does not depend on. Moving ``w``
  to another device (the other one most of its neighbours are on, else the least loaded) frees ``u``.

A round proposes the moves of every such link on the path (the end of the path first), applies them
all and simulates; when the result is no shorter, or a device's peak then exceeds its capacity
(memory is checked exactly, by the same simulation), it tries the first half of the moves, then the
first quarter, and so on. When no prefix helps, the next round proposes other moves for the same
links: first (``LINKS``) also the copies queued before a late copy on its link (their consumers
join their producers), then (``PUSH``) the other end of each link (the producer joins the consumer;
the waiting op leaves the busy device); after a round that helps, ``PULL`` again. It stops after
``evaluations`` simulations or when no kind of move helps. Each simulation is O(n + m), so the
refinement costs ``evaluations`` simulations at most, whatever the graph.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from ooc.scheduler.partition.devices import Devices, Placement
from ooc.scheduler.partition.graph import OpGraph
from ooc.scheduler.partition.simulate import Simulation, simulate


@dataclass(frozen=True)
class _Lists:
    """The graph's adjacency as Python lists, made once per refinement (``tolist`` of 100k-node
    arrays costs more than a walk of the path)."""

    pptr: list[int]
    pnode: list[int]
    sptr: list[int]
    snode: list[int]
    uptr: list[int]
    unode: list[int]

    @classmethod
    def of(cls, graph: OpGraph) -> _Lists:
        u_all = np.concatenate([graph.src, graph.dst])
        perm = np.argsort(u_all, kind="stable")
        uptr = np.zeros(graph.n + 1, dtype=np.int64)
        np.cumsum(np.bincount(u_all, minlength=graph.n), out=uptr[1:])
        return cls(graph.pred[0].tolist(), graph.pred[1].tolist(), graph.succ[0].tolist(), graph.succ[1].tolist(),
                   uptr.tolist(), np.concatenate([graph.dst, graph.src])[perm].tolist())


class Move(enum.IntEnum):
    """The kinds of moves :func:`critical_moves` proposes, tried in this order (NOTE
    [critical-path refinement])."""

    PULL = 0
    LINKS = 1
    PUSH = 2


def critical_moves(graph: OpGraph, device: np.ndarray, sim: Simulation, k: int, *, mode: Move = Move.PULL,
                   lists: _Lists | None = None) -> list[tuple[int, int]]:
    """``(op, new device)`` moves that cut the copies and contentions on ``sim``'s critical path
    (see NOTE [critical-path refinement]), from the path's end backwards, each op at most once.
    ``mode``: which of the moves of that NOTE to propose."""
    n = graph.n
    if n == 0:
        return []
    g = lists or _Lists.of(graph)
    dev = device.tolist()
    start, finish = sim.start.tolist(), sim.finish.tolist()
    rows = sim.transfers
    node, src, dst = (rows[:, c].astype(np.int64) for c in range(3))
    row_of = np.full(n * k, -1, dtype=np.int64)
    row_of[node * k + dst] = np.arange(rows.shape[0])
    # The copy sent just before each one on its link (rows are in sending order).
    by_link = np.lexsort((np.arange(rows.shape[0]), src * k + dst))
    before = np.full(rows.shape[0], -1, dtype=np.int64)
    same = (src * k + dst)[by_link[1:]] == (src * k + dst)[by_link[:-1]]
    before[by_link[1:][same]] = by_link[:-1][same]
    row_of_l, before_l = row_of.tolist(), before.tolist()
    sent, arrived = rows[:, 3].tolist(), rows[:, 4].tolist()
    # The op run before each op on its device: program order within each device.
    seq = graph.order[np.argsort(device[graph.order], kind="stable")]
    prev = np.full(n, -1, dtype=np.int64)
    follows = device[seq[1:]] == device[seq[:-1]]
    prev[seq[1:][follows]] = seq[:-1][follows]
    prev_l = prev.tolist()
    load = np.bincount(device, weights=graph.time_s, minlength=k)
    by_load = np.argsort(load, kind="stable").tolist()
    moves: list[tuple[int, int]] = []
    seen: set[int] = set()
    u = int(np.argmax(sim.finish))
    while u >= 0:
        d = dev[u]
        bind, bind_t, copy = -1, -1.0, -1
        for i in range(g.pptr[u], g.pptr[u + 1]):
            p = g.pnode[i]
            r = -1 if dev[p] == d else row_of_l[p * k + d]
            t = finish[p] if r < 0 else arrived[r]
            if t > bind_t:
                bind, bind_t, copy = p, t, r
        w = prev_l[u]
        if w >= 0 and finish[w] > bind_t and finish[w] >= start[u]:
            # Contention: u waits for w, which it does not read.
            x = u if mode == Move.PUSH else w
            if x not in seen:
                seen.add(x)
                moves.append((x, _elsewhere(x, dev, g, by_load, k)))
            u = w
            continue
        if bind < 0 or bind_t < start[u]:
            break
        if copy >= 0:
            x, q = (bind, d) if mode == Move.PUSH else (u, dev[bind])
            if x not in seen:
                seen.add(x)
                moves.append((x, q))
            r, wait_until = (before_l[copy] if mode == Move.LINKS else -1), sent[copy]
            while r >= 0 and wait_until > finish[bind] and arrived[r] >= wait_until:
                # The copy waited for its link: the copies sent before it there hold the path too.
                w, a, b = int(node[r]), dev[int(node[r])], int(dst[r])
                for i in range(g.sptr[w], g.sptr[w + 1]):
                    v = g.snode[i]
                    if dev[v] == b and v not in seen:
                        seen.add(v)
                        moves.append((v, a))
                wait_until = sent[r]
                if wait_until <= finish[w]:
                    break
                r = before_l[r]
        u = bind
    return moves


def refine_makespan(graph: OpGraph, devices: Devices, device: np.ndarray, sim: Simulation, *,
                    evaluations: int = 24) -> tuple[np.ndarray, Simulation]:
    """The placement ``device`` (``(n,)``, simulated as ``sim``) after critical-path refinement
    (NOTE [critical-path refinement]), with at most ``evaluations`` more simulations; a placement
    that fits its devices' memory keeps fitting."""
    k = devices.k
    fits = sim.fits(devices)
    lists = _Lists.of(graph)
    best, best_sim = device.copy(), sim
    spent = 0
    mode = Move.PULL
    while spent < evaluations:
        moves = critical_moves(graph, best, best_sim, k, mode=mode, lists=lists)
        improved = False
        take = len(moves)
        while take > 0 and spent < evaluations:
            trial = best.copy()
            at, to = np.asarray(moves[:take], dtype=np.int64).T
            trial[at] = to
            got = simulate(graph, Placement.of("pardnn", trial, k, graph.n), devices)
            spent += 1
            # A placement that fits keeps fitting; one that does not may not overflow more.
            roomy = got.fits(devices) or (not fits and got.overflow(devices).max() <= best_sim.overflow(devices).max())
            if got.makespan < best_sim.makespan * (1 - 1e-9) and roomy:
                best, best_sim, improved = trial, got, True
                break
            take //= 2
        if improved:
            mode = Move.PULL
        elif mode == Move.PUSH:
            break
        else:
            mode += 1
    return best, best_sim


def _elsewhere(w: int, dev: list[int], g: _Lists, by_load: list[int], k: int) -> int:
    """Where op ``w`` goes to get out of the way: the other device most of its neighbours are on,
    else the least loaded other device."""
    d = dev[w]
    count = [0] * k
    for i in range(g.uptr[w], g.uptr[w + 1]):
        count[dev[g.unode[i]]] += 1
    count[d] = -1
    q = max(range(k), key=count.__getitem__)
    if count[q] > 0:
        return q
    return next(x for x in by_load if x != d)
