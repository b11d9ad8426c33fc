"""A chain cut into stages, each planned out of core under its device's capacity
(ooc.scheduler.partition.stages), run on K virtual devices (ooc.partition_stages): the loss and
every gradient bit for bit those of eager PyTorch, and each device's measured activation peak equal
to its plan's prediction."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ooc
from ooc.partition_stages import run_staged
from ooc.scheduler import Policy, preset
from ooc.scheduler.errors import PlanError
from ooc.scheduler.partition import Devices, plan_per_device, stage_chain

WIDTH = 256


@pytest.fixture(scope="module")
def chain():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
                            for _ in range(6)])
    x, y = torch.randn(512, WIDTH), torch.randn(512, WIDTH)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    prof = ooc.profile(model, (x,), loss_fn=loss_fn, blocks=list(model), min_swap_bytes=1024, backend="cpu",
                       codec_errors=False)
    loss = loss_fn(model(x))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    whole = sum(b.saved_bytes + b.param_bytes + b.grad_bytes for b in prof.blocks)
    return model, x, loss_fn, prof, (loss.detach(), *grads), whole


@pytest.mark.parametrize("fraction, out_of_core", [(0.35, False), (0.28, True)])
def test_staged_out_of_core_is_bit_identical_with_predicted_peaks(chain, fraction: float, out_of_core: bool) -> None:
    model, x, loss_fn, prof, eager, whole = chain
    devices = Devices.uniform(3, int(whole * fraction))
    staged = stage_chain(prof, preset("cpu"), devices)
    assert staged.fits and sum(s.first < s.stop for s in staged.stages) == 3
    recomputed = any(b.policy is not Policy.KEEP for s in staged.stages for b in s.plan.blocks)
    assert recomputed == out_of_core
    model.zero_grad(set_to_none=True)
    run = run_staged(list(model), staged, x, loss_fn)
    assert torch.equal(run.loss, eager[0])
    for p, g in zip(model.parameters(), eager[1:], strict=True):
        assert torch.equal(p.grad, g)
    assert run.activation_peaks == tuple(s.activation_peak for s in staged.stages)
    assert all(s.peak_bytes <= c for s, c in zip(staged.stages, devices.capacities))


def test_a_stage_without_a_fitting_plan_is_refused(chain) -> None:
    model, x, loss_fn, prof, _, whole = chain
    tight = plan_per_device(prof, preset("cpu"), Devices.uniform(2, int(whole * 0.2)), [0, 3, 6])
    assert not tight.fits
    with pytest.raises(PlanError, match="no plan that fits"):
        run_staged(list(model), tight, x, loss_fn)
