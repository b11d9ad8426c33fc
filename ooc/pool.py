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
            free = self._free[size]
            entry = free.pop() if free else None
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
                # would overwrite data in flight.
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
