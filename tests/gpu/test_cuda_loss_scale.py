"""HostAdamW(loss_scale=...) on CUDA: the device-kept gradients unscaled and checked on the GPU, the
bucketed ones on the host (NOTE [loss scaling in the optimizer] in ooc.optim.loss_scale).

A power-of-two scale multiplies and divides fp32 gradients exactly, so a scaled run equals the run
without a scale bit for bit, less the steps that overflowed (skipped, as if never taken)."""

from __future__ import annotations

import copy

import pytest
import torch

import ooc
from ooc.models import GPT
from ooc.optim import HostAdamW, LossScale
from tests.helpers import gpt_batch
from tests.ooc.test_loss_scale import fp16_from_an_overflowing_scale

pytestmark = pytest.mark.gpu

STEPS = 6
OVERFLOW = {2}
MIXED = ["swap", "recompute", "keep", "swap"]


def _loss(model: GPT, step: int) -> torch.Tensor:
    torch.manual_seed(step)  # the same dropout masks on both sides
    return model(*(t.cuda() for t in gpt_batch(seed=step)))[1]


def _train(model: GPT, steps: list[int], **options: object) -> list[bool]:
    ooc.wrap(model, ooc.Plan.of(MIXED), backend="cuda")
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, **options)
    skipped = []
    try:
        for step in steps:
            opt.zero_grad()
            loss = _loss(model, step)
            if "loss_scale" in options:
                opt.scale(loss * float("inf") if step in OVERFLOW else loss).backward()
            else:
                loss.backward()
            opt.step()
            skipped.append(opt.last_step_skipped)
        opt.synchronize()
    finally:
        opt.close()
        ooc.unwrap(model)
    return skipped


@pytest.mark.parametrize("device_params_below", [0, 100])
def test_a_scaled_run_equals_the_unscaled_one_less_its_overflowed_steps(device_params_below: int) -> None:
    torch.manual_seed(0)
    scaled = GPT("nano").cuda()
    plain = copy.deepcopy(scaled)
    skipped = _train(scaled, list(range(STEPS)), device_params_below=device_params_below,
                     loss_scale=LossScale(init_scale=2.0**10, growth_interval=2))
    _train(plain, [s for s in range(STEPS) if s not in OVERFLOW], device_params_below=device_params_below)
    assert skipped == [s in OVERFLOW for s in range(STEPS)]
    assert all(torch.equal(p, q) for p, q in zip(scaled.parameters(), plain.parameters()))


def test_fp16_weights_train_once_the_scale_backs_off_below_overflow() -> None:
    torch.manual_seed(0)
    fp16_from_an_overflowing_scale(GPT("nano").cuda().half(), ooc.Plan.of(MIXED), "cuda",
                                   tuple(t.cuda() for t in gpt_batch(seed=0)))
