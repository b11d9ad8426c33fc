"""In-place changes of ``.grad`` between ``backward()`` and ``step()`` while a pipelined HostAdamW's copies
out of the gradients may still read them (NOTE [gradients written after the backward] in ooc.optim.pipeline).

A pipelined bucket issues the D2H copies of its gradients in the backward; the loop (or a framework: Trainer
logs the gradient norm with ``clip_grad_norm_(params, inf)``, a multiply by 1 in place) may then write them.
On a GPU such a write races the copy, which reads half-old, half-new values. The chaos CPU backend delays
every copy and its stream-order checker raises on the unordered write; the results are compared bit for bit
with torch's AdamW under the semantics the README gives: the update uses the gradients as the backward left
them, a change of their values makes ``step()`` raise (NOTE [gradients read in the backward]), and a scale
by 1 changes nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ooc
from ooc.backend import ChaosConfig, CpuBackend
from ooc.models import GPT
from ooc.optim import HostAdamW
from ooc.optim.pipeline import PipelineError
from tests.helpers import gpt_batch

STEPS = 3
MIXED = ooc.scheduler.Plan.of(["swap", "recompute", "keep", "swap"], min_swap_bytes=4096)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT("nano")  # 4 blocks


def _chaos() -> CpuBackend:
    """Copies late by up to 20 ms each (two sleeps per copy), so a bucket's copies out are still
    running when the backward ends; the checker on."""
    return CpuBackend(chaos=ChaosConfig(seed=7, max_delay_s=0.02), check_order=True)


def _batch_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    torch.manual_seed(step)
    return model(*gpt_batch(seed=step))[1]


def _adamw(params) -> torch.optim.AdamW:  # noqa: ANN001
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def _reference(delayed: bool) -> tuple[list[float], list[torch.Tensor]]:
    """Losses and the weights after :data:`STEPS` steps of torch's AdamW with ``clip_grad_norm_(inf)``
    after each backward; ``delayed``: each step's forward and backward on the weights one update old
    (the result: the AdamW weights, i.e. what HostAdamW's masters hold)."""
    model = _model()
    master = copy.deepcopy(model)
    opt = _adamw(master.parameters())
    losses = []
    for step in range(STEPS):
        loss = _batch_loss(model, step)
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        for m, p in zip(master.parameters(), model.parameters()):
            m.grad = p.grad
        with torch.no_grad():
            for p, m in zip(model.parameters(), master.parameters()):
                if delayed:
                    p.copy_(m)  # the device takes the previous update before this one runs
        opt.step()
        if not delayed:
            with torch.no_grad():
                for p, m in zip(model.parameters(), master.parameters()):
                    p.copy_(m)
        model.zero_grad()
    return losses, [m.detach().clone() for m in master.parameters()]


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "wrapped"])
@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "not-delayed"])
def test_a_clip_by_inf_after_the_backward_waits_for_the_copies_out(delayed: bool, wrapped: bool) -> None:
    """Trainer's norm logging in a plain loop: ``clip_grad_norm_(params, inf)`` multiplies every gradient
    by 1 in place right after the backward. It raised StreamOrderError (the write ran while the copies
    out of the last buckets still read the gradients: on a GPU, a race); now the compute after the
    backward waits for those copies, and the run equals AdamW's bit for bit."""
    model = _model()
    backend = _chaos()
    if wrapped:
        ooc.wrap(model, MIXED, backend=backend)
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, backend=backend,
                    delayed_update=delayed)
    try:
        losses = []
        for step in range(STEPS):
            loss = _batch_loss(model, step)
            loss.backward()
            losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        masters = [opt.state[p]["master"] for p in model.parameters()]
    finally:
        opt.close()
        if wrapped:
            ooc.unwrap(model)
        backend.close()
    expected_losses, expected = _reference(delayed)
    assert losses == expected_losses
    assert all(torch.equal(m, e) for m, e in zip(masters, expected))


@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "not-delayed"])
def test_a_real_clip_after_the_backward_is_refused_and_the_update_took_the_backward_gradients(delayed: bool) -> None:
    """``clip_grad_norm_`` with a small max norm after the backward: the copies out may still be reading the
    gradients, so on a GPU the update took some values clipped and some not. Now the clip waits for the
    copies, so the update deterministically took the gradients as the backward left them; ``step()``
    refuses the change (NOTE [gradients read in the backward]) and the masters equal AdamW's step on
    the unclipped gradients."""
    model = _model()
    reference = copy.deepcopy(model)
    backend = _chaos()
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, backend=backend,
                    delayed_update=delayed)
    try:
        _batch_loss(model, 0).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        with pytest.raises(PipelineError, match="changed between the backward and step"):
            opt.step()
        opt.synchronize()
        masters = [opt.state[p]["master"].clone() for p in model.parameters()]
    finally:
        opt.close()
        backend.close()
    _batch_loss(reference, 0).backward()
    ref_opt = _adamw(reference.parameters())
    ref_opt.step()
    assert all(torch.equal(m, r) for m, r in zip(masters, reference.parameters()))
