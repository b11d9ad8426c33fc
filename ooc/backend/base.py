"""The device interface the runtime is written against: a compute stream, two copy engines (D2H and
H2D), events, and host buffers. ``cuda`` runs it on streams; ``cpu`` on copy-engine threads."""

from __future__ import annotations

import abc
import threading
from typing import Protocol

import torch

from ooc.backend.arena import HostArena, aligned_chunk

_ARENA_LOCK = threading.Lock()


class Event(Protocol):
    """Marks a point in a stream's work; complete when everything before it is done."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Backend(abc.ABC):
    """Where saved tensors live and how they move.

    ``copy_d2h`` / ``copy_h2d`` issue a copy on the matching copy engine that starts only after every
    event in ``after`` is complete, and return an event that completes with the copy. Copies on one
    engine run in issue order, like a CUDA stream.
    """

    name: str
    device: torch.device
    separate_memory: bool = True
    """Device memory is apart from host memory (CUDA), or acts so (the chaos CPU backend): host
    state is copied, never shared. On the plain CPU backend a host fp32 tensor is its own copy."""

    @abc.abstractmethod
    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A fresh ``uint8`` host buffer of ``nbytes`` (pinned where that exists), outside the
        arena: for one-off buffers (calibration). Buffers the runtime reuses come from :attr:`arena`."""

    def host_chunk(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of ``uint8`` host memory for the arena, at an ``ALIGN``-aligned address
        (pinned where that exists)."""
        return aligned_chunk(nbytes)

    def on_carve(self, piece: torch.Tensor) -> None:  # noqa: B027 - optional: the CPU checker overrides it
        """The arena carved ``piece`` (a new DMA buffer over memory earlier slices may have used)."""

    @property
    def arena(self) -> HostArena:
        """This backend's host arena (NOTE [host arena] in ``ooc.backend.arena``): every DMA
        buffer the runtime and the host optimizer reuse is a slice of it."""
        arena = self.__dict__.get("_arena")
        if arena is None:
            with _ARENA_LOCK:
                arena = self.__dict__.get("_arena")
                if arena is None:
                    arena = self.__dict__["_arena"] = HostArena(self.host_chunk, on_carve=self.on_carve)
        return arena

    @abc.abstractmethod
    def device_buffer(self, nbytes: int) -> torch.Tensor:
        """A fresh ``uint8`` device buffer of ``nbytes``, allocated in compute-stream order."""

    @abc.abstractmethod
    def record_compute(self) -> Event:
        """An event at the current point of the compute stream."""

    def compute_stream(self) -> object:
        """The calling thread's current compute stream, for :meth:`record_on` later (a stream that
        reads the weights: NOTE [reads of held weights] in ooc.optim.pipeline). Compared with ``==``."""
        return threading.get_ident()

    def record_on(self, stream: object) -> Event:
        """An event at the current point of ``stream`` (from :meth:`compute_stream`, possibly another
        thread's), as :meth:`record_compute` is of the caller's own."""
        return self.record_compute()

    @abc.abstractmethod
    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after: tuple[Event, ...]) -> Event: ...

    @abc.abstractmethod
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: tuple[Event, ...]) -> Event: ...

    @abc.abstractmethod
    def wait_compute(self, event: Event) -> None:
        """Make the compute stream wait for ``event`` (the host returns at once on CUDA)."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for every copy issued so far (used at shutdown and in tests)."""

    def bind_thread(self, *, own_stream: bool = False) -> None:  # noqa: B027 - optional: only CUDA has a per-thread current device
        """Make this backend's device the calling thread's current device. A thread ooc starts calls
        it first: CUDA's current device is per thread and starts at ``cuda:0``, so on rank 1 a
        thread that did not would make its events and collectives on another GPU's context.
        ``own_stream``: the thread also queues its device work (collectives) on a stream of its own,
        not on the training thread's (NOTE [a stream per ooc thread] in ooc.backend.cuda)."""

    def close(self) -> None:  # noqa: B027 - optional: only backends with threads override it
        """Stop worker threads, if any."""

    def max_memory_allocated(self) -> int | None:
        """The allocator's own peak where there is one (CUDA), else ``None``."""
        return None
