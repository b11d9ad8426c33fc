"""Run a captured training step under a placement, in one process, on K virtual CPU devices.

Each virtual device has its own :class:`ooc.tracker.MemoryTracker`. Ops run in the order the
simulator started them (ties in program order); an op reads an input made on another device from a
copy made for its device (a clone: one per tensor and destination, as the simulator sends one), and
the storages an op creates are counted on its device from its start until the simulator's release
of the node (frees first at one instant, as in the simulator's sweep). Values are dropped once
released and read by every consumer.

What this shows on the CPU: the step's outputs (loss, gradients) under any placement are bit for bit
those of the unpartitioned step, and the bytes the real storages occupy per device reach exactly the
predicted peaks. Not yet: ``cuda:0..K-1`` with copies on side streams; a device's part planned out of
core (keep/swap/recompute) by the existing planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx
from torch.utils._pytree import tree_map

from ooc.partition_capture import CapturedStep, storages
from ooc.scheduler.errors import PlanError
from ooc.scheduler.partition import Devices, Placement, Simulation, simulate
from ooc.tracker import MemoryTracker


@dataclass(frozen=True, eq=False)
class PlacedRun:
    """``outputs``: the step's outputs (loss, then one gradient per parameter); ``peak_bytes``:
    ``(K,)`` measured peak per device; ``copies``: tensors copied between devices;
    ``simulation``: the prediction the run followed."""

    outputs: tuple[Any, ...]
    peak_bytes: np.ndarray
    copies: int
    simulation: Simulation


def run_placed(step: CapturedStep, placement: Placement, devices: Devices) -> PlacedRun:
    """Run ``step`` with node ``i`` of ``step.graph`` on virtual device ``placement.device[i]``."""
    graph = step.graph
    nodes = [n for n in step.gm.graph.nodes if n.op != "output"]
    if len(nodes) != graph.n or placement.device.shape != (graph.n,):
        raise PlanError("the placement and the graph are not of this captured step; capture and place it again")
    sim = simulate(graph, placement, devices)
    device = placement.device.tolist()
    k = devices.k
    position = {node: i for i, node in enumerate(nodes)}
    consumers = [0] * graph.n
    for node in nodes:
        for i in set(node.all_input_nodes):
            consumers[position[i]] += 1
    for i in set(next(n for n in step.gm.graph.nodes if n.op == "output").all_input_nodes):
        consumers[position[i]] += 1   # the step's outputs are handed back: never dropped
    # NOTE: one event list, sorted like the simulator's peak sweep: (time, kind, program position)
    # with kind 0 = free of a positive-length lifetime, 1 = run, 2 = free of a zero-length one.
    n = graph.n
    zero = sim.release <= sim.start
    times = np.concatenate([sim.start, sim.release])
    kinds = np.concatenate([np.ones(n), np.where(zero, 2, 0)])
    pos = np.concatenate([np.arange(n), np.arange(n)])
    events = np.lexsort((pos, kinds, times))
    trackers = [MemoryTracker(1) for _ in range(k)]
    value: dict[int, Any] = {}
    copies: dict[tuple[int, int], Any] = {}
    created: dict[int, dict[int, int]] = {}
    # How many values held now (op outputs and copies) use each storage: an output in a storage in
    # use is a view, not new bytes. Addresses are recycled once freed, so only those in use count.
    live: dict[int, int] = {}
    released = [False] * n
    args = iter(step.args)
    sent = 0
    for e in events.tolist():
        u = e % n
        if e >= n:   # a free
            released[u] = True
            for nbytes in created.pop(u, {}).values():
                trackers[device[u]].free(0, nbytes)
            _maybe_drop(u, value, copies, consumers, released, k, live)
            continue
        node = nodes[u]
        if node.op == "placeholder":
            out = next(args)
        elif node.op == "get_attr":
            out = getattr(step.gm, node.target)
        else:
            def fetch(i: torch.fx.Node, d: int = device[u]) -> Any:
                nonlocal sent
                j = position[i]
                if device[j] == d:
                    return value[j]
                if (j, d) not in copies:
                    copies[(j, d)] = _copy(value[j])
                    _hold(live, copies[(j, d)], +1)
                    sent += 1
                return copies[(j, d)]

            a = torch.fx.node.map_arg(node.args, fetch)
            kw = torch.fx.node.map_arg(node.kwargs, fetch)
            fn = node.target if node.op == "call_function" else getattr(step.gm, node.target)
            out = fn(*a, **kw)
        value[u] = out
        mine = {p: b for p, b in storages(out).items() if p not in live}
        _hold(live, out, +1)
        created[u] = mine
        for nbytes in mine.values():
            trackers[device[u]].alloc(0, nbytes)
        for i in set(node.all_input_nodes):
            j = position[i]
            consumers[j] -= 1
            _maybe_drop(j, value, copies, consumers, released, k, live)
    out_node = next(n for n in step.gm.graph.nodes if n.op == "output")
    outputs = torch.fx.node.map_arg(out_node.args[0], lambda i: value[position[i]])
    return PlacedRun(tuple(outputs), np.array([t.peak for t in trackers], dtype=float), sent, sim)


def _copy(value: Any) -> Any:
    """The tensor(s) as another virtual device receives them: a copy of their own."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)


def _maybe_drop(j: int, value: dict, copies: dict, consumers: list[int], released: list[bool], k: int,
                live: dict[int, int]) -> None:
    """Forget node ``j``'s value and its copies once released and read by every consumer."""
    if released[j] and consumers[j] == 0 and j in value:
        _hold(live, value.pop(j), -1)
        for d in range(k):
            copy = copies.pop((j, d), None)
            if copy is not None:
                _hold(live, copy, -1)


def _hold(live: dict[int, int], value: Any, step: int) -> None:
    for ptr in storages(value):
        count = live.get(ptr, 0) + step
        if count:
            live[ptr] = count
        else:
            del live[ptr]
