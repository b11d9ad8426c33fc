"""The next copies of new weights into the parameters wait for a reader's event handed to
``HostAdamW.copies_in_after`` (NOTE [weights read on another stream] in ooc.optim.pipeline): a
checkpoint's copies of the live weights on a stream the training does not wait for. The race itself
needs two streams of one thread (a GPU: tests/gpu/test_cuda_checkpoint.py); here the event is one
the test sets by hand, and the copies in must not land before it."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

from ooc.backend import CpuBackend
from ooc.backend.cpu import CpuEvent
from ooc.optim import HostAdamW


def _setup(delayed: bool) -> tuple[nn.Module, HostAdamW, CpuBackend]:
    torch.manual_seed(0)
    # bf16: each parameter has an fp32 master apart, so its new weights go in by copies (the chaos
    # backend would poison their destinations as each copy starts, before it waits for the event).
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)).to(torch.bfloat16)
    # Unchecked: the test looks at the weights while their copies in wait, on purpose.
    backend = CpuBackend(check_order=False)
    opt = HostAdamW(model.parameters(), lr=1e-1, model=model, backend=backend, delayed_update=delayed)
    return model, opt, backend


def _step(model: nn.Module, opt: HostAdamW) -> None:
    model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    opt.zero_grad()


def _wait_for_copies_issued(opt: HostAdamW, delayed: bool) -> None:
    """Until the step's copies in are issued: the update thread issues them at the end of each update;
    with ``delayed_update`` the launch did in the backward, and the next update waits for them (its
    staging buffer is theirs to read), so the engine gets a moment to run them (a copy that did not
    wait would have landed)."""
    if delayed:
        time.sleep(0.2)
        return
    for status in opt._pipeline.status:
        assert status.done.wait(10.0)


@pytest.mark.parametrize("delayed", [False, True], ids=["update", "delayed_update"])
def test_the_next_copies_in_wait_for_the_event(delayed: bool) -> None:
    model, opt, backend = _setup(delayed)
    read = CpuEvent()
    try:
        if delayed:
            _step(model, opt)  # its update goes in at the next step's launch
        before = [p.detach().clone() for p in model.parameters()]
        opt.copies_in_after(read)
        _step(model, opt)
        _wait_for_copies_issued(opt, delayed)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "copied in before the read ended"
        read.set()
        opt.synchronize()
        masters = [opt.state[p]["master"] for p in model.parameters()]
        if delayed:
            # The parameters lag one update: they hold the first step's, not yet the masters' (the second's).
            assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        else:
            assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(model.parameters(), masters))
    finally:
        read.set()
        opt.close()
        backend.close()


def test_only_events_not_complete_are_kept() -> None:
    """A bucket that copies nothing in (frozen parameters) keeps no event per save."""
    model, opt, backend = _setup(False)
    try:
        pending = CpuEvent()
        opt.copies_in_after(pending)
        for _ in range(5):
            opt.copies_in_after(CpuEvent(done=True))
        assert all(len(status.after) == 2 and status.after[0] is pending for status in opt._pipeline.status)
    finally:
        pending.set()
        opt.close()
        backend.close()
