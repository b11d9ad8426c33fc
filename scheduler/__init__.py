"""Planning: profiles, hardware, the schedule of a step, its simulation, and planners.

Imports no GPU code and nothing from ooc's runtime; every function here is pure.
"""

from __future__ import annotations

from ooc.scheduler.hardware import PRESETS, Hardware, HardwareError, preset
from ooc.scheduler.plan import BlockPlan, Codec, Plan, PlanError, Policy
from ooc.scheduler.planners import PLANNERS
from ooc.scheduler.profile import BlockProfile, Profile, ProfileError
from ooc.scheduler.schedule import Op, OpKind, Resource, Schedule, build_schedule, peak_bytes
from ooc.scheduler.units import format_bytes, parse_bytes

__all__ = [
    "PLANNERS",
    "PRESETS",
    "BlockPlan",
    "BlockProfile",
    "Codec",
    "Hardware",
    "HardwareError",
    "Op",
    "OpKind",
    "Plan",
    "PlanError",
    "Policy",
    "Profile",
    "ProfileError",
    "Resource",
    "Schedule",
    "build_schedule",
    "format_bytes",
    "parse_bytes",
    "peak_bytes",
    "preset",
]
