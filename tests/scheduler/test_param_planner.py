"""Planning with weight streaming: parameters and saved activations under one budget."""

from __future__ import annotations

import pytest

from ooc.scheduler.analytic import decoder_7b
from ooc.scheduler.hardware import preset
from ooc.scheduler.param_planner import plan_with_streaming
from ooc.scheduler.planners import PLANNERS, InfeasibleBudget
from ooc.scheduler.schedule import build_schedule

HW = preset("h100-sxm")
PROFILE = decoder_7b(1024, 1, HW)
PARAMS = sum(b.param_bytes for b in PROFILE.blocks) + PROFILE.outside_param_bytes
ACTIVATIONS = sum(b.saved_bytes for b in PROFILE.blocks)


def _total(plan) -> int:  # noqa: ANN001
    schedule = build_schedule(plan, PROFILE)
    return schedule.peak_bytes + schedule.param_peak_bytes


def test_nothing_streams_when_everything_fits() -> None:
    plan = plan_with_streaming(PROFILE, HW, PARAMS + ACTIVATIONS, PLANNERS["optimal"])
    assert not any(b.streamed for b in plan.blocks)
    assert all(b.policy.value == "keep" for b in plan.blocks)


@pytest.mark.parametrize("fraction", [0.5, 0.25, 0.12])
def test_tight_budgets_stream_some_blocks_and_fit(fraction: float) -> None:
    budget = int(PARAMS * fraction) + ACTIVATIONS // 20
    plan = plan_with_streaming(PROFILE, HW, budget, PLANNERS["optimal"])
    streamed = sum(b.streamed for b in plan.blocks)
    assert 0 < streamed <= len(plan)
    assert _total(plan) <= budget
    assert PARAMS > budget  # the parameters alone would not fit: the model trains only because of streaming


def test_the_reported_minimum_is_reachable() -> None:
    with pytest.raises(InfeasibleBudget) as info:
        plan_with_streaming(PROFILE, HW, 10 * 2**20, PLANNERS["optimal"])
    minimum = info.value.minimum_bytes
    plan = plan_with_streaming(PROFILE, HW, minimum, PLANNERS["optimal"])
    assert _total(plan) <= minimum and all(b.streamed for b in plan.blocks)

