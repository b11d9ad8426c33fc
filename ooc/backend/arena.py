"""The host arena: every DMA buffer of a backend, carved from a few large page-locked chunks.

NOTE [host arena]
A copy engine reads and writes host memory at full speed only if it is page-locked. torch's pinned
allocator rounds every block up to a power of two and caches it, so one pinned tensor per buffer
costs up to twice the page-locked bytes asked for, which no host-memory check sees. So each
backend pins a few large chunks (powers of two: torch's rounding adds nothing) and carves its
DMA buffers out of them -- the swap pool's buffers (:class:`ooc.pool.HostPool`) and the host
optimizer's gradient and staging buffers -- at ``ALIGN``-byte boundaries: a buffer costs its size
rounded up to ``ALIGN``. Masters, moments and anything else only the host reads stay pageable.

A freed slice returns with the events of the copies that last used it and is handed out again only
once they are complete: a slice whose copies are done is preferred (best fit), else the host waits
for one that fits, and only if none fits does the arena grow. Adjacent free slices merge once their
copies are done. ``reserved_bytes`` is what the arena holds (page-locked on CUDA); ``used_bytes`` is
what is carved out of it, each slice rounded up to ``ALIGN``.

The CPU backend runs the same code on pageable chunks, and its stream-order checker knows each
slice as a buffer of its own (``on_carve``): a slice carved over memory whose last copy the host
has not seen complete is a race it reports.
"""

from __future__ import annotations

import bisect
import collections
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ooc.backend.base import Event

ALIGN = 512
"""Slices start at multiples of this many bytes (and sizes round up to it): a DMA engine's best
alignment, and a waste of at most 0.2% on the 256 KiB a swapped storage is at least."""

MIN_CHUNK = 1 << 20
"""The smallest chunk the arena pins."""

MAX_GROWTH = 64 << 20
"""Chunks double with the arena up to this size; later chunks are this size (or the power of two
above a larger buffer). So the free tail is at most 64 MiB once the arena is past 64 MiB."""


def _ceil_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


@dataclass
class _Free:
    chunk: int
    start: int
    size: int
    ready: tuple[Event, ...]
    """The copies that last used these bytes; empty once they are known to be complete."""


class HostArena:
    """Aligned host slices carved from chunks that ``make_chunk(nbytes)`` allocates (pinned on CUDA).

    ``on_carve(slice)`` is told of each slice carved (the CPU stream-order checker). Thread safe;
    :meth:`free` takes no lock, so it may run in a finalizer at any point.
    """

    def __init__(self, make_chunk: Callable[[int], torch.Tensor], *,
                 on_carve: Callable[[torch.Tensor], None] | None = None) -> None:
        self._make_chunk = make_chunk
        self._on_carve = on_carve
        self._lock = threading.Lock()
        self._chunks: list[torch.Tensor] = []
        """Each chunk's usable bytes, starting at an ``ALIGN``-aligned address."""
        self._free: list[_Free] = []
        """Free ranges, sorted by (chunk, start)."""
        self._live: dict[int, tuple[int, int, int]] = {}
        """Per carved slice's address: (chunk, start, size)."""
        self._returned: collections.deque[tuple[int, tuple[Event, ...]]] = collections.deque()
        """Slices freed and not yet put back (``free`` only appends here: no lock)."""
        self.reserved_bytes = 0
        """Bytes of every chunk (page-locked on CUDA)."""
        self._used = 0
        self.requested_bytes = 0
        """Bytes asked for by the live slices (before rounding to ``ALIGN``)."""
        self._requested: dict[int, int] = {}

    # public ------------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes carved out and not freed, each slice rounded up to ``ALIGN``."""
        with self._lock:
            self._drain()
            return self._used

    @property
    def chunks(self) -> int:
        return len(self._chunks)

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` host tensor of ``nbytes`` elements at an ``ALIGN``-aligned address, whose
        memory no copy uses any more. It stays carved until :meth:`free`."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            self._drain()
            self._settle()
            index = self._best_fit(size, ready=True)
            if index is None:
                index = self._best_fit(size, ready=False)
            if index is None:
                index = self._grow(size)
            entry = self._free.pop(index)
        if entry.ready:
            # NOTE: the last copies that used these bytes may still run (a D2H writing them, an H2D
            # reading them): the new owner writes them next, so the host waits for those copies.
            for event in entry.ready:
                event.synchronize()
            entry.ready = ()
        with self._lock:
            if entry.size > size:
                self._insert(_Free(entry.chunk, entry.start + size, entry.size - size, ()))
            chunk = self._chunks[entry.chunk]
            piece = chunk[entry.start:entry.start + nbytes]
            address = chunk.data_ptr() + entry.start
            self._live[address] = (entry.chunk, entry.start, size)
            self._requested[address] = nbytes
            self._used += size
            self.requested_bytes += nbytes
        if self._on_carve is not None:
            self._on_carve(chunk[entry.start:entry.start + size])
        return piece

    def free(self, piece: torch.Tensor, ready: Event | Iterable[Event] | None = None) -> None:
        """Give back a slice from :meth:`alloc` (or a view starting where it starts); it is handed
        out again only once every event in ``ready`` (its last copies) is complete."""
        if ready is None:
            events: tuple[Event, ...] = ()
        elif hasattr(ready, "synchronize"):
            events = (ready,)
        else:
            events = tuple(ready)
        self._returned.append((address_of(piece), events))

    # internals (under the lock) ----------------------------------------------------------------

    def _drain(self) -> None:
        while self._returned:
            address, events = self._returned.popleft()
            entry = self._live.pop(address, None)
            if entry is None:
                raise ValueError(f"0x{address:x} is not the start of a slice this arena handed out (freed twice?)")
            chunk, start, size = entry
            self._used -= size
            self.requested_bytes -= self._requested.pop(address)
            self._insert(_Free(chunk, start, size, events))

    def _insert(self, entry: _Free) -> None:
        keys = [(f.chunk, f.start) for f in self._free]
        self._free.insert(bisect.bisect(keys, (entry.chunk, entry.start)), entry)

    def _settle(self) -> None:
        """Forget the events of free ranges whose copies are done, and merge neighbours that are
        both done (a range still in flight stays apart: it may be handed out only after a wait)."""
        merged: list[_Free] = []
        for entry in self._free:
            if entry.ready and all(event.query() for event in entry.ready):
                entry.ready = ()
            last = merged[-1] if merged else None
            if last is not None and not last.ready and not entry.ready and last.chunk == entry.chunk \
                    and last.start + last.size == entry.start:
                last.size += entry.size
            else:
                merged.append(entry)
        self._free = merged

    def _best_fit(self, size: int, *, ready: bool) -> int | None:
        best = None
        for i, entry in enumerate(self._free):
            if entry.size >= size and (not entry.ready) == ready and (best is None or entry.size < self._free[best].size):
                best = i
        return best

    def _grow(self, size: int) -> int:
        """Pin a chunk that holds ``size`` bytes; returns the index of its free range."""
        nbytes = chunk_bytes(size, self.reserved_bytes)
        chunk = self._make_chunk(nbytes)
        if chunk.dtype != torch.uint8 or chunk.numel() != nbytes or chunk.data_ptr() % ALIGN:
            raise RuntimeError(f"a host chunk must be {nbytes} uint8 bytes at an {ALIGN}-byte aligned address")
        self._chunks.append(chunk)
        self.reserved_bytes += nbytes
        self._insert(_Free(len(self._chunks) - 1, 0, nbytes, ()))
        return next(i for i, f in enumerate(self._free) if f.chunk == len(self._chunks) - 1 and f.start == 0)


def address_of(piece: torch.Tensor) -> int:
    """Where ``piece`` starts, also when it is empty (whose ``data_ptr()`` may be 0)."""
    return piece.untyped_storage().data_ptr() + piece.storage_offset() * piece.element_size()


def chunk_bytes(size: int, reserved: int) -> int:
    """The size of the chunk an arena holding ``reserved`` bytes adds for a ``size``-byte slice: a
    power of two (torch's pinned allocator would round anything else up to one), at least
    ``MIN_CHUNK`` and ``size``, doubling the arena until chunks reach ``MAX_GROWTH``."""
    return max(MIN_CHUNK, _ceil_pow2(size), min(MAX_GROWTH, _floor_pow2(reserved)))


def aligned_chunk(nbytes: int, *, pin_memory: bool = False) -> torch.Tensor:
    """``nbytes`` of ``uint8`` host memory at an ``ALIGN``-aligned address (page-locked with
    ``pin_memory``: torch then hands out page-aligned blocks, and a power-of-two ``nbytes`` is not
    rounded up)."""
    if pin_memory:
        chunk = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if chunk.data_ptr() % ALIGN == 0:
            return chunk
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    lead = -raw.data_ptr() % ALIGN
    return raw[lead:lead + nbytes]
