"""RECOMPUTE beyond torch's checkpoint tests: the autograd features issue 12 listed, BatchNorm and
dropout across plan mixes, and the refusals (a block that cannot be re-run faithfully raises)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import ooc
from ooc.errors import OocError
from ooc.recompute import RecomputeError
from ooc.runtime import runtime_of

LETTERS = {"R": ooc.BlockPlan("recompute"), "r": ooc.BlockPlan("recompute", swap_input=True),
           "K": ooc.BlockPlan("keep"), "S": ooc.BlockPlan("swap")}
MIXES = ["RRR", "rrr", "RSK", "KrR", "SRr"]


class Block(nn.Module):
    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.bn(self.fc(x))))


class Chain(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def pair(code: str) -> tuple[Chain, Chain]:
    torch.manual_seed(0)
    plain = Chain(len(code))
    wrapped = copy.deepcopy(plain)
    plan = ooc.Plan(blocks=tuple(LETTERS[c] for c in code), min_swap_bytes=0)
    ooc.wrap(wrapped, plan, backend="cpu")
    return plain, wrapped


def params(m: nn.Module) -> list[nn.Parameter]:
    return list(m.parameters())


def grads(m: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in m.parameters()]


def equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b))


def run_both(code: str, step) -> None:  # noqa: ANN001
    """``step(model, x)`` on a plain model and a wrapped copy, same seed and input; results equal."""
    plain, wrapped = pair(code)
    results = []
    for m in (plain, wrapped):
        torch.manual_seed(7)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = step(m, x)
        results.append((out, grads(m), x.grad, [b.clone() for b in m.buffers()]))
    (o1, g1, x1, b1), (o2, g2, x2, b2) = results
    assert equal(list(o1), list(o2))
    assert equal(g1, g2) and equal([x1], [x2]) and equal(b1, b2)  # BatchNorm statistics updated once
    ooc.unwrap(wrapped)


@pytest.mark.parametrize("code", MIXES)
def test_double_backward_gradient_penalty(code: str) -> None:
    """Issue 12: create_graph=True (a gradient penalty) gives plain PyTorch's gradients."""

    def step(m, x):  # noqa: ANN001, ANN202
        out = m(x)
        (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        (out.sum() + gx.pow(2).sum()).backward()
        return [out.detach(), gx.detach()]

    run_both(code, step)


@pytest.mark.parametrize("code", MIXES)
def test_autograd_grad_wrt_parameters(code: str) -> None:
    """Issue 12: ``torch.autograd.grad(loss, params)`` returns the gradients (it gave None) and
    writes no ``.grad``."""

    def step(m, x):  # noqa: ANN001, ANN202
        got = torch.autograd.grad(m(x).pow(2).sum(), params(m))
        assert all(p.grad is None for p in m.parameters())
        return list(got)

    run_both(code, step)


@pytest.mark.parametrize("code", MIXES)
def test_autograd_grad_wrt_input_leaves_parameters_alone(code: str) -> None:
    """Issue 17: ``autograd.grad(out, [x])`` writes no parameter's ``.grad``."""

    def step(m, x):  # noqa: ANN001, ANN202
        (gx,) = torch.autograd.grad(m(x).sum(), [x])
        assert all(p.grad is None for p in m.parameters())
        return [gx]

    run_both(code, step)


@pytest.mark.parametrize("which", ["input", "weights"])
@pytest.mark.parametrize("code", MIXES)
def test_backward_inputs(code: str, which: str) -> None:
    """Issue 12: ``loss.backward(inputs=[...])`` fills exactly those ``.grad`` (it left w.grad None)."""

    def step(m, x):  # noqa: ANN001, ANN202
        chosen = [x] if which == "input" else [b.fc.weight for b in m.blocks]
        m(x).pow(2).sum().backward(inputs=chosen)
        return []

    run_both(code, step)


def test_grad_between_two_outputs_of_one_block() -> None:
    """Issue 17: ``autograd.grad`` from one output of a block to another of the same block."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.fc(x).sin()
            return h, h.exp()

    torch.manual_seed(0)
    plain = nn.Sequential(Two())
    wrapped = copy.deepcopy(plain)
    ooc.wrap(wrapped, ooc.Plan.of(["recompute"]), blocks=list(wrapped), backend="cpu")
    x = torch.randn(2, 4)
    results = []
    for m in (plain, wrapped):
        h, e = m[0](x)
        results.append(torch.autograd.grad(e.sum(), h)[0])
    assert torch.equal(*results)


def test_outputs_do_not_require_grad_when_nothing_in_the_block_does() -> None:
    """Issue 17 cause 3: no anchor: a frozen block on raw data gives an output without grad, and
    ``backward()`` raises as in plain PyTorch."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].requires_grad_(False)
    ooc.wrap(model, ooc.Plan.of(["recompute", "recompute"]), blocks=list(model), backend="cpu")
    out = model[0](torch.randn(2, 4))
    assert not out.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()


def test_retain_graph_second_backward_recomputes_again() -> None:
    """A graph kept with retain_graph=True can be backwarded twice: the block is re-run for each."""
    plain, wrapped = pair("RrR")
    results = []
    for m in (plain, wrapped):
        torch.manual_seed(3)
        loss = m(torch.randn(5, 6)).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        results.append(grads(m))
    assert equal(*results)
    ooc.unwrap(wrapped)


class _InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(self.w)  # passes its result by mutating its argument
        return x


def test_block_that_mutates_its_input_is_refused() -> None:
    """Issue 12: a block that modifies its argument in place cannot be re-run from it: a clear error
    naming the block at its forward, never a wrong gradient."""
    model = nn.Sequential(_InPlace(), _InPlace())
    ooc.wrap(model, ooc.Plan.of(["recompute", "keep"]), blocks=list(model), backend="cpu")
    with pytest.raises(RecomputeError, match=r"block 0 modifies its argument 0 in place"):
        model(torch.randn(4, requires_grad=True) * 1.0)
    assert issubclass(RecomputeError, OocError)


def test_argument_modified_after_the_forward_is_refused() -> None:
    """An argument modified in place between the block's forward and its backward would re-run the
    block on other values: refused, naming the block."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ooc.wrap(model, ooc.Plan.of(["recompute", "keep"]), blocks=list(model), backend="cpu")
    x = torch.randn(3, 4)
    out = model[0](x)
    x.add_(1)  # plain PyTorch raises too: Linear saved x
    with pytest.raises(RecomputeError, match=r"block 0: its argument 0 was modified in place"):
        out.sum().backward()


_GLOBAL_GENERATORS = [torch.Generator().manual_seed(0)]


class _HostRandom(nn.Module):
    """Draws from a ``torch.Generator`` in a global list, which the re-run cannot find to replay (Python's and
    numpy's global generators, and a global generator the forward reads by name, it replays: NOTE
    [generators a re-run replays] in ``ooc.rng``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * torch.rand((), generator=_GLOBAL_GENERATORS[0])).sin()


@pytest.mark.parametrize("check", [False, True])
def test_check_recompute_compares_values(check: bool) -> None:
    """Issue 13: ``check_recompute=True`` compares the re-run's saved values with the forward's
    bit for bit and raises, naming the block; without it only count, shape and dtype are checked."""
    model = nn.Sequential(_HostRandom(), _HostRandom())
    ooc.wrap(model, ooc.Plan.of(["keep", "recompute"]), blocks=list(model), backend="cpu", check_recompute=check)
    loss = model(torch.randn(3, 4)).sum()
    if check:
        with pytest.raises(RecomputeError, match=r"block 1: saved tensor \d+ .* other values"):
            loss.backward()
    else:
        loss.backward()  # undetectable without the check: the global generator is outside the replay


def test_check_recompute_passes_a_faithful_rerun() -> None:
    plain, wrapped = pair("RrS")
    runtime_of(wrapped).check_recompute = True
    for m in (plain, wrapped):
        torch.manual_seed(5)
        m(torch.randn(5, 6)).sum().backward()
    assert equal(grads(plain), grads(wrapped))
    ooc.unwrap(wrapped)


def _read_saved_tensors(fn: object, seen: set[int] | None = None) -> int:
    """Read every ``_saved_*`` attribute of the graph under ``fn`` (as a graph visualiser does), keeping
    none of them; the number read."""
    seen = set() if seen is None else seen
    if fn is None or id(fn) in seen:
        return 0
    seen.add(id(fn))
    read = 0
    for name in dir(fn):
        if name.startswith("_saved_"):
            getattr(fn, name)
            read += 1
    return read + sum(_read_saved_tensors(f, seen) for f, _ in fn.next_functions)


def _live_tensors() -> int:
    import gc

    gc.collect()
    return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())  # type(): no proxy's __class__ runs


@pytest.mark.parametrize("code", MIXES)
def test_saved_tensors_read_outside_a_backward_change_nothing_and_hold_nothing(code: str) -> None:
    """``loss.grad_fn.next_functions[...]._saved_self`` outside a backward re-runs the recomputed block
    (NOTE [a saved tensor read outside a backward] in ooc.recompute). The gradients, BatchNorm's
    statistics and the RNG after it were already as in plain PyTorch; but each read kept the rest of
    its re-run's saved tensors alive until the graph died, and counted in the tracker until the
    block's backward: reading every one held a copy of the block's activations per read. A swapped
    tensor (or input) read stays on the device until its backward, as a prefetch would: once."""
    plain, wrapped = pair(code)
    x = torch.randn(5, 6)
    for step in range(2):
        torch.manual_seed(step)
        plain(x).pow(2).sum().backward()
        after_plain = torch.rand(4)
        torch.manual_seed(step)
        loss = wrapped(x).pow(2).sum()
        tracked = ooc.memory_report(wrapped).current_bytes
        assert _read_saved_tensors(loss.grad_fn) > 10
        once, live = ooc.memory_report(wrapped).current_bytes, _live_tensors()
        assert once == tracked or "S" in code or "r" in code  # what a read brought back from the host
        _read_saved_tensors(loss.grad_fn)
        assert (ooc.memory_report(wrapped).current_bytes, _live_tensors()) == (once, live)
        assert torch.equal(torch.rand(4), after_plain)
        loss.backward()
        for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)
        for p, q in zip(plain.buffers(), wrapped.buffers()):
            assert torch.equal(p, q)
