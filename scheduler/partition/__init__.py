"""Partition a training step's op graph over K devices under memory limits (after ParDNN).

Pure functions, like the rest of ``ooc.scheduler``: an :class:`OpGraph` (ops with their time and
the bytes they hold, tensors with the bytes they carry) and :class:`Devices` (capacities, link
bandwidth and latency) in, a :class:`Placement` (a device per op) out; :func:`simulate` gives a
placement's makespan and per-device peak. Capturing a model's graph runs it, so that lives in the
runtime (``ooc.partition_capture``).
"""

from __future__ import annotations

from ooc.scheduler.partition.baselines import contiguous, heft, mincut
from ooc.scheduler.partition.devices import Devices, Placement
from ooc.scheduler.partition.graph import GraphError, OpGraph, read_pardnn, read_pardnn_placement, write_pardnn
from ooc.scheduler.partition.pardnn_method import pardnn
from ooc.scheduler.partition.search import (
    METHODS,
    InfeasiblePartition,
    Outcome,
    minimum_capacity,
    partition,
    run_methods,
)
from ooc.scheduler.partition.simulate import Simulation, simulate
from ooc.scheduler.partition.stages import StagedPlan, StagePlan, plan_per_device, plan_stage, stage_chain

__all__ = [
    "METHODS",
    "Devices",
    "GraphError",
    "InfeasiblePartition",
    "OpGraph",
    "Outcome",
    "Placement",
    "Simulation",
    "StagePlan",
    "StagedPlan",
    "contiguous",
    "heft",
    "minimum_capacity",
    "mincut",
    "pardnn",
    "partition",
    "plan_per_device",
    "plan_stage",
    "read_pardnn",
    "read_pardnn_placement",
    "run_methods",
    "simulate",
    "stage_chain",
    "write_pardnn",
]
