"""PyTorch's activation-checkpoint tests, ported: ooc's RECOMPUTE behaves as ``checkpoint(use_reentrant=False)``.

Each checkpointed function of the PyTorch test becomes an ``nn.Module`` block. Every case runs once
under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (``torch``: a sanity check of the
port) and under ooc plans (one letter per block: ``R`` recompute, ``r`` recompute with the input
swapped to the host, ``K`` keep, ``S`` swap), and is compared with plain PyTorch bit for bit.
The source of each case is named in its docstring: ``test_utils`` is ``test/test_utils.py``
``TestCheckpoint``, ``test_autograd`` is ``test/test_autograd.py`` (``TestAutograd`` unless said
``TestNestedCheckpoint``). Not ported: tests needing a GPU (``*_rng_gpu``, ``*_early_free``,
``*_memory_savings``, ``*_dataparallel``, ``*_preserves_device_context``), reentrant-only
behaviour, and checkpoint-only APIs (``context_fn``, ``set_checkpoint_early_stop``, ``debug``,
``GraphExecGroup``, ``checkpoint_sequential``'s argument checks).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointError, checkpoint

import ooc
from ooc.recompute import RecomputeError

ONE_BLOCK = ["torch", "R", "r"]
LETTERS = {"R": ooc.BlockPlan("recompute"), "r": ooc.BlockPlan("recompute", swap_input=True),
           "K": ooc.BlockPlan("keep"), "S": ooc.BlockPlan("swap")}


class _Host(nn.Module):
    """Holds the blocks of one case; ``anchor`` lets ooc wrap blocks that have no parameters."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.anchor = nn.Parameter(torch.zeros(()))


@contextlib.contextmanager
def under(mode: str, blocks: list[nn.Module]) -> Iterator[list[Callable[..., Any]]]:
    """The blocks as callables: plain (``plain``), under torch's checkpoint (``torch``), or wrapped
    by ooc with one plan letter per block."""
    if mode == "plain":
        yield list(blocks)
    elif mode == "torch":
        yield [lambda *a, m=m, **k: checkpoint(m, *a, use_reentrant=False, **k) for m in blocks]
    else:
        if len(mode) != len(blocks):
            raise ValueError(f"plan {mode!r} for {len(blocks)} blocks")
        host = _Host(blocks)
        plan = ooc.Plan(blocks=tuple(LETTERS[c] for c in mode), min_swap_bytes=0)
        ooc.wrap(host, plan, blocks=list(host.blocks), backend="cpu")
        try:
            yield list(blocks)
        finally:
            ooc.unwrap(host)


def unpack_error(mode: str) -> type[Exception]:
    return CheckpointError if mode == "torch" else RecomputeError


def grads(tensors: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


class Fn(nn.Module):
    """A checkpointed function as a block."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _mlp(widths: tuple[int, ...] = (10, 8, 6, 4), seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


def _chunks(model: nn.Sequential, n: int) -> list[nn.Module]:
    layers = list(model)
    size = len(layers) // n
    return [nn.Sequential(*layers[k * size:(k + 1) * size if k < n - 1 else len(layers)]) for k in range(n)]


class _Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # In a list: a re-run puts the module's own attributes back as it found them (NOTE [attributes
        # a forward sets] in ooc.recompute), a count kept as an int among them too.
        self.counter = [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counter[0] += 1
        return x * torch.tensor(2.0)


@pytest.mark.parametrize("mode", ["torch", "RRRR", "rrrr", "RrKS", "KSRr"])
def test_checkpoint_trigger(mode: str) -> None:
    """test_utils: test_checkpoint_trigger. Each recomputed block runs twice, the others once."""
    blocks = [_Counted() for _ in range(4)]
    with under(mode, blocks) as fns:
        x = torch.randn(3, 4, requires_grad=True)
        for f in fns:
            x = f(x)
        assert [b.counter[0] for b in blocks] == [1] * 4
        x.sum().backward()
    expected = [2] * 4 if mode == "torch" else [2 if c in "Rr" else 1 for c in mode]
    assert [b.counter[0] for b in blocks] == expected


@pytest.mark.parametrize("mode", ["torch", "RR", "rr", "Rr", "KR", "SR", "rS"])
def test_checkpoint_sequential_outputs_and_grads(mode: str) -> None:
    """test_utils: test_checkpoint, test_checkpoint_module_list (a Sequential in two chunks):
    outputs, input and parameter gradients equal the uncheckpointed model's."""
    model = _mlp((100, 50, 20, 5))
    x0 = torch.randn(1, 100)
    results = []
    for m in ("plain", mode):
        copy_ = copy.deepcopy(model)
        blocks = _chunks(copy_, 2)
        x = x0.clone().requires_grad_()
        with under(m, blocks) as fns:
            out = fns[1](fns[0](x))
            out.sum().backward()
        results.append((out.detach(), x.grad, grads(list(copy_.parameters()))))
    assert same(results[0], results[1])


@pytest.mark.parametrize("mode", ["torch", "RR", "rr", "RK", "Sr"])
def test_checkpoint_valid_create_graph(mode: str) -> None:
    """test_utils: test_checkpoint_valid (its non-reentrant half): ``autograd.grad(create_graph=True)``
    through checkpointed chunks gives the uncheckpointed gradients, themselves differentiable."""
    model = _mlp((100, 50, 20, 5))
    results = []
    for m in ("plain", mode):
        copy_ = copy.deepcopy(model)
        x = torch.randn(1, 100, generator=torch.Generator().manual_seed(0)).requires_grad_()
        with under(m, _chunks(copy_, 2)) as fns:
            out = fns[1](fns[0](x))
            (g,) = torch.autograd.grad([out], [x], grad_outputs=[torch.ones(1, 5)], create_graph=True)
            assert g.requires_grad
            second = torch.autograd.grad(g.pow(2).sum(), list(copy_.parameters()), allow_unused=True)
        results.append((out.detach(), g.detach(), second))
    assert same(results[0], results[1])


@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_checkpoint_rng_cpu(mode: str) -> None:
    """test_utils: test_checkpoint_rng_cpu. Dropout inside the block repeats its mask when re-run."""
    for _ in range(5):
        inp = torch.randn(20000).requires_grad_()
        phase1, phase2 = nn.Dropout(), nn.Dropout()
        state = torch.get_rng_state()
        with under(mode, [phase2]) as (f,):
            f(phase1(inp)).sum().backward()
        with_recompute = inp.grad
        torch.set_rng_state(state)
        inp.grad = None
        phase2(phase1(inp)).sum().backward()
        assert torch.equal(with_recompute, inp.grad)


@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_checkpoint_non_tensor(mode: str) -> None:
    """test_utils: test_checkpoint_non_tensor. A None argument."""
    block = Fn(lambda t1, t2: t1 if t2 is None else t1 + t2)
    x = torch.randn(1, 100, requires_grad=True)
    with under(mode, [block]) as (f,):
        f(x, None).sum().backward()
    assert torch.equal(x.grad, torch.ones(1, 100))


def _mixed(t1: Any, t2: Any, scale: int, t3: Any) -> tuple[Any, ...]:
    t4 = t1 + t2 * t3
    t5 = t1 * t2 + t3
    t4 *= scale
    t5 *= scale
    return scale, t4, None, True, t5, "bar", t1


@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_checkpoint_non_tensor_inputs_outputs(mode: str) -> None:
    """test_utils: test_checkpoint_non_tensor_inputs_outputs (less its reentrant-only second-backward
    error). Non-tensor arguments and outputs pass through; each output's backward gives torch's grads."""
    g = torch.Generator().manual_seed(0)
    t1, t2, t3 = (torch.rand(10, generator=g) for _ in range(3))
    t1.requires_grad_()
    t2.requires_grad_()
    with under(mode, [Fn(_mixed)]) as (f,):
        res = f(t1, t2, 7, t3)
        assert same(list(res), list(_mixed(t1, t2, 7, t3)))
        res[1].sum().backward(retain_graph=True)
        res[4].sum().backward(retain_graph=True)
        res[6].sum().backward()
    got = grads([t1, t2])
    t1.grad = t2.grad = None
    res = _mixed(t1, t2, 7, t3)
    res[1].sum().backward(retain_graph=True)
    res[4].sum().backward(retain_graph=True)
    res[6].sum().backward()
    assert same(got, grads([t1, t2]))


@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_checkpoint_no_tensors(mode: str) -> None:
    """test_utils: test_checkpoint_no_tensors. A block called with no tensor at all."""
    with under(mode, [Fn(_mixed)]) as (f,):
        assert f(0.25, 0.5, 3, 0.75) == _mixed(0.25, 0.5, 3, 0.75)


@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_checkpoint_partial_grad(mode: str) -> None:
    """test_utils: test_checkpoint_partial_grad. An output that does not require grad; a block where
    nothing requires grad raises on backward exactly as plain PyTorch does."""
    with under(mode, [Fn(lambda a, b: (a, b))]) as (f,):
        x = torch.randn(1, 4, requires_grad=True)
        out = f(x, torch.randn(1, 4))
        assert not out[1].requires_grad
        out[0].sum().backward()
    assert torch.equal(x.grad, torch.ones(1, 4))
    with under(mode, [Fn(lambda a, b: a * 2)]) as (f,):
        out = f(torch.randn(1, 4), torch.randn(1, 4, requires_grad=True))
        assert not out.requires_grad
        with pytest.raises(RuntimeError, match="does not require grad"):
            out.sum().backward()


@pytest.mark.parametrize("requires_grad", [True, False])
@pytest.mark.parametrize("mode", ["torch", "RRR", "rrr", "RKr", "SrR"])
def test_checkpointing_without_reentrant_input_requires_grad(mode: str, requires_grad: bool) -> None:
    """test_autograd: test_checkpointing_without_reentrant_input_requires_grad_True/_False. Parameter
    gradients are torch's whether or not the input requires grad."""
    model = _mlp((10, 10, 10, 10), seed=1)
    results = []
    for m in ("plain", mode):
        copy_ = copy.deepcopy(model)
        x = torch.randn(4, 10, generator=torch.Generator().manual_seed(2)).requires_grad_(requires_grad)
        with under(m, _chunks(copy_, 3)) as fns:
            out = x
            for f in fns:
                out = f(out)
            out.pow(2).sum().backward()
        results.append((grads(list(copy_.parameters())), x.grad))
    assert same(results[0], results[1])


class _UsesW(nn.Module):
    def __init__(self, w: nn.Parameter) -> None:
        super().__init__()
        self.w = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sin()


@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_checkpointing_without_reentrant_parameter_used_in_an_out(mode: str) -> None:
    """test_autograd: test_checkpointing_without_reentrant_parameter_used_in_an_out. A parameter used
    inside the block and outside it: its gradient is torch's, and a hook on it fires once."""
    results = []
    for m in ("plain", mode):
        w = nn.Parameter(torch.arange(1.0, 5.0))
        fired = []
        w.register_hook(lambda g, fired=fired: fired.append(1))
        x = torch.linspace(0, 1, 4, requires_grad=True)
        with under(m, [_UsesW(w)]) as (f,):
            (f(x) * w).sum().backward()
        results.append((w.grad, x.grad, len(fired)))
    assert same(results[0], results[1])
    assert results[1][2] == 1  # once, on the summed gradient, as in plain PyTorch


@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_checkpointing_without_reentrant_arbitrary_input_output(mode: str) -> None:
    """test_autograd: test_checkpointing_without_reentrant_arbitrary_input_output. Dicts in and out."""
    torch.manual_seed(3)
    layer = nn.Linear(5, 5)

    def fn(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"out": layer(d["x"]).relu(), "same": d["x"]}

    x = torch.randn(2, 5, requires_grad=True)
    ref = fn({"x": x})
    ref["out"].sum().backward()
    expected = (x.grad.clone(), layer.weight.grad.clone())
    x.grad = layer.weight.grad = layer.bias.grad = None
    with under(mode, [Fn(fn)]) as (f,):
        out = f({"x": x})
        assert out["same"] is x and torch.equal(out["out"], ref["out"])
        out["out"].sum().backward()
    assert same((x.grad, layer.weight.grad), expected)


@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_checkpointing_without_reentrant_correct_grad(mode: str) -> None:
    """test_autograd: test_checkpointing_without_reentrant_correct_grad."""
    a = torch.randn(2, 1, requires_grad=True)
    torch.exp(a).sum().backward()
    expected, a.grad = a.grad, None
    with under(mode, [Fn(torch.exp)]) as (f,):
        f(a).sum().backward()
    assert torch.equal(a.grad, expected)


class _SavesFive(torch.autograd.Function):
    second_unpack: list[BaseException] = []

    @staticmethod
    def forward(ctx, x, y, z):  # noqa: ANN001, ANN205
        w = x * y * z
        out = w + w
        ctx.save_for_backward(x, y, z, w, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        x, y, z, w, out = ctx.saved_tensors
        try:
            ctx.saved_tensors  # noqa: B018  (a recomputed tensor is handed out once)
        except (CheckpointError, RecomputeError) as e:
            _SavesFive.second_unpack.append(e)
        return x, y, z


@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_checkpointing_without_reentrant_custom_function_works(mode: str) -> None:
    """test_autograd: test_checkpointing_without_reentrant_custom_function_works. A custom Function
    inside the block; reading its saved tensors a second time raises (they are dropped once unpacked)."""

    def fn(x, y, z):  # noqa: ANN001, ANN202
        return _SavesFive.apply(x * y * z, y * y * z, z * z)

    _SavesFive.second_unpack.clear()
    x, y, z = (torch.tensor(v, requires_grad=True) for v in (1.0, 2.0, 3.0))
    with under(mode, [Fn(fn)]) as (f,):
        f(x, y, z).sum().backward()
    assert [type(e) for e in _SavesFive.second_unpack] == [unpack_error(mode)]
    got = grads([x, y, z])
    x.grad = y.grad = z.grad = None
    _SavesFive.second_unpack.clear()
    fn(x, y, z).sum().backward()
    assert same(got, grads([x, y, z]))


class _SavesY(torch.autograd.Function):
    seen: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx, x, y):  # noqa: ANN001, ANN205
        ctx.save_for_backward(y)
        return x

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        _SavesY.seen.append(ctx.saved_tensors[0])
        return g, None


@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_checkpointing_without_reentrant_saved_object_identity(mode: str) -> None:
    """test_autograd: test_checkpointing_without_reentrant_saved_object_identity. An argument that
    does not require grad, saved inside the block, is the caller's own object in backward (when the
    plan keeps the block's input on the device; a swapped input comes back as a copy)."""
    a = torch.tensor(1.0, requires_grad=True)
    b = torch.tensor(1.0)
    _SavesY.seen.clear()
    with under(mode, [Fn(_SavesY.apply)]) as (f,):
        f(a, b).backward()
    if mode == "r":
        assert torch.equal(_SavesY.seen[0], b)
    else:
        assert _SavesY.seen[0] is b


class _NoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2, bias=False)
        self.lin2 = nn.Linear(2, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.lin2(self.linear(x))


@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_checkpointing_without_reentrant_detached_tensor(mode: str) -> None:
    """test_autograd: test_checkpointing_without_reentrant_detached_tensor. A block whose output does
    not require grad (no_grad inside), made to require it outside."""
    a = torch.randn(2, 2, requires_grad=True)
    with under(mode, [_NoGrad()]) as (f,):
        for _ in range(3):
            out = f(a)
            assert not out.requires_grad
            out += a
            out.sum().backward()
    assert torch.equal(a.grad, torch.full((2, 2), 3.0))


@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_checkpointing_non_reentrant_autocast_cpu(mode: str) -> None:
    """test_autograd: test_checkpointing_non_reentrant_autocast_cpu. The re-run replays autocast."""
    torch.manual_seed(4)
    layer = nn.Linear(8, 8)

    def fn(x):  # noqa: ANN001, ANN202
        return torch.mm(layer(x), x.t()).relu()

    x = torch.randn(8, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(x)
    out.float().sum().backward()
    expected = grads([x, layer.weight])
    x.grad = layer.weight.grad = layer.bias.grad = None
    with under(mode, [Fn(fn)]) as (f,):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got_out = f(x)
        assert got_out.dtype == torch.bfloat16 and torch.equal(got_out, out)
        got_out.float().sum().backward()
    assert same(grads([x, layer.weight]), expected)


class _Flaky(nn.Module):
    """While ``flaky``, saves one tensor fewer, or one of another shape or dtype, when re-run."""

    def __init__(self, change: str) -> None:
        super().__init__()
        self.change = change
        self.flaky = True
        self.runs = [0]  # a list: NOTE [attributes a forward sets] in ooc.recompute (see _Counted)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs[0] += 1
        rerun = self.flaky and self.runs[0] % 2 == 0
        if self.change == "fewer":
            return (x * 1.0 if rerun else x.sin()).exp()
        if self.change == "shape":
            return (x.repeat(2, 1) if rerun else x).sin().sum(0, keepdim=True).exp()
        return (x.double() if rerun else x).sin().float().exp()


@pytest.mark.parametrize("change", ["fewer", "shape", "dtype"])
@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_checkpoint_detects_non_determinism(mode: str, change: str) -> None:
    """test_autograd: test_checkpoint_detects_non_determinism and test_checkpoint_valid_reset_on_error.
    A re-run that saves fewer tensors, or one of another shape or dtype, raises (ooc: naming the
    block) instead of giving wrong gradients; the next step works again. (A re-run that saves more
    is stopped early, as torch's is by default, and caught by the same checks.)"""
    block = _Flaky(change)
    with under(mode, [block]) as (f,):
        x = torch.randn(1, 4, requires_grad=True)
        out = f(x)
        with pytest.raises(unpack_error(mode)) as info:
            out.sum().backward()
        if mode != "torch":
            assert "blocks.0" in str(info.value)
        block.flaky = False
        x.grad = None
        f(x).sum().backward()
        assert x.grad is not None


@pytest.mark.parametrize("retain", [True, False])
@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_backward_inside_the_blocks_forward(mode: str, retain: bool) -> None:
    """torch/utils/checkpoint.py NOTE [ Nestable Checkpoint ], Rule 6 (backward inside the forward,
    with retain_graph True and False), as test_autograd's TestNestedCheckpoint exercises it: a block
    that calls ``autograd.grad`` in its forward gives torch's gradients."""

    def fn(x):  # noqa: ANN001, ANN202
        y = x.sin()
        z = y.cos()
        (gx,) = torch.autograd.grad(z.sum(), x, retain_graph=retain, create_graph=retain)
        return (x.cos() * gx, z) if retain else (x.cos() * gx,)

    def loss(outs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return sum(o.sum() for o in outs)

    x = torch.linspace(0.1, 0.9, 5, requires_grad=True)
    loss(fn(x)).backward()
    expected, x.grad = x.grad, None
    with under(mode, [Fn(fn)]) as (f,):
        loss(f(x)).backward()
    assert torch.equal(x.grad, expected)


def _grad_n(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, n: int) -> torch.Tensor:
    out = fn(x)
    for _ in range(n):
        (out,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out


def _inner(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp().sin()


@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_nested_checkpoint_higher_order(mode: str, nested: bool, order: int) -> None:
    """test_autograd TestNestedCheckpoint: test_nested_checkpoint (grad, grad of grad, grad^3).
    The block alone, and the block calling torch's checkpoint on an inner function (a checkpoint
    nested inside a recomputed block)."""

    def fn(x):  # noqa: ANN001, ANN202
        inner = checkpoint(_inner, x, use_reentrant=False) if nested else _inner(x)
        return inner.cos() * x

    x = torch.linspace(-1, 1, 6, requires_grad=True)
    expected = _grad_n(lambda t: _inner(t).cos() * t, x, order)
    with under(mode, [Fn(fn)]) as (f,):
        got = _grad_n(f, x, order)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", ["torch", "RR", "rr", "Rr"])
def test_nested_checkpoint_two_children_and_kwargs(mode: str) -> None:
    """test_autograd TestNestedCheckpoint: test_nested_checkpoint_two_children, test_nested_checkpoint_kwargs.
    Two blocks on one input, one called with keyword arguments; grad and grad of grad."""

    def child(x, *, scale):  # noqa: ANN001, ANN202
        return (x * scale).sin().cos()

    def run(fns: list[Callable[..., Any]], x: torch.Tensor) -> torch.Tensor:
        out = fns[0](x, scale=2.0) + fns[1](x.exp(), scale=0.5)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        return torch.stack([g.detach(), gg])

    x = torch.linspace(-1, 1, 5, requires_grad=True)
    expected = run([child, child], x)
    with under(mode, [Fn(child), Fn(child)]) as fns:
        assert torch.equal(run(fns, x), expected)


@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_nested_checkpoint_same_graph(mode: str) -> None:
    """test_autograd TestNestedCheckpoint: test_nested_checkpoint_same_graph. A hook on a node inside
    the block fires once: the block's nodes are those of the caller's graph."""
    fired = []
    x = torch.ones(1, requires_grad=True)
    with under(mode, [Fn(lambda t: t.sin().cos().sin())]) as (f,):
        out = f(x)
        out.grad_fn.next_functions[0][0].register_hook(lambda *_: fired.append(1))
        out.backward()
    assert fired == [1]


@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_nested_checkpoint_reentrant_backwards(mode: str) -> None:
    """test_autograd TestNestedCheckpoint: test_nested_checkpoint_reentrant_backwards. A hook on one
    output's node runs another backward through the same block."""

    def fn(x):  # noqa: ANN001, ANN202
        return x.sin().cos(), x.cos().sin()

    def run(f: Callable[..., Any]) -> torch.Tensor:
        x = torch.linspace(0.2, 0.8, 3, requires_grad=True)
        a, b = f(x)
        # Grad mode is off inside a hook: backward from b itself.
        a.grad_fn.register_hook(lambda *_: torch.autograd.backward(b, torch.ones_like(b), retain_graph=True))
        (a.sum() * 2).backward(retain_graph=True)
        return x.grad

    expected = run(fn)
    with under(mode, [Fn(fn)]) as (f,):
        assert torch.equal(run(f), expected)


class _CountsTail(nn.Module):
    """Counts how far each run gets: past its last saving op (``tail``) or at all (``runs``)."""

    def __init__(self, saves: bool) -> None:
        super().__init__()
        self.saves = saves
        self.runs = [0]  # lists: NOTE [attributes a forward sets] in ooc.recompute (see _Counted)
        self.tail = [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs[0] += 1
        y = x.sin() if self.saves else x + 1  # sin saves x; add saves nothing
        self.tail[0] += 1
        return y + 1


@pytest.mark.parametrize("mode", ONE_BLOCK)
def test_nested_checkpoint_early_stop(mode: str) -> None:
    """test_autograd TestNestedCheckpoint: test_nested_checkpoint_set_early_stop (early stop on, the
    default) and test_nested_checkpoint_set_early_stop_no_recompution_needed: the re-run stops after
    the last saved tensor, and a block that saves nothing is not re-run."""
    saving, silent = _CountsTail(saves=True), _CountsTail(saves=False)
    x = torch.randn(3, requires_grad=True)
    with under(mode, [saving]) as (f,):
        f(x).sum().backward()
    with under(mode, [silent]) as (f,):
        f(x).sum().backward()
    assert (saving.runs[0], saving.tail[0]) == (2, 1)
    assert (silent.runs[0], silent.tail[0]) == (1, 1)
