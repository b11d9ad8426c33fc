"""``ooc.wrap(..., include_params=True)``: the runtime keeps parameters and saved activations together
within the budget by streaming blocks (the planning alone is tested under tests/scheduler/)."""

from __future__ import annotations

import pytest
import torch

import ooc
from ooc.errors import BudgetError
from ooc.scheduler.costmodel import build_options
from ooc.scheduler.hardware import preset
from ooc.scheduler.optimal import minimum_peak
from tests.helpers import gpt_batch


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
