"""Run a captured training step under a placement, in one process over K devices: ``cuda:0..K-1``
or, on the CPU, K virtual devices, through the same code.

Each device has its own :class:`ooc.tracker.MemoryTracker`. Ops run in the order the simulator
started them (ties in program order); the storages an op creates are counted on its device from its
start until the simulator's release of the node (frees first at one instant, as in the simulator's
sweep). Values are dropped once released and read by every consumer.

# NOTE [copies between devices]
As the simulator sends them: once per tensor and destination device, as soon as the producing op
has been issued. Each copy is four steps, written once (steps 1-3 in :func:`_send`, step 4 where
:func:`_run` fetches an op's inputs) over a :class:`Links` of primitives:

1. the destination buffer is allocated on the receiving device;
2. an event is recorded on the producer's compute stream after the producing op (and, on the CPU
   where one host stream stands for every device's compute, after the allocation);
3. the copy runs on the receiving device's copy stream, after that event;
4. the consumer's compute stream waits for the copy's event before the first op that reads it.

On CUDA (:class:`CudaLinks`) the streams are real: the copy stream of ``cuda:d`` is a side stream,
the buffers are ``record_stream``-ed on the streams that use them besides the one they were made on.
On the CPU (:class:`CpuLinks`) each virtual device is a :class:`~ooc.backend.cpu.CpuBackend`: its
copy engine thread is the copy stream, and with ``check_order`` its stream-order checker raises on
any read the events above do not order, so a missing step fails a CPU test.

What this shows on the CPU: the step's outputs (loss, gradients) under any placement are bit for bit
those of the unpartitioned step, and the bytes the real storages occupy per device reach exactly the
predicted peaks (the buffers copies land in are not counted, as in the simulator).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.fx
from torch.utils._pytree import tree_map

from ooc.backend.base import Event
from ooc.backend.cpu import ChaosConfig, CpuBackend
from ooc.partition_capture import CapturedStep, storages
from ooc.scheduler.errors import PlanError
from ooc.scheduler.partition import Devices, Placement, Simulation, simulate
from ooc.tracker import MemoryTracker


@dataclass(frozen=True, eq=False)
class PlacedRun:
    """``outputs``: the step's outputs (loss, then one gradient per parameter, None for one the step
    does not use); ``peak_bytes``: ``(K,)`` measured peak per device; ``copies``: tensors copied
    between devices; ``simulation``: the prediction the run followed."""

    outputs: tuple[Any, ...]
    peak_bytes: np.ndarray
    copies: int
    simulation: Simulation


class Links(abc.ABC):
    """The primitives of NOTE [copies between devices] over K devices."""

    k: int

    @abc.abstractmethod
    def place(self, value: Any, d: int) -> Any:
        """A step input (a placeholder's argument, a parameter) as device ``d`` holds it."""

    @abc.abstractmethod
    def on(self, d: int) -> contextlib.AbstractContextManager:
        """Where device ``d``'s ops are issued."""

    @abc.abstractmethod
    def retarget(self, kwargs: dict, d: int) -> dict:
        """An op's keyword arguments with any device argument naming device ``d``."""

    @abc.abstractmethod
    def buffer_like(self, t: torch.Tensor, d: int) -> torch.Tensor:
        """An uninitialised 1-D tensor on device ``d`` with the dtype and length of the 1-D
        ``t`` (step 1)."""

    @abc.abstractmethod
    def record(self, d: int) -> Event:
        """An event at the current point of device ``d``'s compute stream (step 2)."""

    @abc.abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, d: int, after: Event) -> Event:
        """Copy ``src`` into ``dst`` on device ``d``'s copy stream once ``after`` is complete; the
        event of the copy's completion (step 3)."""

    @abc.abstractmethod
    def wait(self, d: int, event: Event) -> None:
        """Make device ``d``'s compute stream wait for ``event`` (step 4)."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Wait for every copy issued."""

    def close(self) -> None:  # noqa: B027 - optional: only links with threads override it
        """Stop worker threads, if any."""


class CpuLinks(Links):
    """K virtual CPU devices, each a :class:`CpuBackend` whose H2D copy engine is the copy stream
    of the device (NOTE [copies between devices]); ``check_order`` as for :class:`CpuBackend`."""

    def __init__(self, k: int, *, check_order: bool | None = None, chaos: ChaosConfig | None = None) -> None:
        """``chaos``: each copy delayed at random, its destination poisoned first (a read that did
        not wait sees NaN)."""
        self.k = k
        self.backends = [CpuBackend(check_order=check_order, chaos=chaos and replace(chaos, seed=chaos.seed + d))
                         for d in range(k)]

    def place(self, value: Any, d: int) -> Any:
        return value

    def on(self, d: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def retarget(self, kwargs: dict, d: int) -> dict:
        return kwargs

    def buffer_like(self, t: torch.Tensor, d: int) -> torch.Tensor:
        return self.backends[d].device_buffer(t.numel() * t.element_size()).view(t.dtype)

    def record(self, d: int) -> Event:
        # One host thread issues every virtual device's ops: its compute stream stands for all of
        # them, so this event also follows the destination buffer's allocation (the checker's rule 1).
        return self.backends[d].record_compute()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, d: int, after: Event) -> Event:
        # The copy engine thread holds both buffers until the copy ran (CpuBackend's record_stream).
        return self.backends[d].copy_h2d(_bytes(dst), _bytes(src), (after,))

    def wait(self, d: int, event: Event) -> None:
        self.backends[d].wait_compute(event)

    def finish(self) -> None:
        for b in self.backends:
            b.synchronize()

    def close(self) -> None:
        for b in self.backends:
            b.close()


class CudaLinks(Links):
    """``cuda:0..K-1``, each with its current stream for compute and a side stream for the copies it
    receives (NOTE [copies between devices])."""

    def __init__(self, k: int, *, gpus: Sequence[int] | None = None) -> None:
        """``gpus``: the GPU of each of the K devices (default ``0..K-1``); naming one GPU twice
        gives two devices sharing its compute stream, each with its own copy stream (how a
        one-GPU machine tests the copies)."""
        gpus = list(range(k)) if gpus is None else [int(g) for g in gpus]
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(gpus) != k or any(not 0 <= g < have for g in gpus):
            raise PlanError(f"{k} devices on GPUs {gpus}, and this machine has {have} GPUs: name one GPU per "
                            "device, or run on the CPU's virtual devices (CpuLinks)")
        self.k = k
        self.devices = [torch.device("cuda", g) for g in gpus]
        self.copy_streams = [torch.cuda.Stream(dev) for dev in self.devices]

    def place(self, value: Any, d: int) -> Any:
        return tree_map(lambda t: t.to(self.devices[d]) if isinstance(t, torch.Tensor) else t, value)

    def on(self, d: int) -> contextlib.AbstractContextManager:
        return torch.cuda.device(self.devices[d])

    def retarget(self, kwargs: dict, d: int) -> dict:
        return {key: self.devices[d] if isinstance(v, torch.device) else v for key, v in kwargs.items()}

    def buffer_like(self, t: torch.Tensor, d: int) -> torch.Tensor:
        # Allocated on the copy stream, the first to write it; the compute stream that reads it is
        # recorded in copy(), so the allocator does not hand the block out again before it is done.
        with torch.cuda.stream(self.copy_streams[d]):
            return torch.empty(t.numel(), dtype=t.dtype, device=self.devices[d])

    def record(self, d: int) -> Event:
        # On the producer's compute stream, right after the producing op was queued there.
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.devices[d]))
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, d: int, after: Event) -> Event:
        stream = self.copy_streams[d]
        # The copy stream must not read src before the producing op, on another GPU's stream, ran.
        stream.wait_event(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        # src was made on the producer's stream and is read on this one: its block is not reused
        # until this stream is past the copy. dst is read by the receiver's compute stream.
        src.record_stream(stream)
        dst.record_stream(torch.cuda.current_stream(self.devices[d]))
        done = torch.cuda.Event()
        done.record(stream)
        return done

    def wait(self, d: int, event: Event) -> None:
        # The receiver's compute stream reads the copy's destination: it waits on the GPU while the
        # host goes on issuing.
        torch.cuda.current_stream(self.devices[d]).wait_event(event)

    def finish(self) -> None:
        for dev in self.devices:
            torch.cuda.synchronize(dev)


def _span(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t``'s storage from its first to its last, as a 1-D contiguous tensor
    (strides are never negative, so ``t``'s storage offset is its first element)."""
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    return t.as_strided((extent,), (1,))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous ``t`` (a span) as ``uint8``."""
    return t.view(torch.uint8)


def _send(links: Links, value: Any, src: int, dst: int) -> tuple[Any, list[Event]]:
    """Steps 1-3 of NOTE [copies between devices]: ``value``'s tensors as device ``dst`` will hold
    them, and the events of their copies."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        # NOTE [a copy keeps the strides]: the consumer gets ``t``'s strides, not a contiguous
        # copy: a kernel may add in another order over another layout (a mean over a slice was
        # 1 ulp off eager's). The span from ``t``'s first element to its last is copied, gaps
        # included (all of a slice's base but the rows past its last; an ``expand`` copies its
        # source once).
        span = _span(t)
        buf = links.buffer_like(span, dst)
        pairs.append((buf, span))
        return buf.as_strided(t.shape, t.stride())

    out = tree_map(one, value)
    if not pairs:
        return out, []
    produced = links.record(src)
    return out, [links.copy(buf, t, dst, produced) for buf, t in pairs]


def run_placed(step: CapturedStep, placement: Placement, devices: Devices, *, links: Links | None = None) -> PlacedRun:
    """Run ``step`` with node ``i`` of ``step.graph`` on device ``placement.device[i]`` of ``links``
    (default: K virtual CPU devices, :class:`CpuLinks`, checking stream order where
    ``OOC_CHECK_ORDER=1``; :class:`CudaLinks` for ``cuda:0..K-1``)."""
    graph = step.graph
    nodes = [n for n in step.gm.graph.nodes if n.op != "output"]
    if len(nodes) != graph.n or placement.device.shape != (graph.n,):
        raise PlanError("the placement and the graph are not of this captured step; capture and place it again")
    own = links is None
    links = CpuLinks(devices.k) if links is None else links
    if links.k != devices.k:
        raise PlanError(f"the placement is over {devices.k} devices and the links join {links.k}; give links "
                        f"over {devices.k}")
    try:
        return _run(step, nodes, placement, devices, links)
    finally:
        links.finish()
        if own:
            links.close()


def _run(step: CapturedStep, nodes: list[torch.fx.Node], placement: Placement, devices: Devices,
         links: Links) -> PlacedRun:
    graph = step.graph
    sim = simulate(graph, placement, devices)
    device = placement.device.tolist()
    k = devices.k
    position = {node: i for i, node in enumerate(nodes)}
    consumers = [0] * graph.n
    sends: list[set[int]] = [set() for _ in range(graph.n)]
    for node in nodes:
        for i in set(node.all_input_nodes):
            consumers[position[i]] += 1
            if device[position[i]] != device[position[node]]:
                sends[position[i]].add(device[position[node]])
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
    pending: dict[tuple[int, int], list[Event]] = {}
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
        d = device[u]
        if node.op == "placeholder":
            out = links.place(next(args), d)
        elif node.op == "get_attr":
            out = links.place(getattr(step.gm, node.target), d)
        else:
            def fetch(i: torch.fx.Node, d: int = d) -> Any:
                j = position[i]
                if device[j] == d:
                    return value[j]
                # Step 4 of NOTE [copies between devices]: d's compute waits for the copy before
                # its first op that reads it (later ones follow on the same stream).
                for event in pending.pop((j, d), ()):
                    links.wait(d, event)
                return copies[(j, d)]

            a = torch.fx.node.map_arg(node.args, fetch)
            kw = links.retarget(torch.fx.node.map_arg(node.kwargs, fetch), d)
            fn = node.target if node.op == "call_function" else getattr(step.gm, node.target)
            with links.on(d):
                out = fn(*a, **kw)
        value[u] = out
        mine = {p: b for p, b in storages(out).items() if p not in live}
        _hold(live, out, +1)
        created[u] = mine
        for nbytes in mine.values():
            trackers[d].alloc(0, nbytes)
        for c in sorted(sends[u]):
            # Sent once per destination as soon as the producing op is issued, as the simulator does.
            copies[(u, c)], pending[(u, c)] = _send(links, out, d, c)
            _hold(live, copies[(u, c)], +1)
            sent += 1
        for i in set(node.all_input_nodes):
            j = position[i]
            consumers[j] -= 1
            _maybe_drop(j, value, copies, consumers, released, k, live)
    out_node = next(n for n in step.gm.graph.nodes if n.op == "output")
    outputs = torch.fx.node.map_arg(out_node.args[0], lambda i: value[position[i]])
    return PlacedRun(tuple(outputs), np.array([t.peak for t in trackers], dtype=float), sent, sim)


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
