"""Blocks whose forward sets attributes of their modules (a step counter, a state for the next call, a
tensor kept with ``retain_grad()``), recomputed: equal to plain PyTorch bit for bit (NOTE [attributes a
forward sets] in ``ooc.recompute``). Lazy modules, whose first forward sets their parameters: refused
until it has run."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import ooc
from ooc.recompute import RecomputeError
from ooc.runtime import runtime_of

PLANS = {
    "recompute": ooc.Plan.uniform("recompute", 4, min_swap_bytes=0),
    # No swaps: a process's first swap imports the codec kernels (seconds on a loaded CPU).
    "mixed": ooc.Plan.of(["keep", "recompute", "keep", "recompute"], min_swap_bytes=0),
    "streamed": ooc.Plan.uniform("recompute", 4, min_swap_bytes=0).streaming(range(4)),
}


class Annealed(nn.Module):
    """``h (8, 16) -> h + tanh(linear(h)) / t``, ``t`` the calls so far (a Python counter on the module)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return h + torch.tanh(self.linear(h)) / self.calls


class Carried(nn.Module):
    """``h (8, 16) -> h + tanh(linear(h + memory))``, then ``memory`` the output, detached (a state
    carried to the next call on the module, as truncated backpropagation through time does)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.memory: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        memory = torch.zeros_like(h) if self.memory is None else self.memory
        out = h + torch.tanh(self.linear(h + memory))
        self.memory = out.detach()
        return out


class Inspected(nn.Module):
    """``h (8, 16) -> h + fc2(tanh(fc1(h)))``, keeping ``fc1``'s output on itself with ``retain_grad()``
    (its gradient read after the backward, as a saliency map is)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.pre: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.pre = self.fc1(h)
        self.pre.retain_grad()
        return h + self.fc2(torch.tanh(self.pre))


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("block", [Annealed, Carried, Inspected], ids=lambda b: b.__name__)
def test_attributes_a_forward_sets_are_the_forwards(block: type[nn.Module], plan: str) -> None:
    # The re-run read the attributes as the forward had left them (the counter one call on, the next
    # call's memory: other gradients, silently), set them again (the counter counted each step twice)
    # and left its own tensors on the module (``pre.grad`` None after the backward).
    torch.manual_seed(0)
    plain = nn.Sequential(*[block() for _ in range(4)])
    wrapped = copy.deepcopy(plain)
    ooc.wrap(wrapped, PLANS[plan], blocks=list(wrapped), backend="cpu")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    try:
        for step in range(3):
            for model in (plain, wrapped):
                model.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
            for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
                assert torch.equal(a.grad, b.grad), (step, name)
            for i, (a, b) in enumerate(zip(plain, wrapped)):
                if block is Annealed:
                    assert a.calls == b.calls == step + 1, i
                elif block is Carried:
                    assert torch.equal(a.memory, b.memory), (step, i)
                else:
                    assert b.pre.grad is not None and torch.equal(a.pre.grad, b.pre.grad), (step, i)
        assert runtime_of(wrapped).tracker.current == 0
    finally:
        ooc.unwrap(wrapped)


@pytest.mark.parametrize("how", ["plan", "budget"])
def test_lazy_modules_are_refused_until_a_forward_initialized_them(how: str) -> None:
    # Wrapping raised torch's "Attempted to use an uninitialized parameter in numel" from ooc's bookkeeping.
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.LazyLinear(16), nn.Tanh()) for _ in range(4)])

    kwargs = {"plan": dict(plan=PLANS["recompute"]), "budget": dict(budget="1MiB")}[how]
    model = make()
    with pytest.raises(ooc.WrapError, match=r"parameter 0\.0\.weight .* not initialized yet .*Run one forward"):
        ooc.wrap(model, blocks=list(model), backend="cpu", **kwargs)
    assert not ooc.is_wrapped(model)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    plain = make()
    for m in (plain, model):
        torch.manual_seed(1)  # the lazy parameters are drawn in this forward
        with torch.no_grad():
            m(x)  # what the error says: the parameters take their shapes
    ooc.wrap(model, blocks=list(model), backend="cpu", **kwargs)
    try:
        for m in (plain, model):
            m(x).square().mean().backward()
        for (name, a), b in zip(plain.named_parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), name
    finally:
        ooc.unwrap(model)


@pytest.mark.parametrize("block", [Annealed, Carried], ids=lambda b: b.__name__)
def test_profiling_on_a_sample_leaves_the_attributes_as_it_found_them(block: type[nn.Module]) -> None:
    # ooc.profile (wrap(sample=...)) put gradients, buffers and generators back, not the modules'
    # attributes: its 15 forwards left each counter 15 calls on, each memory set, and training parted
    # from plain PyTorch at its first step.
    torch.manual_seed(0)
    plain = nn.Sequential(*[block() for _ in range(4)])
    wrapped = copy.deepcopy(plain)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    ooc.wrap(wrapped, budget="1MiB", sample=(x,), blocks=list(wrapped), backend="cpu")
    try:
        assert all(a.__dict__.keys() == b.__dict__.keys() - {"forward"} for a, b in zip(plain, wrapped))
        assert [getattr(b, "calls", 0) for b in wrapped] == [0] * 4
        assert all(getattr(b, "memory", None) is None for b in wrapped)
        for model in (plain, wrapped):
            model(x).square().mean().backward()
        for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
            assert torch.equal(a.grad, b.grad), name
    finally:
        ooc.unwrap(wrapped)


class _Counting(nn.Sequential):
    """Its blocks, and ``seen``, a plain tensor attribute (no buffer) that each forward adds the batch's
    size to in place, outside the blocks (no block's forward changes it, so no recompute refuses it)."""

    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__(*blocks)
        self.seen = torch.zeros((), dtype=torch.long)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.seen += h.shape[0]
        return super().forward(h)


def _shifted() -> nn.Module:
    return Shifted(counted=True)


@pytest.mark.parametrize("block", [Annealed, Carried, _shifted], ids=["Annealed", "Carried", "Shifted"])
def test_describe_with_a_sample_leaves_the_model_as_it_found_it(block) -> None:
    # describe's trial forwards (two with this model) put back the modules' attributes by identity, not a
    # tensor's value changed in place: a tensor counter (``seen``, ``shift``) was left two calls on.
    torch.manual_seed(0)
    plain = _Counting(*[block() for _ in range(4)])
    described = copy.deepcopy(plain)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    ooc.describe(described, x)
    assert all(a.__dict__.keys() == b.__dict__.keys() for a, b in zip(plain.modules(), described.modules()))
    assert described.seen.item() == 0
    assert [getattr(b, "calls", 0) for b in described] == [0] * 4
    assert all(getattr(b, "memory", None) is None for b in described)
    assert all(torch.equal(b.shift, torch.zeros(16)) for b in described if isinstance(b, Shifted))
    for model in (plain, described):
        model(x).square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), described.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_profiling_on_a_sample_puts_back_a_tensor_attribute_changed_in_place() -> None:
    # Put back by identity only: wrap(sample=...)'s profile left ``seen`` counting its forwards.
    plain = _Counting(*[Annealed() for _ in range(4)])
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    ooc.wrap(plain, budget="1MiB", sample=(x,), blocks=list(plain), backend="cpu")
    try:
        assert plain.seen.item() == 0
        plain(x)
        assert plain.seen.item() == 8
    finally:
        ooc.unwrap(plain)


class Shifted(nn.Module):
    """``h (8, 16) -> h + tanh(linear(h) + shift)``, ``shift`` a plain tensor attribute (no buffer), which
    ``counted`` also adds one to in place in the forward."""

    def __init__(self, counted: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.shift = torch.zeros(16)
        self.counted = counted

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = h + torch.tanh(self.linear(h) + self.shift)
        if self.counted:
            self.shift += 1
        return out


@pytest.mark.parametrize("when", ["in-the-forward", "before-the-backward"])
def test_a_tensor_attribute_changed_in_place_is_refused(when: str) -> None:
    # The re-run read the changed values (tanh's saved output from another shift: other gradients,
    # silently), where plain PyTorch's backward uses what the forward computed; put back by the
    # attributes' restore only when replaced, not when changed in place.
    model = nn.Sequential(*[Shifted(counted=when == "in-the-forward") for _ in range(2)])
    ooc.wrap(model, ooc.Plan.uniform("recompute", 2, min_swap_bytes=0),
             blocks=list(model), backend="cpu")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    try:
        if when == "in-the-forward":
            with pytest.raises(RecomputeError, match=r"block 0 modifies its tensor attribute shift \(16,\) in place"):
                model(x)
        else:
            loss = model(x).square().mean()
            with torch.no_grad():
                model[1].shift.add_(1.0)
            with pytest.raises(RecomputeError, match=r"block 1: its tensor attribute shift \(16,\) was modified"):
                loss.backward()
    finally:
        ooc.unwrap(model)
