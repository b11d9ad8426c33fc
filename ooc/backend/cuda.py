"""The CUDA backend: one side stream per copy direction, events between streams, a pinned host arena.

Its chaos mode (:class:`CudaChaosConfig`) makes the copy streams late on purpose: before each copy
the copy stream spins for a random number of GPU cycles (``torch.cuda._sleep``), poisons a device
destination with 0xFF bytes (NaN in every float dtype), and copies in two halves with another
spin between them; device buffers are poisoned on the compute stream when allocated. Compute that reads a copy's destination without waiting for its event then
reads NaN or half-old bytes, so a missing stream wait fails a bit-for-bit test instead of passing
by luck of timing.

NOTE [a stream per ooc thread]
Every host thread starts on the same default stream of a device, the one the training thread's
kernels and its collectives (the buffers' broadcast, the gradients of parameters kept on the device)
are queued on. The host optimizer's exchange thread queued its NCCL collectives there too (NCCL
orders a collective on the issuing thread's current stream). The ranks' threads interleave
differently: where rank 0 queued the exchange's all-reduce before a training-thread collective and
rank 1 the other way round, each rank's second collective waited on that stream for its first,
which waited for the other rank's first, queued behind that rank's second: a deadlock. It also held
every later kernel of the training thread until the exchange's collective ended. So the threads ooc
starts queue their device work on a stream of their own (``bind_thread(own_stream=True)``), as the
CPU stream-order checker models them (``compute[T]`` per thread); they order it against compute by
the events they wait on, as before.

Nothing here runs at import time; ``torch.cuda`` is touched only when a ``CudaBackend`` is built.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import torch

from ooc.backend.arena import aligned_chunk
from ooc.backend.base import Backend, Event


@dataclass(frozen=True)
class CudaChaosConfig:
    """Random spins on the CUDA copy streams.

    ``max_sleep_cycles``: before each copy, and again half-way through it, the copy stream spins
    for up to this many GPU clock cycles (1e6 cycles is about 0.6 ms at 1.7 GHz). ``seed`` makes
    the sequence of spins reproducible (the run's timing still varies with the host).
    """

    seed: int = 0
    max_sleep_cycles: int = 1_000_000

    def __post_init__(self) -> None:
        if self.max_sleep_cycles < 0:
            raise ValueError(f"max_sleep_cycles must be >= 0, got {self.max_sleep_cycles}")


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, device: torch.device | int | str | None = None, *, chaos: CudaChaosConfig | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("backend='cuda' needs a CUDA device; use backend='cpu' on this machine")
        if device is None:
            index = torch.cuda.current_device()
        else:
            device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            index = torch.cuda.current_device() if device.index is None else device.index
        self.device = torch.device("cuda", index)
        self.chaos = chaos
        self._rng = random.Random(chaos.seed) if chaos else None
        self._rng_lock = threading.Lock()  # the host optimizer's threads issue copies too
        self._d2h = torch.cuda.Stream(self.device)
        self._h2d = torch.cuda.Stream(self.device)

    def __repr__(self) -> str:
        return f"CudaBackend({self.device}, chaos={self.chaos})" if self.chaos else f"CudaBackend({self.device})"

    def _spin(self) -> None:
        """Chaos: keep the current (copy) stream busy for a random number of cycles."""
        with self._rng_lock:
            cycles = self._rng.randint(0, self.chaos.max_sleep_cycles)
        if cycles:
            torch.cuda._sleep(cycles)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def host_chunk(self, nbytes: int) -> torch.Tensor:
        # One pinned block per arena chunk (NOTE [host arena]): the arena asks for powers of two,
        # which torch's pinned allocator does not round up further.
        return aligned_chunk(nbytes, pin_memory=True)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        # Allocated on the compute stream so the caching allocator orders its reuse after compute.
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self.chaos is not None:
            # Chaos: poisoned on the compute stream, so compute that reads the buffer before the copy
            # into it has landed sees NaN rather than whatever the allocator's block held before
            # (often the very activation that was swapped out, which would hide the missing wait),
            # and a copy that does not wait for the allocation is overwritten by the poison.
            buffer.fill_(0xFF)
        return buffer

    def record_compute(self) -> Event:
        # blocking: ooc's host threads wait on these events (the exchange thread on compute, the pool
        # and the update thread on copies); a default event spin-waits, burning the core the host
        # optimizer needs. A blocking one sleeps in the driver instead.
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def record_on(self, stream: object) -> Event:
        # Blocking, as record_compute's: the host may wait on it.
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return event

    def _copy(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor, after: tuple[Event, ...]) -> Event:
        if not (dst.is_cuda or src.is_cuda):
            return self._host_copy(stream, dst, src, after)
        for event in after:
            # The copy must not start before the producer (compute or the opposite copy) is done.
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            if self.chaos is None:
                dst.copy_(src, non_blocking=True)
            else:
                self._chaos_copy(dst, src)
        for tensor in (dst, src):
            if tensor.is_cuda:
                # The compute stream may drop its reference before the copy runs: tell the caching
                # allocator the copy stream still uses this memory.
                tensor.record_stream(stream)
        done = torch.cuda.Event(blocking=True)  # host waits sleep, not spin (see record_compute)
        done.record(stream)
        return done

    def _host_copy(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor,
                   after: tuple[Event, ...]) -> Event:
        """A copy between two host tensors (staging into a streamed parameter's host copy): torch
        makes it on this thread at once, on no stream, so a stream wait would order nothing. The
        host waits instead, for ``after`` and for the copies issued on ``stream`` before it (the
        streamer's H2D copies still reading ``dst``)."""
        for event in after:
            event.synchronize()
        done = torch.cuda.Event(blocking=True)  # host waits sleep, not spin (see record_compute)
        done.record(stream)
        done.synchronize()
        dst.copy_(src)
        return done  # complete: the copy is made when this returns

    def _chaos_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """On the copy stream (current here): spin, poison a device destination, copy half, spin,
        copy the rest. Only the stream's order changes, never the bytes that finally land."""
        self._spin()
        if dst.is_cuda and dst.is_contiguous():
            dst.view(-1).view(torch.uint8).fill_(0xFF)
        if dst.is_contiguous() and src.is_contiguous() and dst.numel() == src.numel() and dst.numel() > 1:
            flat_dst, flat_src = dst.view(-1), src.view(-1)
            half = dst.numel() // 2
            flat_dst[:half].copy_(flat_src[:half], non_blocking=True)
            self._spin()
            flat_dst[half:].copy_(flat_src[half:], non_blocking=True)
        else:
            dst.copy_(src, non_blocking=True)

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after: tuple[Event, ...]) -> Event:
        return self._copy(self._d2h, dst, src, after)

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: tuple[Event, ...]) -> Event:
        return self._copy(self._h2d, dst, src, after)

    def bind_thread(self, *, own_stream: bool = False) -> None:
        # The current device is per thread and a new thread starts on cuda:0: events, streams and
        # collectives made there on rank >= 1 would belong to another GPU.
        torch.cuda.set_device(self.device)
        if own_stream:
            # NOTE [a stream per ooc thread]
            torch.cuda.set_stream(torch.cuda.Stream(self.device))

    def wait_compute(self, event: Event) -> None:
        # GPU-side wait: the host keeps queueing kernels; compute will not pass this point before the copy.
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        self._d2h.synchronize()
        self._h2d.synchronize()

    def max_memory_allocated(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device)
