"""Data-parallel choices the performance model makes: where gradients are summed."""

from __future__ import annotations

from ooc.scheduler.hardware import Hardware
from ooc.scheduler.plan import Plan
from ooc.scheduler.profile import Profile
from ooc.scheduler.schedule import HostUpdate, build_schedule
from ooc.scheduler.simulate import simulate


def predict_with_update(plan: Plan, profile: Profile, hardware: Hardware, update: HostUpdate | None) -> float:
    """Predicted step time of ``plan`` with the host optimizer's work ``update`` (seconds)."""
    return simulate(build_schedule(plan, profile, hardware, update), hardware, keep_timeline=False).step_time_s


def choose_reduce_on(plan: Plan, profile: Profile, hardware: Hardware, *, world: int, shard: bool = False,
                     copies: bool = True) -> tuple[str, dict[str, float]]:
    """``"device"`` or ``"host"``, whichever the simulator predicts faster, with both predictions.

    Summing on the device puts the exchange before the copy out, beside the backward's compute;
    summing on the host puts it after, leaving the device's links to the activation swaps. Ties go
    to ``"host"`` (it needs no device memory for a flat gradient buffer).
    """
    seconds = {
        where: predict_with_update(plan, profile, hardware, HostUpdate(world=world, reduce_on=where, shard=shard, copies=copies))
        for where in ("host", "device")
    }
    return min(seconds, key=lambda where: (seconds[where], where != "host")), seconds
