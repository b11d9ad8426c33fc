"""HostAdamW's copies wait for the compute that wrote (or last read) their memory.

On the CPU, compute has run by the time the host issues a copy, so a missing compute event shows
nothing. Here the training thread's ops are counted as a "compute stream" clock (a dispatch mode);
each compute event carries the clock at which it was recorded, and a copy issued on the training
thread must wait on an event no older than the last op that touched the memory it reads (D2H
source) or overwrites (H2D destination). That is the CUDA rule: a side-stream copy is ordered after
compute only through an event.
"""

from __future__ import annotations

import copy
import threading

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ooc.backend import ChaosConfig, CpuBackend
from ooc.models import GPT
from ooc.optim import HostAdamW
from tests.helpers import gpt_batch


class _ComputeClock(TorchDispatchMode):
    """Counts the ops of the thread it is entered on; remembers the count at which each storage was
    last touched (read or written). Views touch no memory."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = 0
        self.touched: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.clock += 1
            for t in tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor):
                    self.touched[t.untyped_storage().data_ptr()] = self.clock
        return out


class _ClockedEvent:
    def __init__(self, inner, clock: int) -> None:  # noqa: ANN001
        self.inner = inner
        self.clock = clock

    def query(self) -> bool:
        return self.inner.query()

    def synchronize(self) -> None:
        self.inner.synchronize()


class _CheckedBackend(CpuBackend):
    """The chaos backend without delays (so every parameter has its copies), checking the rule above."""

    def __init__(self, clock: _ComputeClock) -> None:
        super().__init__(chaos=ChaosConfig(max_delay_s=0.0))
        self.clock = clock
        self.checked = {"d2h": 0, "h2d": 0}
        self.violations: list[str] = []

    def record_compute(self):  # noqa: ANN201
        return _ClockedEvent(super().record_compute(), self.clock.clock)

    def _check(self, what: str, memory: torch.Tensor, after: tuple) -> None:  # noqa: ANN001
        if threading.current_thread() is not threading.main_thread():
            return  # the host threads order their copies by waiting on events themselves
        touched = self.clock.touched.get(memory.untyped_storage().data_ptr())
        if touched is None:
            return
        self.checked[what] += 1
        waits_for = max((e.clock for e in after if isinstance(e, _ClockedEvent)), default=-1)
        if waits_for < touched:
            self.violations.append(f"{what} of {tuple(memory.shape)} waits for compute op {waits_for}, "
                                   f"its memory was touched by op {touched}")

    def copy_d2h(self, dst, src, after):  # noqa: ANN001, ANN201
        self._check("d2h", src, after)
        return super().copy_d2h(dst, src, tuple(e.inner if isinstance(e, _ClockedEvent) else e for e in after))

    def copy_h2d(self, dst, src, after):  # noqa: ANN001, ANN201
        self._check("h2d", dst, after)
        return super().copy_h2d(dst, src, tuple(e.inner if isinstance(e, _ClockedEvent) else e for e in after))


def test_a_channels_last_gradient_is_copied_after_it_is_made_contiguous() -> None:
    """Issue 11 (c): the copy's source is built by ``.contiguous()`` on the compute stream."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
    clock = _ComputeClock()
    backend = _CheckedBackend(clock)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, backend=backend)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    try:
        for step in range(2):
            x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(step)).to(memory_format=torch.channels_last)
            with clock:
                model(x).square().sum().backward()
            assert not model[0].weight.grad.is_contiguous()  # the case under test
            opt.step()
            opt.zero_grad()
            reference(x).square().sum().backward()
            ref_opt.step()
            ref_opt.zero_grad()
        opt.synchronize()
    finally:
        opt.close()
        backend.close()
    assert backend.checked["d2h"] >= 2 and backend.violations == []
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_delayed_weights_go_in_after_the_backward_that_reads_the_old_ones() -> None:
    """Issue 11 (a): with ``delayed_update`` the H2D copies are issued from a gradient hook, when the
    backward that reads the old weights is queued, not done."""
    torch.manual_seed(0)
    model = GPT("nano")
    clock = _ComputeClock()
    backend = _CheckedBackend(clock)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, backend=backend, delayed_update=True)
    try:
        for step in range(3):
            torch.manual_seed(step)
            with clock:
                model(*gpt_batch(seed=step))[1].backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
    finally:
        opt.close()
        backend.close()
    assert backend.checked["h2d"] > 0 and backend.checked["d2h"] > 0
    assert backend.violations == []
