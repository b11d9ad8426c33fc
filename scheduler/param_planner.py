"""Planning with weight streaming: which blocks keep their parameters on the host.

The budget then bounds device bytes of parameters and saved activations together: the predicted
parameter peak (resident parameters, plus the streamed blocks present at once) plus the predicted
activation peak. Streaming ``k`` blocks frees their parameters but adds their copies in, twice a
step, to the H2D engine; for each ``k`` the activation planner gets what the parameters leave, and
the simulator picks the fastest combination.
"""

from __future__ import annotations

from collections.abc import Callable

from ooc.scheduler.costmodel import build_options
from ooc.scheduler.errors import InfeasibleBudget
from ooc.scheduler.hardware import Hardware
from ooc.scheduler.optimal import minimum_peak
from ooc.scheduler.plan import Plan
from ooc.scheduler.profile import Profile
from ooc.scheduler.schedule import build_schedule
from ooc.scheduler.simulate import simulate
from ooc.scheduler.units import check_budget

PATIENCE = 3
"""Stop adding streamed blocks after this many counts in a row that are no faster."""


def streaming_order(profile: Profile) -> list[int]:
    """Blocks in the order they are streamed: most streamed parameter bytes first, then the earliest."""
    return sorted(range(len(profile)), key=lambda i: (-profile.blocks[i].streamed_param_bytes, i))


def param_peak(profile: Profile, streamed: list[int], prefetch: int = 2) -> int:
    probe = Plan.uniform("recompute", len(profile), prefetch=prefetch).streaming(streamed)
    return build_schedule(probe, profile).param_peak_bytes


def plan_with_streaming(
    profile: Profile,
    hardware: Hardware,
    budget: int,
    planner: Callable[..., Plan],
    *,
    prefetch: int = 2,
) -> Plan:
    """The fastest plan (by the simulator) whose parameter peak plus activation peak fits ``budget``.

    Streams the fewest blocks that make the smallest activation peak fit, then one more at a time
    while the simulated step gets faster (up to ``PATIENCE`` counts without a gain). Raises
    :class:`InfeasibleBudget` with the smallest total reachable.
    """
    check_budget(budget)
    order = streaming_order(profile)
    least_activations = minimum_peak(build_options(profile, hardware), prefetch)
    peaks = [param_peak(profile, order[:k], prefetch) for k in range(len(profile) + 1)]
    feasible = [k for k, peak in enumerate(peaks) if peak + least_activations <= budget]
    if not feasible:
        raise InfeasibleBudget(budget, min(peaks) + least_activations)
    best: tuple[float, Plan] | None = None
    misses = 0
    for k in range(feasible[0], len(profile) + 1):
        try:
            plan = planner(profile, hardware, budget - peaks[k], prefetch=prefetch).streaming(order[:k])
        except InfeasibleBudget:
            continue
        schedule = build_schedule(plan, profile, hardware)
        if schedule.peak_bytes + schedule.param_peak_bytes > budget:
            continue
        seconds = simulate(schedule, hardware, keep_timeline=False).step_time_s
        if best is None or seconds < best[0] - 1e-12:
            best, misses = (seconds, plan), 0
        else:
            misses += 1
            if misses >= PATIENCE:
                break
    if best is None:
        raise InfeasibleBudget(budget, peaks[feasible[0]] + least_activations)
    return best[1]
