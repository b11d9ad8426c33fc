"""The machine a graph is partitioned over (K devices, their memory, the links between them) and a
placement (which device runs each op)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ooc.scheduler.errors import PlanError


@dataclass(frozen=True)
class Devices:
    """``capacities``: bytes each of the K devices may hold; every pair of devices is joined by a
    link of ``bandwidth_Bps`` per direction and ``latency_s`` per transfer (a tensor crossing a cut
    edge costs ``latency_s + bytes / bandwidth_Bps`` on its link)."""

    capacities: tuple[int, ...]
    bandwidth_Bps: float = 50e9
    latency_s: float = 10e-6

    def __post_init__(self) -> None:
        if len(self.capacities) < 1:
            raise PlanError("give at least one device capacity")
        for c in self.capacities:
            if not isinstance(c, (int, float, np.integer, np.floating)) or not math.isfinite(c) or c < 0:
                raise PlanError(f"device capacity {c!r} must be a finite number of bytes >= 0")
        if not math.isfinite(self.bandwidth_Bps) or self.bandwidth_Bps <= 0:
            raise PlanError(f"link bandwidth {self.bandwidth_Bps!r} must be a finite number of bytes/s > 0")
        if not math.isfinite(self.latency_s) or self.latency_s < 0:
            raise PlanError(f"link latency {self.latency_s!r} must be a finite number of seconds >= 0")

    @classmethod
    def uniform(cls, k: int, capacity: int, *, bandwidth_Bps: float = 50e9, latency_s: float = 10e-6) -> Devices:
        if k < 1:
            raise PlanError(f"--devices {k}: give at least one device")
        return cls(tuple([int(capacity)] * k), bandwidth_Bps, latency_s)

    @property
    def k(self) -> int:
        return len(self.capacities)

    def scaled(self, factor: float) -> Devices:
        """The same machine with every capacity multiplied by ``factor`` (rounded up)."""
        return Devices(tuple(int(math.ceil(c * factor)) for c in self.capacities), self.bandwidth_Bps, self.latency_s)

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True, eq=False)
class Placement:
    """``device``: ``(n,)`` int, the device (0..K-1) of each op of the graph, made by ``method``."""

    method: str
    device: np.ndarray

    def __post_init__(self) -> None:
        self.device.setflags(write=False)

    @classmethod
    def of(cls, method: str, device, k: int, n: int) -> Placement:
        d = np.asarray(device, dtype=np.int64).reshape(-1).copy()
        if d.shape[0] != n:
            raise PlanError(f"a placement of {d.shape[0]} ops for a graph of {n}; place every op")
        if n and (d.min() < 0 or d.max() >= k):
            raise PlanError(f"a placement names devices {int(d.min())}..{int(d.max())}; there are 0..{k - 1}")
        return cls(method, d)
