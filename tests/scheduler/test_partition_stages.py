"""Out of core per device (ooc.scheduler.partition.stages): a chain cut into contiguous stages,
each planned by the keep/swap/recompute planner under its device's capacity less its resident
parameters and gradients; the step's makespan is the stages' planned steps plus the cut copies."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from ooc.scheduler import Policy, build_schedule, preset
from ooc.scheduler.analytic import transformer
from ooc.scheduler.errors import PlanError
from ooc.scheduler.partition import Devices, plan_per_device, plan_stage, stage_chain
from ooc.scheduler.simulate import simulate

HW = preset("h100-sxm")
PROFILE = transformer(name="t", layers=6, hidden=1024, heads=8, seq=1024, batch=4, vocab=8000, hardware=HW)


def _resident(first: int, stop: int) -> int:
    blocks = PROFILE.blocks[first:stop]
    return sum(b.param_bytes + b.grad_bytes for b in blocks) + (2 * PROFILE.outside_param_bytes if first == 0 else 0)


def _whole() -> int:
    return _resident(0, len(PROFILE)) + sum(b.saved_bytes for b in PROFILE.blocks)


def test_a_roomy_machine_keeps_everything_and_pays_only_the_cut_copies() -> None:
    devices = Devices.uniform(2, _whole())
    staged = plan_per_device(PROFILE, HW, devices, [0, 3, 6])
    assert staged.fits
    for s in staged.stages:
        assert all(b.policy is Policy.KEEP for b in s.plan.blocks)
        assert s.step_s == s.in_core_s
        assert s.resident_bytes == _resident(s.first, s.stop)
        assert s.budget == devices.capacities[s.device] - s.resident_bytes
    copy = 2 * devices.transfer_s(PROFILE.blocks[2].output_bytes)
    assert staged.copy_s == copy
    assert staged.makespan_s == sum(s.step_s for s in staged.stages) + copy


def test_a_tight_device_plans_its_part_out_of_core_within_what_is_left() -> None:
    capacity = int(0.3 * _whole())
    s = plan_stage(PROFILE, HW, 0, 3, capacity)
    assert s.fits and s.budget == capacity - _resident(0, 3)
    assert any(b.policy is not Policy.KEEP for b in s.plan.blocks)
    schedule = build_schedule(s.plan, replace(PROFILE, blocks=PROFILE.blocks[:3]), HW)
    assert s.activation_peak == schedule.peak_bytes <= s.budget
    assert s.peak_bytes == s.resident_bytes + s.activation_peak <= capacity
    assert s.step_s == simulate(schedule, HW, keep_timeline=False).step_time_s
    assert s.step_s > s.in_core_s   # recomputation or exposed swaps


def test_a_device_smaller_than_its_parameters_does_not_fit() -> None:
    s = plan_stage(PROFILE, HW, 0, 6, _resident(0, 6) - 1)
    assert not s.fits and s.plan is None and s.budget < 0


def test_stage_chain_is_the_fastest_fitting_cut() -> None:
    """Against every cut of the 6-block chain over 3 devices at a capacity where some devices must
    go out of core: the dynamic programme's makespan is the least of the fitting ones."""
    devices = Devices.uniform(3, int(0.3 * _whole()))
    best = stage_chain(PROFILE, HW, devices, planner="greedy")
    fitting = []
    for a, b in itertools.combinations_with_replacement(range(7), 2):
        staged = plan_per_device(PROFILE, HW, devices, [0, a, b, 6], planner="greedy")
        if staged.fits:
            fitting.append(staged.makespan_s)
    assert best.fits and fitting
    assert best.makespan_s == pytest.approx(min(fitting), rel=1e-12)
    assert all(p <= c for p, c in zip(best.peak_bytes, devices.capacities))


def test_no_fitting_cut_and_bad_bounds_raise() -> None:
    with pytest.raises(PlanError, match="even out of core"):
        stage_chain(PROFILE, HW, Devices.uniform(2, _resident(1, 2)), planner="greedy")
    with pytest.raises(PlanError, match="rising block indices"):
        plan_per_device(PROFILE, HW, Devices.uniform(2, _whole()), [0, 4, 3])
    with pytest.raises(PlanError, match="no planner"):
        plan_stage(PROFILE, HW, 0, 1, _whole(), planner="nope")
