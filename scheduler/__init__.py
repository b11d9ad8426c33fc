"""Planning: profiles, hardware, the schedule of a step, its simulation, and planners.

Imports no GPU code and nothing from ooc's runtime; every function here is pure. Measuring a
profile or a machine runs a model and copies, so that lives in the runtime: ``ooc.profile`` and
``ooc.calibrate.calibrate``.
"""

from __future__ import annotations

from ooc.scheduler.dataparallel import choose_reduce_on
from ooc.scheduler.errors import HardwareError, InfeasibleBudget, OocError, PlanError, ProfileError, SizeError
from ooc.scheduler.hardware import PRESETS, Hardware, preset
from ooc.scheduler.param_planner import plan_with_streaming
from ooc.scheduler.plan import BlockPlan, Codec, Plan, Policy, Residency
from ooc.scheduler.planners import PLANNERS
from ooc.scheduler.profile import BlockProfile, Profile
from ooc.scheduler.schedule import HostUpdate, Op, OpKind, Resource, Schedule, build_schedule, peak_bytes
from ooc.scheduler.units import format_bytes, parse_bytes

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
    "SizeError",
    "build_schedule",
    "choose_reduce_on",
    "format_bytes",
    "parse_bytes",
    "peak_bytes",
    "plan_with_streaming",
    "preset",
]
