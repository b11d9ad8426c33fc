"""Planning: profiles, hardware, the schedule of a step, its simulation, and planners.

Imports no GPU code and nothing from ooc's runtime; every function here is pure.
"""

from __future__ import annotations

from ooc.scheduler.dataparallel import choose_reduce_on
from ooc.scheduler.errors import HardwareError, InfeasibleBudget, OocError, PlanError, ProfileError
from ooc.scheduler.hardware import PRESETS, Hardware, preset
from ooc.scheduler.plan import BlockPlan, Codec, Plan, Policy, Residency
from ooc.scheduler.planners import PLANNERS
from ooc.scheduler.profile import BlockProfile, Profile
from ooc.scheduler.schedule import HostUpdate, Op, OpKind, Resource, Schedule, build_schedule, peak_bytes
from ooc.scheduler.streaming import plan_with_streaming
from ooc.scheduler.units import format_bytes, parse_bytes


# NOTE [measuring from the scheduler]
# Profiling and calibration run a model and copies through the runtime: its pack hooks give the byte
# counts the runtime's tracker will see, its backends the copy engines. They live in the runtime
# (``ooc.profile``, ``ooc.calibrate``); these two names forward to them when called, so importing
# ``ooc.scheduler`` still imports no runtime or GPU code.
def profile(model, sample, **kwargs) -> Profile:  # noqa: ANN001
    """``ooc.profile``: measure a model's blocks (see there)."""
    from ooc.profiler import profile as measure

    return measure(model, sample, **kwargs)


def calibrate(backend="auto", **kwargs) -> Hardware:  # noqa: ANN001
    """``ooc.calibrate``: measure a backend's copy engines and host (see there)."""
    from ooc.calibrate import calibrate as measure

    return measure(backend, **kwargs)

__all__ = [
    "PLANNERS",
    "PRESETS",
    "BlockPlan",
    "BlockProfile",
    "Codec",
    "Hardware",
    "HostUpdate",
    "HardwareError",
    "InfeasibleBudget",
    "OocError",
    "Op",
    "OpKind",
    "Plan",
    "PlanError",
    "Policy",
    "Profile",
    "ProfileError",
    "Residency",
    "Resource",
    "Schedule",
    "build_schedule",
    "choose_reduce_on",
    "calibrate",
    "format_bytes",
    "parse_bytes",
    "peak_bytes",
    "plan_with_streaming",
    "preset",
    "profile",
]
