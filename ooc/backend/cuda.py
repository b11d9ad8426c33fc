"""The CUDA backend: one side stream per copy direction, events between streams, pinned host memory.

Nothing here runs at import time; ``torch.cuda`` is touched only when a ``CudaBackend`` is built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ooc.backend.base import Backend, Event


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("backend='cuda' needs a CUDA device; use backend='cpu' on this machine")
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else torch.device(device).index)
        self._d2h = torch.cuda.Stream(self.device)
        self._h2d = torch.cuda.Stream(self.device)

    def __repr__(self) -> str:
        return f"CudaBackend({self.device})"

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        # Allocated on the compute stream so the caching allocator orders its reuse after compute.
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def record_compute(self) -> Event:
        # blocking: ooc's host threads wait on these events (the exchange thread on compute, the pool
        # and the update thread on copies); a default event spin-waits, burning the core the host
        # optimizer needs. A blocking one sleeps in the driver instead.
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _copy(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor, after: tuple[Event, ...]) -> Event:
        for event in after:
            # The copy must not start before the producer (compute or the opposite copy) is done.
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        for tensor in (dst, src):
            if tensor.is_cuda:
                # The compute stream may drop its reference before the copy runs: tell the caching
                # allocator the copy stream still uses this memory.
                tensor.record_stream(stream)
        done = torch.cuda.Event(blocking=True)  # host waits sleep, not spin (see record_compute)
        done.record(stream)
        return done

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after: tuple[Event, ...]) -> Event:
        return self._copy(self._d2h, dst, src, after)

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after: tuple[Event, ...]) -> Event:
        return self._copy(self._h2d, dst, src, after)

    @contextlib.contextmanager
    def encode_context(self, source: torch.Tensor) -> Iterator[None]:
        # The quantize kernel runs on the copy stream, after compute has produced its input; compute
        # may drop the input meanwhile, so the allocator must know the copy stream still reads it.
        self._d2h.wait_event(self.record_compute())
        source.record_stream(self._d2h)
        with torch.cuda.stream(self._d2h):
            yield

    def wait_compute(self, event: Event) -> None:
        # GPU-side wait: the host keeps queueing kernels; compute will not pass this point before the copy.
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        self._d2h.synchronize()
        self._h2d.synchronize()

    def max_memory_allocated(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device)
