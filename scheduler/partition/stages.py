"""Out of core per device: a chain of blocks cut into contiguous stages, one per device, each
stage planned by the existing keep/swap/recompute planner under the memory its device has left.

# NOTE [how the two plans compose]
The partition decides *where* each block runs; the planner (``ooc.scheduler.planners``) decides
*how* a device holds its blocks' activations. They compose over a chain model cut into contiguous
stages, stage ``d`` (blocks ``bounds[d]:bounds[d+1]``) on device ``d``:

- a device's part is a sub-chain, so its plan is an ordinary plan over a sub-profile (the blocks'
  own rows of the profile), made by any planner;
- the device keeps its blocks' parameters and gradients resident (``param_bytes + grad_bytes``; the
  parameters and time outside the chain, embeddings and head, go with the stage holding block 0),
  so the planner's activation budget is the capacity less those bytes;
- the partition's memory model then takes that device's peak as the resident bytes plus the plan's
  predicted activation peak (the schedule's peak), and its time as the plan's simulated step
  (recomputation and exposed swaps included), not the in-core time;
- one training step runs the stages one after another (forward 0..K-1, backward K-1..0: one
  step, no micro-batches), so the step's makespan is the sum of the stages' planned steps plus, at
  each cut, the block output's copy forward and its gradient's copy back.

A device with room for everything keeps everything (the planner's plan under a large budget is
all-keep), so a generous machine costs nothing; a tight one trades the copies of one more cut
against the recomputation or swaps of a fuller device, which :func:`stage_chain` weighs by
dynamic programming over the cuts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache

import numpy as np

from ooc.scheduler.errors import InfeasibleBudget, PlanError
from ooc.scheduler.hardware import Hardware
from ooc.scheduler.partition.devices import Devices
from ooc.scheduler.plan import Plan
from ooc.scheduler.planners import PLANNERS
from ooc.scheduler.profile import Profile
from ooc.scheduler.schedule import build_schedule
from ooc.scheduler.simulate import simulate


@dataclass(frozen=True)
class StagePlan:
    """Device ``device`` runs blocks ``first:stop`` under ``plan`` (``None`` when no plan fits its
    ``budget`` of activation bytes, or for an empty stage). ``resident_bytes``: parameters and
    gradients it keeps; ``activation_peak``: the plan's predicted peak of saved activations;
    ``step_s``: the plan's simulated forward + backward of the stage; ``in_core_s``: the same with
    every block kept (``step_s - in_core_s`` is what out of core costs there)."""

    device: int
    first: int
    stop: int
    resident_bytes: int
    budget: int
    plan: Plan | None
    activation_peak: int
    step_s: float
    in_core_s: float

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.activation_peak

    @property
    def fits(self) -> bool:
        return self.plan is not None or self.first == self.stop


@dataclass(frozen=True)
class StagedPlan:
    """The stages of a chain over K devices with each stage's plan; ``copy_s``: the boundary
    copies (each cut: the activation forward, its gradient back); ``makespan_s``: one step."""

    stages: tuple[StagePlan, ...]
    copy_s: float

    @property
    def makespan_s(self) -> float:
        return sum(s.step_s for s in self.stages) + self.copy_s

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    @property
    def peak_bytes(self) -> np.ndarray:
        """``(K,)`` predicted peak bytes per device."""
        return np.array([s.peak_bytes for s in self.stages], dtype=float)

    @property
    def bounds(self) -> tuple[int, ...]:
        return (*(s.first for s in self.stages), self.stages[-1].stop)


Planner = Callable[..., Plan]


def plan_stage(profile: Profile, hardware: Hardware, first: int, stop: int, capacity: int, *, device: int = 0,
               planner: str | Planner = "optimal", prefetch: int = 2) -> StagePlan:
    """Blocks ``first:stop`` of ``profile`` on a device of ``capacity`` bytes, planned by
    ``planner`` (a name in ``PLANNERS`` or a planner function) under the activation budget the
    device has left (NOTE [how the two plans compose]); the stage holding block 0 also holds what
    is outside the chain."""
    plan_fn = _planner(planner)
    if not 0 <= first <= stop <= len(profile):
        raise PlanError(f"stage {first}:{stop} is not within the chain's {len(profile)} blocks")
    if first == stop:
        return StagePlan(device, first, stop, 0, int(capacity), None, 0, 0.0, 0.0)
    part = _sub_profile(profile, first, stop, outside=first == 0)
    resident = sum(b.param_bytes + b.grad_bytes for b in part.blocks) + 2 * part.outside_param_bytes
    budget = int(capacity) - resident
    in_core = _step_s(_keep_all(part), part, hardware)
    if budget < 0:
        return StagePlan(device, first, stop, resident, budget, None, 0, in_core, in_core)
    try:
        plan = plan_fn(part, hardware, budget, prefetch=prefetch)
    except InfeasibleBudget:
        return StagePlan(device, first, stop, resident, budget, None, 0, in_core, in_core)
    schedule = build_schedule(plan, part, hardware)
    if schedule.peak_bytes > budget:   # a heuristic planner's best effort that does not fit
        return StagePlan(device, first, stop, resident, budget, None, schedule.peak_bytes, in_core, in_core)
    return StagePlan(device, first, stop, resident, budget, plan, schedule.peak_bytes,
                     simulate(schedule, hardware, keep_timeline=False).step_time_s, in_core)


def plan_per_device(profile: Profile, hardware: Hardware, devices: Devices, bounds: Sequence[int], *,
                    planner: str | Planner = "optimal", prefetch: int = 2) -> StagedPlan:
    """The chain cut at ``bounds`` (``K + 1`` block indices from 0 to ``len(profile)``, stage ``d``
    = blocks ``bounds[d]:bounds[d+1]`` on device ``d``), each stage planned out of core under its
    device's capacity (NOTE [how the two plans compose])."""
    bounds = [int(b) for b in bounds]
    if len(bounds) != devices.k + 1 or bounds[0] != 0 or bounds[-1] != len(profile) or \
            any(a > b for a, b in zip(bounds, bounds[1:])):
        raise PlanError(f"stage bounds {bounds} must be {devices.k + 1} rising block indices from 0 to "
                        f"{len(profile)}, one stage per device")
    stages = tuple(plan_stage(profile, hardware, bounds[d], bounds[d + 1], devices.capacities[d], device=d,
                              planner=planner, prefetch=prefetch) for d in range(devices.k))
    return StagedPlan(stages, _copies_s(profile, devices, bounds))


def stage_chain(profile: Profile, hardware: Hardware, devices: Devices, *, planner: str | Planner = "optimal",
                prefetch: int = 2) -> StagedPlan:
    """The contiguous stages with the shortest planned step among those where every device's plan
    fits, by dynamic programming over the cuts: ``O(K n^2)`` stage plans (each cached). Raises
    :class:`PlanError` when no cut fits, naming the devices' total it would take."""
    n, k = len(profile), devices.k

    @cache
    def stage(first: int, stop: int, d: int) -> StagePlan:
        return plan_stage(profile, hardware, first, stop, devices.capacities[d], device=d, planner=planner,
                          prefetch=prefetch)

    copy = [0.0] + [2 * devices.transfer_s(profile.blocks[b - 1].output_bytes) for b in range(1, n)] + [0.0]
    inf = float("inf")
    # best[d][b]: the shortest planned time of blocks 0:b on devices 0..d-1, the last stage ending at b.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[-1] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for d in range(1, k + 1):
        for b in range(n + 1):
            for a in range(b + 1):
                if best[d - 1][a] == inf:
                    continue
                s = stage(a, b, d - 1)
                if not s.fits:
                    continue
                t = best[d - 1][a] + s.step_s + (copy[a] if 0 < a < n and a < b else 0.0)
                if t < best[d][b] - 1e-15:
                    best[d][b], cut[d][b] = t, a
    if best[k][n] == inf:
        raise PlanError(f"no contiguous stages of the {n}-block chain fit {k} devices of "
                        f"{', '.join(str(c) for c in devices.capacities)} bytes, even out of core; use more "
                        "devices or larger ones")
    bounds = [n]
    for d in range(k, 0, -1):
        bounds.append(cut[d][bounds[-1]])
    return plan_per_device(profile, hardware, devices, bounds[::-1], planner=planner, prefetch=prefetch)


def _planner(planner: str | Planner) -> Planner:
    if callable(planner):
        return planner
    if planner not in PLANNERS:
        raise PlanError(f"no planner {planner!r}; choose from {sorted(PLANNERS)}")
    return PLANNERS[planner]


def _keep_all(profile: Profile) -> Plan:
    return PLANNERS["keep-all"](profile)


def _sub_profile(profile: Profile, first: int, stop: int, *, outside: bool) -> Profile:
    zero = dict(outside_forward_s=0.0, outside_backward_s=0.0, outside_param_bytes=0)
    return replace(profile, blocks=profile.blocks[first:stop], **({} if outside else zero))


def _step_s(plan: Plan, profile: Profile, hardware: Hardware) -> float:
    return simulate(build_schedule(plan, profile, hardware), hardware, keep_timeline=False).step_time_s


def _copies_s(profile: Profile, devices: Devices, bounds: Sequence[int]) -> float:
    """Each inner cut with blocks on both sides: the activation forward and its gradient back."""
    total = 0.0
    for d in range(1, len(bounds) - 1):
        b = bounds[d]
        if 0 < b < len(profile) and bounds[d - 1] < b:
            total += 2 * devices.transfer_s(profile.blocks[b - 1].output_bytes)
    return total
