"""A reusable pool of host buffers (pinned on CUDA) for swapped activations.

Pinned allocations are slow (a page-locking syscall each), and a training step swaps the same sizes
every step, so buffers are kept and reused. A buffer returns to the pool with the event of the last
copy that reads it; it is handed out again only once that event is complete.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

from ooc.backend.base import Backend, Event

_GRANULE = 4096


def _size_class(nbytes: int) -> int:
    return max(_GRANULE, -(-nbytes // _GRANULE) * _GRANULE)


def _take(free: list[tuple[torch.Tensor, Event | None]]) -> tuple[torch.Tensor, Event | None] | None:
    """The free buffer to hand out: the most recently released one whose last copy is done (warm in
    cache), else the earliest released (the likeliest to be done soon). Plain LIFO would pick the
    buffer most likely still in flight, and the host would wait for it while idle ones sit free."""
    if not free:
        return None
    for i in range(len(free) - 1, -1, -1):
        ready = free[i][1]
        if ready is None or ready.query():
            return free.pop(i)
    return free.pop(0)


class HostPool:
    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._free: dict[int, list[tuple[torch.Tensor, Event | None]]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        """Host bytes owned by the pool (in use or free)."""
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` host buffer of exactly ``nbytes`` elements (a view of a pooled block)."""
        size = _size_class(nbytes)
        with self._lock:
            entry = _take(self._free[size])
            self.in_use_bytes += size
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        if entry is None:
            block = self._backend.host_buffer(size)
            with self._lock:
                self.allocated_bytes += size
        else:
            block, ready = entry
            if ready is not None:
                # The last copy that read this buffer may still be running; reusing it earlier
                # would overwrite data in flight. (A host-side wait: CUDA events the host waits on
                # block the thread rather than spin, see CudaBackend.)
                ready.synchronize()
        return block[:nbytes]

    def release(self, buffer: torch.Tensor, ready: Event | None) -> None:
        """Give ``buffer`` back; it may be reused once ``ready`` (its last reader) completes."""
        block = buffer._base if buffer._base is not None else buffer
        size = block.numel()
        with self._lock:
            self._free[size].append((block, ready))
            self.in_use_bytes -= size

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.allocated_bytes = self.in_use_bytes
