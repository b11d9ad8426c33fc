"""Planning with weight streaming: parameters and saved activations under one budget."""

from __future__ import annotations

import pytest

from ooc.scheduler.analytic import decoder_7b
from ooc.scheduler.hardware import preset
from ooc.scheduler.param_planner import plan_with_streaming
from ooc.scheduler.plan import Plan
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



def _tied(profile, shared_bytes: int):  # noqa: ANN001, ANN202
    """``profile`` whose every block also holds one weight of ``shared_bytes`` that all blocks share (ALBERT)."""
    import dataclasses

    from ooc.scheduler.profile import SharedParameter

    return dataclasses.replace(profile, blocks=tuple(
        dataclasses.replace(b, param_bytes=b.param_bytes + shared_bytes, shared_params=(SharedParameter(0, shared_bytes),))
        for b in profile.blocks))


def test_a_weight_shared_by_every_block_counts_once_and_is_never_streamed() -> None:
    shared = 256 * 2**20
    tied = _tied(PROFILE, shared)
    keep = Plan.uniform("keep", len(PROFILE))
    assert build_schedule(keep, tied).param_peak_bytes == PARAMS + shared
    all_streamed = build_schedule(keep.streaming(list(range(len(PROFILE)))), tied)
    untied_streamed = build_schedule(keep.streaming(list(range(len(PROFILE)))), PROFILE)
    assert all_streamed.param_peak_bytes == untied_streamed.param_peak_bytes + shared
    moved = [op.bytes_moved for op in all_streamed.ops if op.kind.name == "STREAM_IN"]
    assert moved and moved == [op.bytes_moved for op in untied_streamed.ops if op.kind.name == "STREAM_IN"]


def test_shared_parameters_round_trip_and_are_checked() -> None:
    import dataclasses

    from ooc.scheduler.errors import ProfileError
    from ooc.scheduler.profile import Profile, SharedParameter

    tied = _tied(PROFILE, 2**20)
    assert Profile.from_json(tied.to_json()) == tied
    with pytest.raises(ProfileError, match="shared parameter 0 has"):
        dataclasses.replace(tied, blocks=(dataclasses.replace(tied.blocks[0], shared_params=(SharedParameter(0, 2**19),)),
                                          *tied.blocks[1:]))
    with pytest.raises(ProfileError, match="exceed param_bytes"):
        dataclasses.replace(tied.blocks[0], shared_params=(SharedParameter(0, tied.blocks[0].param_bytes + 1),))
