"""A captured step run under a placement on K virtual CPU devices (ooc.partition_run): the loss and
every gradient bit for bit those of eager PyTorch, whatever the placement; each device's measured
peak (real storages) equal to the simulator's prediction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ooc.models.gpt import GPT, GPTConfig
from ooc.partition_capture import capture_step
from ooc.partition_run import run_placed
from ooc.scheduler.errors import PlanError
from ooc.scheduler.partition import Devices, Placement, run_methods

CFG = GPTConfig(vocab_size=65, block_size=32, n_layer=1, n_head=2, n_embd=16, dropout=0.0)


@pytest.fixture(scope="module")
def gpt_step():
    torch.manual_seed(0)
    model = GPT(CFG)
    x = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)
    step = capture_step(model, (x, y), repeats=1)
    loss = model(x, y)[1]
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return step, (loss.detach(), *grads)


def _check(run, eager) -> None:
    assert len(run.outputs) == len(eager)
    for got, want in zip(run.outputs, eager):
        assert torch.equal(got, want)
    np.testing.assert_array_equal(run.peak_bytes, run.simulation.peak_bytes)


def test_every_method_bit_identical_with_predicted_peaks(gpt_step) -> None:
    step, eager = gpt_step
    devices = Devices.uniform(3, int(step.graph.total_bytes()))
    copies = 0
    for outcome in run_methods(step.graph, devices):
        run = run_placed(step, outcome.placement, devices)
        _check(run, eager)
        copies += run.copies
    assert copies > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_a_random_placement_is_bit_identical_too(gpt_step, seed: int) -> None:
    step, eager = gpt_step
    device = np.random.default_rng(seed).integers(0, 4, step.graph.n)
    devices = Devices.uniform(4, int(step.graph.total_bytes()))
    run = run_placed(step, Placement.of("random", device, 4, step.graph.n), devices)
    assert run.copies > 100
    _check(run, eager)


def test_a_placement_of_another_graph_is_refused(gpt_step) -> None:
    step, _ = gpt_step
    with pytest.raises(PlanError, match="capture and place it again"):
        run_placed(step, Placement.of("short", np.zeros(3, dtype=np.int64), 2, 3), Devices.uniform(2, 10))
