"""Planning with weight streaming: parameters and saved activations under one budget."""

from __future__ import annotations

import pytest
import torch

import ooc
from ooc.errors import BudgetError
from ooc.scheduler.analytic import decoder_7b
from ooc.scheduler.costmodel import build_options
from ooc.scheduler.hardware import preset
from ooc.scheduler.optimal import minimum_peak
from ooc.scheduler.param_planner import plan_with_streaming
from ooc.scheduler.planners import PLANNERS, InfeasibleBudget
from ooc.scheduler.schedule import build_schedule
from tests.helpers import gpt_batch

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


def test_wrap_with_include_params_keeps_parameters_and_activations_within_the_budget() -> None:
    torch.manual_seed(0)
    model = ooc.models.GPT("nano")
    prof = ooc.profile(model, gpt_batch())
    total_params = sum(p.numel() * p.element_size() for p in model.parameters())
    # Below what the parameters and the smallest activation peak need without streaming.
    budget = int(total_params * 0.8) + minimum_peak(build_options(prof, preset("cpu")), 2)
    ooc.wrap(model, budget=budget, profile=prof, include_params=True, backend="chaos")
    plan = ooc.runtime.runtime_of(model).plan
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        model(*gpt_batch(seed=step))[1].backward()
        opt.step()
        opt.zero_grad()
    report = ooc.memory_report(model)
    ooc.unwrap(model)
    assert any(b.streamed for b in plan.blocks)
    assert report.param_peak_bytes + report.peak_bytes <= budget
    assert report.param_peak_bytes == dict(plan.meta)["predicted_param_peak_bytes"]


def test_include_params_needs_a_profile_or_a_sample() -> None:
    model = ooc.models.GPT("nano")
    with pytest.raises(ooc.WrapError, match="sample="):
        ooc.wrap(model, budget="1MiB", include_params=True)
    assert not ooc.is_wrapped(model)


def test_an_impossible_budget_says_how_much_is_needed() -> None:
    model = ooc.models.GPT("nano")
    with pytest.raises(BudgetError, match="parameters and saved activations together"):
        ooc.wrap(model, budget=1000, sample=gpt_batch(), include_params=True)
    assert not ooc.is_wrapped(model)
