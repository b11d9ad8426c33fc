"""The CPU backend: "device" tensors are CPU tensors, and each copy engine is a worker thread that
runs copies in issue order, like a CUDA stream. Its chaos mode delays copies and event completions
at random and poisons destinations first, so a missing wait shows up as NaNs or wrong values."""

from __future__ import annotations

import collections
import ctypes
import os
import random
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ooc.backend.base import Backend, Event
from ooc.backend.order import CheckedEvent, OrderChecker, checker

CHECK_ORDER_ENV = "OOC_CHECK_ORDER"
"""``OOC_CHECK_ORDER=1``: CPU backends built without ``check_order=`` check stream order (the tests
set it; see NOTE [stream-order checker] in ``ooc.backend.order``)."""


@dataclass(frozen=True)
class ChaosConfig:
    """Random delays for the CPU backend's copies and events.

    ``max_delay_s``: each copy sleeps up to this long before it starts and again half-way through;
    each compute event completes up to this long late. ``seed`` makes the delays reproducible.
    """

    seed: int = 0
    max_delay_s: float = 0.002

    def __post_init__(self) -> None:
        if self.max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {self.max_delay_s}")


class CpuEvent:
    """Set when its work is done. ``engine``: the copy engine whose queue holds that work; a thread
    that waits for the event then runs the queued jobs itself while the engine's thread is not running
    one (NOTE [a waiter runs the copies])."""

    __slots__ = ("_done", "_engine")

    def __init__(self, done: bool = False, engine: _CopyEngine | None = None) -> None:
        self._done = threading.Event()
        self._engine = engine
        if done:
            self._done.set()

    def set(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if self._engine is not None and not self._done.is_set():
            self._engine.run_until(self._done)
        self._done.wait()


class _CopyEngine:
    """A FIFO of jobs, run one at a time in issue order, like a CUDA stream: by its own thread, or by a
    thread waiting for one of them (NOTE [a waiter runs the copies]).

    NOTE [a waiter runs the copies]
    A copy handed to the engine's thread waits for that thread to be scheduled. On an idle machine that
    is microseconds; on one whose cores are oversubscribed it is a time slice or more per hand-off, and
    the training thread, which waits for its prefetches and its drained streams, could wait that long
    for each. So a thread that waits for a job's event runs the jobs queued up to it itself whenever no
    job is running: the order and the one-at-a-time of a stream hold (``_busy``, under ``_lock``), and
    the engine's thread takes the queue again when the waiter is done. A job that raises on a waiting
    thread raises there too (on the engine's thread it is kept and raised by the next ``submit``).
    Measured (``benchmarks/bench_oversubscribed.py``, the demo GPT beside 8 busy processes on 2 cores):
    no clear gain over waiters that only wait (x0.92 against x1.11 of plain in one run, x1.22 against
    x1.15 in another); the demo's 4.7 s step against plain PyTorch's 0.11 s at a load of 9-10, which
    this was meant for, did not reproduce there, so its cause is elsewhere.

    NOTE [a failed engine fails its waiters]
    A job that raised never sets its event, and it may have failed on any thread: the engine's, or one
    waiting for another event. So once ``error`` is set, a wait for an event not yet set raises
    instead of waiting: otherwise whoever waits for the failed job (the training thread, or a copy of
    the other engine ordered after it, which then blocks that engine for good) would wait forever. The
    error is sticky, as a CUDA stream's is: later jobs may still run, but their waiters raise too, as
    ``submit`` does."""

    def __init__(self, name: str) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        """Notified when a job is queued or one finishes."""
        self._jobs: collections.deque[Callable[[], None] | None] = collections.deque()
        self._busy = False
        """A job is running (on the engine's thread or a waiter's)."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.error: BaseException | None = None
        self.closed = False
        # The thread ends before the interpreter does (NOTE [threads stop at exit] in ooc.optim.pipeline).
        self._stop = weakref.finalize(self, _stop_engine, self._changed, self._jobs, self._thread)

    def submit(self, job: Callable[[], None]) -> None:
        if self.error is not None:
            raise RuntimeError(f"ooc copy engine {self._thread.name} failed earlier") from self.error
        with self._lock:
            # Checked under the lock that close()'s end of the queue is appended under: a job queued
            # behind the end would never run, and a wait for it would return at the end unfinished.
            if self.closed:
                raise RuntimeError(f"ooc copy engine {self._thread.name} is closed; this backend was shut down (ooc.unwrap closes the ones it made)")
            self._jobs.append(job)
            self._changed.notify_all()

    def _take(self) -> Callable[[], None] | None:
        """The next job, marked running; called with ``_lock`` held, ``_busy`` false and a job queued."""
        self._busy = True
        return self._jobs.popleft()

    def _done_with(self) -> None:
        with self._lock:
            self._busy = False
            self._changed.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._busy or not self._jobs:
                    self._changed.wait()
                job = self._take()
            if job is None:
                self._done_with()
                return
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - kept and re-raised on the next submit
                self.error = exc
            del job  # unbound now, not when the next job arrives: a failed job may still hold its buffers
            self._done_with()

    def run_until(self, done: threading.Event) -> None:
        """Run queued jobs on this thread, in order and one at a time with the engine's thread, until
        ``done`` is set (NOTE [a waiter runs the copies]). Returns at once if the engine's end
        (``None``) is next in the queue. Raises if a job of this engine failed and ``done`` is not set
        (NOTE [a failed engine fails its waiters])."""
        while True:
            with self._lock:
                while not done.is_set() and self.error is None and (self._busy or not self._jobs):
                    self._changed.wait()
                if done.is_set():
                    return
                if self.error is not None:
                    raise RuntimeError(f"ooc copy engine {self._thread.name} failed earlier") from self.error
                if self._jobs[0] is None:
                    return
                job = self._take()
            try:
                job()
            except KeyboardInterrupt:
                # NOTE [Ctrl-C in a copy a waiter runs]: the job goes back to the queue's front, to run
                # again from its start (by the engine's thread or the next waiter); the engine is not
                # failed, so the step can be run again, as after a Ctrl-C that interrupts a wait.
                with self._lock:
                    self._jobs.appendleft(job)
                raise
            except BaseException as exc:
                self.error = exc
                raise
            finally:
                del job
                self._done_with()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._stop()


def _stop_engine(changed: threading.Condition, jobs: collections.deque, thread: threading.Thread) -> None:
    with changed:
        jobs.append(None)  # after the jobs queued before it: the engine's thread ends there
        changed.notify_all()
    thread.join(timeout=5)


class CpuBackend(Backend):
    """``chaos``: random copy delays (:class:`ChaosConfig`). ``check_order``: raise
    :class:`~ooc.backend.order.StreamOrderError` on any access that the CUDA ordering rules do not
    order (NOTE [stream-order checker]); ``None`` reads ``OOC_CHECK_ORDER``. Both are fixed for the
    backend's life."""

    name = "cpu"

    def __init__(self, *, chaos: ChaosConfig | None = None, check_order: bool | None = None) -> None:
        self.device = torch.device("cpu")
        self.chaos = chaos
        if check_order is None:
            check_order = os.environ.get(CHECK_ORDER_ENV, "") == "1"
        self.check_order = check_order
        self._checker: OrderChecker | None = checker() if check_order else None
        if self._checker is not None:
            self._h2d_stream = self._checker.copy_stream(f"h2d#{id(self):x}")
            self._d2h_stream = self._checker.copy_stream(f"d2h#{id(self):x}")
        self.separate_memory = chaos is not None
        self._rng = random.Random(chaos.seed) if chaos else None
        self._rng_lock = threading.Lock()
        self._d2h = _CopyEngine("ooc-d2h")
        self._h2d = _CopyEngine("ooc-h2d")
        self._last: list[CpuEvent] = []
        self.bound_threads: list[tuple[str, torch.device]] = []
        """(thread name, device) of each :meth:`bind_thread` call."""

    def __repr__(self) -> str:
        return f"CpuBackend(chaos={self.chaos}, check_order={self.check_order})"

    def _delay(self) -> float:
        if self._rng is None:
            return 0.0
        with self._rng_lock:
            return self._rng.uniform(0.0, self.chaos.max_delay_s)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if self._checker is not None:
            self._checker.allocated(buffer, "host_buffer", host=True)
        return buffer

    def bind_thread(self, *, own_stream: bool = False) -> None:
        # No current device on the CPU; the call is recorded so tests can see which threads bind. The
        # stream-order checker gives every thread a compute stream of its own already (own_stream).
        self.bound_threads.append((threading.current_thread().name, self.device))

    def on_carve(self, piece: torch.Tensor) -> None:
        if self._checker is not None:
            self._checker.carved(piece, "HostArena.alloc")

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if self._checker is not None:
            self._checker.allocated(buffer, "device_buffer", host=False)
        return buffer

    def record_compute(self) -> Event:
        # Compute on the CPU has already happened when the host gets here; chaos mode still
        # completes the event late, as a GPU that runs behind the host would.
        delay = self._delay()
        if delay == 0.0:
            event = CpuEvent(done=True)
        else:
            event = CpuEvent()
            timer = threading.Timer(delay, event.set)
            timer.daemon = True
            timer.start()
        if self._checker is not None:
            return CheckedEvent(event, self._checker.record_compute(), self._checker)
        return event

    def compute_stream(self) -> object:
        # The checker's compute stream of this thread (NOTE [stream-order checker]), else the thread.
        return self._checker.compute_stream() if self._checker is not None else threading.get_ident()

    def record_on(self, stream: object) -> Event:
        if self._checker is None or stream == self._checker.compute_stream():
            return self.record_compute()
        # Another thread's compute: its ops ran on that thread as the host issued them; the checker
        # gives the event what that stream has done and known so far.
        return CheckedEvent(CpuEvent(done=True), self._checker.record_on(stream), self._checker)

    def _copy(self, engine: _CopyEngine, dst: torch.Tensor, src: torch.Tensor, after: tuple[Event, ...]) -> Event:
        if dst.numel() != src.numel() or dst.dtype != src.dtype:
            raise ValueError(f"copy of {src.numel()} {src.dtype} into {dst.numel()} {dst.dtype}")
        if not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError("the CPU copy engine moves contiguous buffers only")
        knowledge = None
        if self._checker is not None:
            # Checked at issue, in issue order. The job below holds both buffers until the copy ran:
            # the CPU stand-in for CudaBackend._copy's record_stream, so the checker exempts copies
            # from the use-after-free rule.
            d2h = engine is self._d2h
            stream = self._d2h_stream if d2h else self._h2d_stream
            if self._checker.between_host_buffers(dst, src):
                return self._host_copy(engine, stream, dst, src, after, "D2H copy" if d2h else "H2D copy")
            knowledge = self._checker.copy(stream, dst, src, after, "D2H copy" if d2h else "H2D copy")
        done = CpuEvent(engine=engine)
        delays = (self._delay(), self._delay())
        chaos = self.chaos is not None

        nbytes = dst.numel() * dst.element_size()
        dst_ptr, src_ptr = dst.data_ptr(), src.data_ptr()

        held = [dst, src]  # both live until the copy ran: the stand-in for CudaBackend._copy's record_stream

        def job() -> None:
            # NOTE [Ctrl-C in a copy a waiter runs]
            # A Ctrl-C on the training thread lands in a copy it runs as a waiter at the next bytecode,
            # often right after the memmove, and the job then runs again from here. It copies again
            # (the same bytes) while it holds the buffers; once it has let go of them the copy was done,
            # and only the signal is left.
            if not held:
                done.set()
                return
            if chaos:
                # Poison the destination first: a reader that did not wait sees NaN bytes.
                ctypes.memset(dst_ptr, 0xFF, nbytes)
            for event in after:
                event.synchronize()
            if delays[0]:
                time.sleep(delays[0])
            # NOTE [single-threaded copies]: a plain memmove, not Tensor.copy_: torch would run the
            # copy on an OpenMP team owned by this long-lived thread, and that team slowed the
            # training thread's own parallel regions by 30-45% for the rest of the process
            # (measured on the 2-core CI machine). A copy engine is one core, like a DMA engine.
            if chaos and nbytes > 1:
                half = nbytes // 2
                ctypes.memmove(dst_ptr, src_ptr, half)
                time.sleep(delays[1])
                ctypes.memmove(dst_ptr + half, src_ptr + half, nbytes - half)
            else:
                ctypes.memmove(dst_ptr, src_ptr, nbytes)
            # Let go before signalling: whoever waits on `done` may then free the buffers, and an
            # activation must not outlive its graph inside a finished job.
            held.clear()
            done.set()

        engine.submit(job)
        self._last.append(done)
        if len(self._last) > 64:
            self._last = [e for e in self._last if not e.query()]
        if knowledge is not None:
            return CheckedEvent(done, knowledge, self._checker)
        return done

    def _host_copy(self, engine: _CopyEngine, stream: int, dst: torch.Tensor, src: torch.Tensor,
                   after: tuple[Event, ...], what: str) -> Event:
        """A copy between two host buffers (the checker tells them apart), as
        ``CudaBackend._host_copy`` makes it: the host waits for ``after`` and for the copies issued
        on ``engine`` before it, then copies, now."""
        for event in after:
            event.synchronize()
        drained = CpuEvent(engine=engine)
        engine.submit(drained.set)
        drained.synchronize()
        self._checker.host_syncs_streams((stream,))
        knowledge = self._checker.copy(stream, dst, src, after, what)
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
        return CheckedEvent(CpuEvent(done=True), knowledge, self._checker)

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after: tuple[Event, ...]) -> Event:
        return self._copy(self._d2h, dst, src, after)

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: tuple[Event, ...]) -> Event:
        return self._copy(self._h2d, dst, src, after)

    def wait_compute(self, event: Event) -> None:
        # The CPU "compute stream" is the host thread itself, so it blocks. The checker counts it as
        # the GPU-side wait it stands for: compute learns the event, the host does not.
        (event.inner if isinstance(event, CheckedEvent) else event).synchronize()
        if self._checker is not None:
            self._checker.compute_waits(event)

    def synchronize(self) -> None:
        for event in list(self._last):
            event.synchronize()
        self._last.clear()
        if self._checker is not None:
            # The host has waited for every copy issued so far.
            self._checker.host_syncs_streams((self._d2h_stream, self._h2d_stream))

    def close(self) -> None:
        self._d2h.close()
        self._h2d.close()
