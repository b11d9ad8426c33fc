"""The op graph that ``ooc.scheduler.partition`` places on devices: a frozen DAG whose nodes are ops
(time, bytes they hold) and whose edges are tensors (bytes they carry), plus ParDNN's plain-text
format, so the reference implementation (github.com/ParCoreLab/pardnn) runs on the very same graphs.

# NOTE [ParDNN's files]
ParDNN's ``src/utils.cpp`` reads a folder named by ``settings.json``: ``crn_src_sink_low.dot``
(one edge a line, ``a -> b``; blanks and quotes are dropped, so names must not hold them; the
graph has one entry ``src`` and one exit ``snk``), ``nodes_average_durations_fixed.txt``
(``name::duration`` in whole microseconds, read with ``stoi``), ``tensors_sz_32_low.txt``
(``name::bytes`` of the node's output, charged on each of its out-edges as
``bytes / rate + latency``), ``memory.txt`` (``name::bytes`` the node holds, read when
``BALANCE_MEMORY``), and the node-class lists ``var_nodes.txt``, ``ref_nodes.txt``, ``no_ops.txt``,
``cpu_nodes.txt`` (we write them empty). ``COMM_TRANSFER_RATE`` is in GB/s (ParDNN multiplies it by
1000 to get bytes per microsecond), ``COMM_LATENCY`` in microseconds. ParDNN keeps one output size a
node; our edges carry their own bytes, so the export writes each node's largest out-edge.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from ooc.scheduler.errors import PlanError

PARDNN_GRAPH = "crn_src_sink_low.dot"
PARDNN_TIMES = "nodes_average_durations_fixed.txt"
PARDNN_OUTPUT_BYTES = "tensors_sz_32_low.txt"
PARDNN_MEMORY = "memory.txt"
PARDNN_EMPTY_LISTS = ("var_nodes.txt", "ref_nodes.txt", "no_ops.txt", "cpu_nodes.txt")
PARDNN_SOURCE, PARDNN_SINK = "src", "snk"
_NAME = re.compile(r"^[^\s\"]+$")


class GraphError(PlanError):
    """An op graph that cannot be partitioned: a cycle, a negative or non-finite time or size, an
    edge to a node that does not exist, a file that is not in ParDNN's format."""


@dataclass(frozen=True, eq=False)
class OpGraph:
    """A DAG of ``n`` ops and ``m`` tensors between them.

    ``names``: ``n`` unique op names; ``time_s``: ``(n,)`` float seconds each op runs;
    ``held_bytes``: ``(n,)`` bytes each op's output holds on its device, from the op's start until
    its last consumer ends; ``src``/``dst``: ``(m,)`` int node indices of each edge;
    ``edge_bytes``: ``(m,)`` bytes each edge carries when it crosses devices. Build with
    :meth:`build`, which checks everything; the arrays are read-only.
    """

    names: tuple[str, ...]
    time_s: np.ndarray
    held_bytes: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    edge_bytes: np.ndarray
    index: dict[str, int] = field(repr=False, compare=False)

    @classmethod
    def build(cls, names: list[str] | tuple[str, ...], time_s, held_bytes, edges, edge_bytes=None) -> OpGraph:
        """A checked graph. ``edges``: pairs of node names or indices; ``edge_bytes``: one per edge,
        or ``None`` to carry the producer's ``held_bytes`` on each of its out-edges."""
        names = tuple(str(n) for n in names)
        n = len(names)
        index = {name: i for i, name in enumerate(names)}
        if len(index) != n:
            dup = sorted({x for x in names if names.count(x) > 1})[:5]
            raise GraphError(f"node names must be unique; repeated: {dup}")
        time = _array(time_s, n, "time_s", float)
        held = _array(held_bytes, n, "held_bytes", float)
        pairs = list(edges)
        src = np.empty(len(pairs), dtype=np.int64)
        dst = np.empty(len(pairs), dtype=np.int64)
        for e, (a, b) in enumerate(pairs):
            src[e], dst[e] = _node(a, index, n), _node(b, index, n)
        if np.any(src == dst):
            e = int(np.flatnonzero(src == dst)[0])
            raise GraphError(f"edge {names[src[e]]} -> {names[dst[e]]} is a self-loop; an op cannot feed itself")
        carried = held[src] if edge_bytes is None else _array(edge_bytes, len(pairs), "edge_bytes", float)
        for a in (time, held, src, dst, carried):
            a.setflags(write=False)
        graph = cls(names, time, held, src, dst, carried, index)
        _ = graph.order  # raises GraphError on a cycle: at build time rather than later
        return graph

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def m(self) -> int:
        return int(self.src.shape[0])

    @cached_property
    def succ(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """CSR of out-edges: ``(ptr (n+1,), node (m,), edge id (m,))``."""
        return _csr(self.src, self.dst, self.n)

    @cached_property
    def pred(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """CSR of in-edges: ``(ptr (n+1,), node (m,), edge id (m,))``."""
        return _csr(self.dst, self.src, self.n)

    @cached_property
    def order(self) -> np.ndarray:
        """``(n,)`` a topological order: the nodes' own order when it is one (the order the ops
        ran), else Kahn's order. Raises :class:`GraphError` on a cycle."""
        if np.all(self.src < self.dst):
            return np.arange(self.n)
        ptr, nxt, _ = self.succ
        indeg = np.bincount(self.dst, minlength=self.n).tolist()
        stack = [i for i in range(self.n - 1, -1, -1) if indeg[i] == 0]
        out: list[int] = []
        ptr_l, nxt_l = ptr.tolist(), nxt.tolist()
        while stack:
            u = stack.pop()
            out.append(u)
            for v in reversed(nxt_l[ptr_l[u]:ptr_l[u + 1]]):
                indeg[v] -= 1
                if indeg[v] == 0:
                    stack.append(v)
        if len(out) != self.n:
            stuck = [self.names[i] for i in range(self.n) if indeg[i] > 0][:5]
            raise GraphError(f"the graph has a cycle through (among others) {stuck}; "
                             "a training step's op graph is acyclic")
        return np.asarray(out, dtype=np.int64)

    @cached_property
    def levels(self) -> np.ndarray:
        """``(n,)`` int: 0 for ops without inputs, else one more than the deepest input."""
        level = [0] * self.n
        pptr, pnode, _ = self.pred
        pptr_l, pnode_l = pptr.tolist(), pnode.tolist()
        for u in self.order.tolist():
            a, b = pptr_l[u], pptr_l[u + 1]
            if a < b:
                level[u] = 1 + max(level[p] for p in pnode_l[a:b])
        return np.asarray(level, dtype=np.int64)

    def total_time(self) -> float:
        return float(self.time_s.sum())

    def total_bytes(self) -> float:
        return float(self.held_bytes.sum())


def _array(values, n: int, what: str, dtype) -> np.ndarray:
    try:
        a = np.array(values, dtype=dtype).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise GraphError(f"{what} must be numbers: {exc}") from None
    if a.shape[0] != n:
        raise GraphError(f"{what} has {a.shape[0]} entries for {n} items; give one each")
    bad = ~np.isfinite(a) | (a < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise GraphError(f"{what}[{i}] = {a[i]!r}; every entry must be a finite number >= 0")
    return a


def _node(ref, index: dict[str, int], n: int) -> int:
    if isinstance(ref, (int, np.integer)) and not isinstance(ref, bool):
        if not 0 <= int(ref) < n:
            raise GraphError(f"edge names node {int(ref)}, but the graph has nodes 0..{n - 1}")
        return int(ref)
    if ref not in index:
        raise GraphError(f"edge names node {ref!r}, which is not in the graph; list every node")
    return index[ref]


def _csr(a: np.ndarray, b: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    perm = np.argsort(a, kind="stable")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(a, minlength=n), out=ptr[1:])
    return ptr, b[perm], perm


# ---------------------------------------------------------------------------------------------
# ParDNN's plain-text format


def write_pardnn(graph: OpGraph, folder: str | Path, *, devices: int = 2, capacity_bytes: int = 32 * 2**30,
                 bandwidth_Bps: float = 140e9, latency_s: float = 25e-6) -> Path:
    """Write ``graph`` as the files ParDNN reads (see NOTE [ParDNN's files]) plus its
    ``settings.json``, adding the ``src``/``snk`` nodes it expects. Returns the folder."""
    folder = Path(folder)
    for name in graph.names:
        if not _NAME.match(name) or "->" in name or "::" in name or name in (PARDNN_SOURCE, PARDNN_SINK):
            raise GraphError(f"node name {name!r} cannot be written in ParDNN's format (no blanks, quotes, "
                             f"'->', '::', and not {PARDNN_SOURCE!r}/{PARDNN_SINK!r}); rename it")
    folder.mkdir(parents=True, exist_ok=True)
    indeg = np.bincount(graph.dst, minlength=graph.n)
    outdeg = np.bincount(graph.src, minlength=graph.n)
    names = graph.names
    lines = [f"{names[a]} -> {names[b]}" for a, b in zip(graph.src.tolist(), graph.dst.tolist())]
    lines += [f"{PARDNN_SOURCE} -> {names[i]}" for i in np.flatnonzero(indeg == 0).tolist()]
    lines += [f"{names[i]} -> {PARDNN_SINK}" for i in np.flatnonzero(outdeg == 0).tolist()]
    (folder / PARDNN_GRAPH).write_text("digraph {\n" + "\n".join(lines) + "\n}\n")
    micro = np.rint(graph.time_s * 1e6).astype(np.int64).tolist()
    times = [f"{n}::{t}" for n, t in zip(names, micro)] + [f"{PARDNN_SOURCE}::0", f"{PARDNN_SINK}::0"]
    (folder / PARDNN_TIMES).write_text("\n".join(times) + "\n")
    out = np.zeros(graph.n)
    np.maximum.at(out, graph.src, graph.edge_bytes)
    (folder / PARDNN_OUTPUT_BYTES).write_text("".join(f"{n}::{int(b)}\n" for n, b in zip(names, out.tolist())))
    (folder / PARDNN_MEMORY).write_text("".join(f"{n}::{int(b)}\n" for n, b in zip(names, graph.held_bytes.tolist())))
    for empty in PARDNN_EMPTY_LISTS:
        (folder / empty).write_text("")
    settings = {"folder": str(folder), "K": int(devices), "COMM_LATENCY": latency_s * 1e6,
                "COMM_TRANSFER_RATE": bandwidth_Bps / 1e9, "BALANCE_MEMORY": True, "REPLICATION_FACTOR": 1,
                "DEVICE_MEM_CAPACITY": int(capacity_bytes), "MEMORY_OVER_CCR": 0, "HEURISTIC_1": 0}
    (folder / "settings.json").write_text(json.dumps(settings, indent=4) + "\n")
    return folder


def read_pardnn(folder: str | Path) -> OpGraph:
    """Read a graph in ParDNN's format (see NOTE [ParDNN's files]); the ``src``/``snk`` nodes and
    their edges are dropped. Output bytes ride on every out-edge; held bytes come from
    ``memory.txt`` when present, else they are the output bytes. Missing times or sizes are 0."""
    folder = Path(folder)
    path = folder / PARDNN_GRAPH
    if not path.is_file():
        raise GraphError(f"no {PARDNN_GRAPH} in {folder}; a ParDNN graph folder holds it and {PARDNN_TIMES}")
    index: dict[str, int] = {}
    edges: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    for line in path.read_text().splitlines():
        parts = _clean(line).split("->")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            continue
        a, b = parts
        if PARDNN_SOURCE in (a, b) or PARDNN_SINK in (a, b):
            for x in (a, b):
                if x not in (PARDNN_SOURCE, PARDNN_SINK):
                    index.setdefault(x, len(index))
            continue
        ia, ib = index.setdefault(a, len(index)), index.setdefault(b, len(index))
        if (ia, ib) not in seen:
            seen.add((ia, ib))
            edges.append((ia, ib))
    n = len(index)
    time = _read_values(folder / PARDNN_TIMES, index, n, required=True) / 1e6
    out = _read_values(folder / PARDNN_OUTPUT_BYTES, index, n, required=False)
    memory_path = folder / PARDNN_MEMORY
    held = _read_values(memory_path, index, n, required=False) if memory_path.is_file() else out
    names = [None] * n
    for name, i in index.items():
        names[i] = name
    src = np.fromiter((a for a, _ in edges), dtype=np.int64, count=len(edges))
    return OpGraph.build(names, time, held, edges, out[src] if len(edges) else np.zeros(0))


def _clean(line: str) -> str:
    return "".join(ch for ch in line if ch not in " \t\r\n\"")


def _read_values(path: Path, index: dict[str, int], n: int, *, required: bool) -> np.ndarray:
    values = np.zeros(n)
    if not path.is_file():
        if required:
            raise GraphError(f"no {path.name} in {path.parent}; ParDNN needs each node's time there")
        return values
    for number, line in enumerate(path.read_text().splitlines(), 1):
        parts = _clean(line).split("::")
        if len(parts) != 2:
            continue
        if parts[0] in index:
            try:
                v = float(parts[1])
            except ValueError:
                raise GraphError(f"{path}:{number}: {parts[1]!r} is not a number") from None
            if not math.isfinite(v) or v < 0:
                raise GraphError(f"{path}:{number}: {v!r}; times and sizes must be finite and >= 0")
            values[index[parts[0]]] = v
    return values


def read_pardnn_placement(path: str | Path, graph: OpGraph) -> np.ndarray:
    """ParDNN's output ``placement.place`` (``name device`` lines) as an ``(n,)`` device array."""
    device = np.full(graph.n, -1, dtype=np.int64)
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in graph.index:
            device[graph.index[parts[0]]] = int(parts[1])
    if (device < 0).any():
        missing = [graph.names[i] for i in np.flatnonzero(device < 0)[:5]]
        raise GraphError(f"{path} places no device for {missing}; was it made from this graph?")
    return device
