"""The host buffers of swapped activations: slices of the backend's host arena (pinned on CUDA).

A training step swaps the same sizes every step, and pinning is slow (a page-locking call each), so
buffers come from the backend's arena (NOTE [host arena] in ``ooc.backend.arena``), which keeps
its chunks and reuses freed slices. A buffer returns with the event of the last copy that reads
it; the arena hands its bytes out again only once that event is complete.
"""

from __future__ import annotations

import threading

import torch

from ooc.backend.arena import ALIGN, address_of
from ooc.backend.base import Backend, Event


def _size_class(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


class HostPool:
    """Counts the swap buffers a runtime holds; the bytes are the backend's arena's."""

    def __init__(self, backend: Backend) -> None:
        self._arena = backend.arena
        self._lock = threading.RLock()  # release runs in finalizers, maybe inside acquire on this thread
        self._held: dict[int, int] = {}
        """Per buffer's address, its size in the arena."""
        self.in_use_bytes = 0
        """Bytes of the buffers acquired and not released (each rounded up to the arena's alignment)."""
        self.peak_in_use_bytes = 0

    @property
    def allocated_bytes(self) -> int:
        """Host bytes the backend's arena holds, in use or free (page-locked on CUDA): these
        buffers and the backend's other DMA buffers (the host optimizer's)."""
        return self._arena.reserved_bytes

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` host buffer of exactly ``nbytes`` elements that no copy uses any more."""
        buffer = self._arena.alloc(nbytes)
        size = _size_class(nbytes)
        with self._lock:
            self._held[address_of(buffer)] = size
            self.in_use_bytes += size
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buffer

    def release(self, buffer: torch.Tensor, ready: Event | None) -> None:
        """Give ``buffer`` back; its bytes may be reused once ``ready`` (its last reader) completes."""
        with self._lock:
            self.in_use_bytes -= self._held.pop(address_of(buffer))
        self._arena.free(buffer, ready)
