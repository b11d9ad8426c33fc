"""Time stamps on one device's timeline, for the profilers (``ooc.profiler``, ``ooc.op_profile``).

On the CPU a stamp is ``time.perf_counter()``. On CUDA it is an event recorded on the current
stream: taking one never waits for the GPU, so the kernels of one phase queue behind the last
phase's as in training, and a phase's time is what it adds to the stream's timeline (the host's
launch time between phases hides under the kernels, as it does in a training step). Read stamps
only after the device has synchronized (``seconds`` says so where it matters).
"""

from __future__ import annotations

import time
from typing import Any

import torch


class Clock:
    """Stamps on ``device``'s timeline; ``seconds(start, end)`` between two of them."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> Any:
        """A stamp: a float of seconds on the CPU, a recorded ``torch.cuda.Event`` on CUDA."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end``; on CUDA both events must have completed (the caller
        synchronized the device after the last of them)."""
        if self.cuda:
            return start.elapsed_time(end) / 1e3
        return end - start
