"""What a machine can do: device memory, copy bandwidths (alone and both directions at once), host
optimizer rate. Presets carry the source of every figure."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from ooc.scheduler import checks
from ooc.scheduler.errors import HardwareError
from ooc.scheduler.units import format_bytes

GiB = 2**30
GB = 10**9
_FIX = "measure it again (ooc calibrate) or correct the hardware JSON"
_BANDWIDTHS = ("h2d", "d2h", "h2d_duplex", "d2h_duplex", "d2d", "host_optimizer")


@dataclass(frozen=True)
class Hardware:
    """Bandwidths are bytes per second; ``*_duplex`` figures hold while both directions copy at once.

    ``flops`` (dense, in the training dtype) and ``memory_bytes_per_s`` are used only by analytic
    profiles (a roofline); a measured profile brings its own compute times.
    """

    name: str
    device_memory: int
    h2d: float
    d2h: float
    h2d_duplex: float
    d2h_duplex: float
    d2d: float
    host_optimizer: float
    copy_latency_s: float
    flops: float = 0.0
    memory_bytes_per_s: float = 0.0
    compute_slowdown: float = 0.0
    """Extra compute time, as a fraction, while a copy moves bytes (0 with dedicated copy engines)."""
    copy_issue_s: float = 0.0
    """Compute-stream time per copy issued and waited for (launch, events; a thread hand-off on CPU)."""
    op_intercept_s: float = 0.0
    """Compute time per op of a selectively recomputed block that ooc's dispatch modes add, its
    forward and its re-run together (recording each op, then replaying from the cache: NOTE
    [selective recompute] in ``ooc.op_profile``). ``ooc calibrate`` measures it, on a GPU too (where
    it is host time: see ``host_runs_ahead``); the H100 and H200 presets carry the figure measured on
    an H200 machine's host (NOTE [host time under the kernels])."""
    op_issue_s: float = 0.0
    """Host time plain PyTorch takes to issue one op of a block's forward (Python modules, dispatch,
    the launch), where the host runs ahead (``host_runs_ahead``): with it, the kernels hide the
    interception only where they outlast both (``intercept_s``)."""
    host_runs_ahead: bool = False
    """The host issues the kernels ahead of the device (a GPU): ``op_intercept_s`` is host time that
    costs a block only where it outlasts the block's kernels (``intercept_s``). False on the CPU
    backend, where the host's time is the compute."""
    net: float = 0.0
    """All-reduce bus bandwidth between data-parallel ranks, bytes/s (0: not described)."""
    net_latency_s: float = 0.0
    """Fixed cost of one collective."""
    host_net: float = 0.0
    """All-reduce bus bandwidth between the ranks' host memories (gloo over the hosts' network),
    bytes/s; 0: the same as ``net``."""
    host_contention: float = 0.0
    """Extra time, as a fraction, for compute, the host update and the exchange while two of them
    run at once (they share the cores on the CPU backend; 0 on GPUs, whose host cores are idle)."""
    source: str = ""

    def __post_init__(self) -> None:
        checks.text(self.name, "name", HardwareError, hint=_FIX)
        checks.text(self.source, "source", HardwareError, hint=_FIX)
        where = f"{self.name}: "
        for name in _BANDWIDTHS:
            value = checks.number(getattr(self, name), f"bandwidth {name} (bytes/s)", HardwareError, where=where, hint=_FIX,
                                  positive=True)
            object.__setattr__(self, name, value)
        memory = checks.count(self.device_memory, "device_memory", HardwareError, where=where, hint=_FIX, positive=True)
        object.__setattr__(self, "device_memory", memory)
        for f in fields(self):
            if f.type == "float" and f.name not in _BANDWIDTHS:
                object.__setattr__(self, f.name, checks.number(getattr(self, f.name), f.name, HardwareError, where=where, hint=_FIX))
        if not isinstance(self.host_runs_ahead, bool):
            raise HardwareError(f"{where}host_runs_ahead must be true or false, got {self.host_runs_ahead!r}; {_FIX}")
        if self.h2d_duplex > self.h2d or self.d2h_duplex > self.d2h:
            raise HardwareError(f"{self.name}: a duplex bandwidth cannot exceed the one-way bandwidth")

    def intercept_s(self, ops: int, kernels_s: float) -> float:
        """Seconds ooc's per-op interception adds to a selectively recomputed block of ``ops`` ops
        whose forward and re-run run ``kernels_s`` of kernels: all of it where the host computes;
        where the host runs ahead of a GPU, what the host's time outlasts them by beyond what plain
        PyTorch's already did (NOTE [host time under the kernels]).

        NOTE [host time under the kernels]
        On a GPU a block's forward and re-run cost max(kernels, host time): the host issues each
        kernel and the device runs it while the host issues the next. A measured profile's times
        already hold plain PyTorch's issue (``op_issue_s`` per op and pass, two passes); the
        interception adds ``ops * op_intercept_s`` of host time, which costs
        max(0, issue + interception - kernels) - max(0, issue - kernels). Measured on an H200
        (``benchmarks/bench_intercept.py``): GPT-2 small's block ops run ~22 us of kernels each and
        the interception costs ~65 us per op, the tiny GPT's likewise: there the host was already
        about as busy as the kernels and all of it shows; blocks whose ops run longer kernels (long
        sequences, large widths) hide it."""
        total = ops * self.op_intercept_s
        if not self.host_runs_ahead:
            return total
        issue = 2 * ops * self.op_issue_s
        return max(0.0, issue + total - kernels_s) - max(0.0, issue - kernels_s)

    def describe(self) -> str:
        gbs = lambda v: f"{v / GB:.1f} GB/s"  # noqa: E731
        return (
            f"{self.name}: {format_bytes(self.device_memory)} device memory, H2D {gbs(self.h2d)} "
            f"(duplex {gbs(self.h2d_duplex)}), D2H {gbs(self.d2h)} (duplex {gbs(self.d2h_duplex)}), "
            f"host optimizer {gbs(self.host_optimizer)}, copy latency {self.copy_latency_s * 1e6:.0f} us"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"format": "ooc.hardware", "version": 1, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Hardware":
        checks.file_format(data, "ooc.hardware", HardwareError)
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:  # a missing field
            raise HardwareError(f"corrupt hardware JSON: {exc}; {_FIX}") from exc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# NOTE [hardware presets]
# PCIe figures are what pinned copies achieve, not link rates: Gen3 x16 is 15.8 GB/s raw, ~12 GB/s
# pinned (KARMA, SC20, Table 2 machine: V100-SXM2 16 GB); Gen4 x16 ~25 GB/s pinned on A100, falling to
# ~12-13 GB/s H2D while D2H runs at once (public measurements on an A100 with PCIe Gen4); Gen5 x16 is
# 63 GB/s raw per direction, ~50-55 GB/s pinned. The duplex figures for Gen3/Gen5 assume the same
# ~50% fall seen on Gen4. Host optimizer: Adam moves ~28 bytes per fp32 parameter; a 2-socket host
# streams ~100-200 GB/s; torch's fused CPU Adam (``Adam(fused=True)``) takes ~52 ms a step for 100M
# parameters on this project's 2-core CI machine (DeepSpeed's CPUAdam took ~64 ms there).
# host_optimizer is in bytes of fp32 parameters updated per second. copy_issue_s on CUDA is a
# cudaMemcpyAsync plus an event record and a record_stream, ~5 us of host time.
PRESETS: dict[str, Hardware] = {
    "v100-16gb": Hardware(
        name="v100-16gb",
        device_memory=16 * GiB,
        h2d=12 * GB,
        d2h=12 * GB,
        h2d_duplex=6.5 * GB,
        d2h_duplex=6.5 * GB,
        d2d=900 * GB,
        host_optimizer=40 * GB,
        copy_latency_s=10e-6,
        host_runs_ahead=True,
        copy_issue_s=5e-6,
        flops=112e12,
        memory_bytes_per_s=900 * GB,
        net=12.5 * GB,
        net_latency_s=30e-6,
        host_net=5 * GB,
        source="V100-SXM2 16GB, PCIe Gen3 x16 (KARMA's machine); 112 TFLOP/s fp16 tensor, 900 GB/s HBM2; "
        "100 Gb/s EDR InfiniBand between nodes (NCCL); gloo between hosts ~5 GB/s",
    ),
    "a100-40gb": Hardware(
        name="a100-40gb",
        device_memory=40 * GiB,
        h2d=25 * GB,
        d2h=25 * GB,
        h2d_duplex=12.5 * GB,
        d2h_duplex=12.5 * GB,
        d2d=1555 * GB,
        host_optimizer=60 * GB,
        copy_latency_s=8e-6,
        host_runs_ahead=True,
        copy_issue_s=5e-6,
        flops=312e12,
        memory_bytes_per_s=1555 * GB,
        net=25 * GB,
        net_latency_s=20e-6,
        host_net=5 * GB,
        source="A100-SXM4 40GB, PCIe Gen4 x16: ~25 GB/s pinned alone, ~12 GB/s H2D with concurrent D2H; "
        "200 Gb/s HDR InfiniBand between nodes (NCCL); gloo between hosts ~5 GB/s",
    ),
    "h100-sxm": Hardware(
        name="h100-sxm",
        device_memory=80 * GiB,
        h2d=52 * GB,
        d2h=52 * GB,
        h2d_duplex=30 * GB,
        d2h_duplex=30 * GB,
        d2d=3350 * GB,
        host_optimizer=100 * GB,
        copy_latency_s=6e-6,
        host_runs_ahead=True,
        op_intercept_s=53e-6,
        op_issue_s=18e-6,
        copy_issue_s=5e-6,
        flops=790e12,
        memory_bytes_per_s=3350 * GB,
        net=50 * GB,
        net_latency_s=20e-6,
        host_net=5 * GB,
        source="H100 SXM 80GB HBM3 3.35 TB/s; bf16 dense ~790 TFLOP/s measured; PCIe Gen5 ~52 GB/s pinned; "
        "400 Gb/s NDR InfiniBand between nodes (NCCL); gloo between hosts ~5 GB/s; op_intercept_s and op_issue_s: "
        "ooc calibrate on an H200 machine's host, 2026-11-26",
    ),
    "h200": Hardware(
        name="h200",
        device_memory=141 * GB,
        h2d=52 * GB,
        d2h=52 * GB,
        h2d_duplex=30 * GB,
        d2h_duplex=30 * GB,
        d2d=4800 * GB,
        host_optimizer=100 * GB,
        copy_latency_s=6e-6,
        host_runs_ahead=True,
        op_intercept_s=53e-6,
        op_issue_s=18e-6,
        copy_issue_s=5e-6,
        flops=790e12,
        memory_bytes_per_s=4800 * GB,
        net=50 * GB,
        net_latency_s=20e-6,
        host_net=5 * GB,
        source="H200 141GB HBM3e 4.8 TB/s; bf16 dense ~790 TFLOP/s measured; PCIe Gen5 ~52 GB/s pinned; "
        "400 Gb/s NDR InfiniBand between nodes (NCCL); gloo between hosts ~5 GB/s; op_intercept_s and op_issue_s: "
        "ooc calibrate on an H200 machine's host, 2026-11-26",
    ),
    "cpu": Hardware(
        name="cpu",
        device_memory=16 * GiB,
        h2d=9.5 * GB,
        d2h=9.0 * GB,
        h2d_duplex=8.0 * GB,
        d2h_duplex=8.0 * GB,
        d2d=30 * GB,
        host_optimizer=8.5 * GB,
        copy_latency_s=35e-6,
        copy_issue_s=90e-6,
        op_intercept_s=30e-6,
        compute_slowdown=0.9,
        flops=50e9,
        memory_bytes_per_s=8 * GB,
        net=1.0 * GB,
        net_latency_s=50e-6,
        host_contention=1.0,
        source="`ooc calibrate --backend cpu` on this project's 2-core CI machine, 2026-11-22 (op_intercept_s: "
        "2026-11-26 after the per-op speed-ups, one thread, median of 5 runs, 14-32 us; 45 us before them; run it "
        "for yours); "
        "net: a 100 MB gloo all-reduce between two local ranks takes ~0.1 s; host_contention: compute and the "
        "host update share the two cores",
    ),
}


def preset(name: str) -> Hardware:
    """A named preset: one of ``v100-16gb``, ``a100-40gb``, ``h100-sxm``, ``h200``, ``cpu``."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise HardwareError(f"no hardware preset {name!r}; choose one of {sorted(PRESETS)}") from None
