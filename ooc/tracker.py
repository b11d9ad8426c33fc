"""Counts the device bytes the plan keeps: saved activations per block, with the peak.

PyTorch's CUDA memory statistics are zero on CPU builds, and on GPUs they mix in everything else the
allocator holds; this tracker counts exactly what the performance model predicts, on any backend.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryReport:
    """Device-resident saved-activation bytes over the last step (``peak_bytes``) and since wrap.

    ``cuda_max_allocated`` (CUDA only, else ``None``): the caching allocator's peak of allocated
    bytes over the same step as ``peak_bytes`` (its peak statistics are reset when the step's
    forward starts), counting everything the allocator holds (parameters, gradients, transients),
    not the process-lifetime maximum.
    """

    current_bytes: int
    peak_bytes: int
    max_peak_bytes: int
    block_peak_bytes: tuple[int, ...]
    swapped_out_bytes: int
    swapped_in_bytes: int
    host_pool_bytes: int
    """Host bytes of the backend's arena (page-locked on CUDA), in use or free: the swap buffers and
    the host optimizer's transfer buffers (NOTE [host arena] in ooc.backend.arena)."""
    cuda_max_allocated: int | None
    param_bytes: int = 0
    """Parameter bytes on the device now (resident ones, and streamed ones while in use)."""
    param_peak_bytes: int = 0
    """Their peak over the last step."""

    def __str__(self) -> str:
        from ooc.scheduler.units import format_bytes

        cuda = "" if self.cuda_max_allocated is None else f", cuda max allocated {format_bytes(self.cuda_max_allocated)}"
        return (
            f"peak {format_bytes(self.peak_bytes)} of saved activations on device "
            f"(now {format_bytes(self.current_bytes)}); moved out {format_bytes(self.swapped_out_bytes)}, "
            f"in {format_bytes(self.swapped_in_bytes)}; host arena {format_bytes(self.host_pool_bytes)}; "
            f"parameters on device: peak {format_bytes(self.param_peak_bytes)}{cuda}"
        )


class MemoryTracker:
    def __init__(self, num_blocks: int, device: torch.device | None = None) -> None:
        self._device = device
        """A CUDA device: the allocator's peak statistics follow the tracker's steps."""
        self._lock = threading.Lock()
        self._block = [0] * num_blocks
        self._block_peak = [0] * num_blocks
        self.current = 0
        self.peak = 0
        self.max_peak = 0
        self.swapped_out = 0
        self.swapped_in = 0
        self.log: list[tuple[str, int, int, object]] | None = None
        """When a list, every change is appended as (what, block, bytes, dtype or None)."""
        self.params = 0
        self.params_peak = 0

    def set_resident_params(self, nbytes: int) -> None:
        """Parameter bytes that stay on the device (all but the streamed ones)."""
        with self._lock:
            self.params = self.params_peak = nbytes

    def alloc_params(self, nbytes: int) -> None:
        with self._lock:
            self.params += nbytes
            self.params_peak = max(self.params_peak, self.params)

    def free_params(self, nbytes: int) -> None:
        with self._lock:
            self.params -= nbytes

    def alloc(self, block: int, nbytes: int, what: str = "alloc", dtype: object = None) -> None:
        with self._lock:
            self.current += nbytes
            self._block[block] += nbytes
            if self._block[block] > self._block_peak[block]:
                self._block_peak[block] = self._block[block]
            if self.current > self.peak:
                self.peak = self.current
                if self.peak > self.max_peak:
                    self.max_peak = self.peak
            if self.log is not None:
                self.log.append((what, block, nbytes, dtype))

    def free(self, block: int, nbytes: int, what: str = "free") -> None:
        with self._lock:
            self.current -= nbytes
            self._block[block] -= nbytes
            if self.log is not None:
                self.log.append((what, block, -nbytes, None))

    def start_step(self) -> None:
        """The next step's peak starts from what is resident now."""
        with self._lock:
            self.peak = self.current
            self.params_peak = self.params
            self._block_peak = list(self._block)
            self.swapped_out = 0
            self.swapped_in = 0
        if self._device is not None and self._device.type == "cuda":
            # The allocator's peak over this step, as peak_bytes (no device sync: host-side counters).
            torch.cuda.reset_peak_memory_stats(self._device)

    def report(self, host_pool_bytes: int, cuda_max_allocated: int | None) -> MemoryReport:
        with self._lock:
            return MemoryReport(
                current_bytes=self.current,
                peak_bytes=self.peak,
                max_peak_bytes=self.max_peak,
                block_peak_bytes=tuple(self._block_peak),
                swapped_out_bytes=self.swapped_out,
                swapped_in_bytes=self.swapped_in,
                host_pool_bytes=host_pool_bytes,
                cuda_max_allocated=cuda_max_allocated,
                param_bytes=self.params,
                param_peak_bytes=self.params_peak,
            )
