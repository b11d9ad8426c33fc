"""A selective re-run leaves out the uncached ops whose outputs only cached ops read (NOTE [the re-run
leaves ops out] in ooc.op_profile; the rule: NOTE [ops a re-run skips] in ooc.scheduler.oplevel).
No kernel of theirs runs, gradients equal plain PyTorch bit for bit, the measured peak stays the
schedule's, the measured profile predicts the left-out set, and a re-run that would read a left-out
output (or save one) raises instead of handing on its uninitialised bytes."""

from __future__ import annotations

import collections
import json
import random
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ooc
import ooc.op_profile
from ooc.models import GPT
from ooc.recompute import RecomputeError
from ooc.runtime import runtime_of
from ooc.scheduler import build_schedule
from ooc.scheduler.oplevel import rerun_skipped
from tests.helpers import (
    NANO,
    ce_loss,
    gpt_batch,
    gpt_loss,
    image_batch,
    random_cached_plan,
    small_resnet,
    stable_seed,
    tiny_llama_op_profile,
    train_side_by_side,
)

SOFTMAX = "aten._softmax.default"


class _Dispatched(TorchDispatchMode):
    """Counts the ops dispatched while it is on, by name (the re-run's left-out ops never reach it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _caching(prof, name: str) -> ooc.Plan:  # noqa: ANN001
    """Every block recomputed, caching the ops called ``name``."""
    return ooc.Plan(blocks=tuple(ooc.BlockPlan("recompute", cached_ops=tuple(k for k, op in enumerate(b.ops) if op.name == name))
                                 for b in prof.blocks), min_swap_bytes=prof.min_swap_bytes)


def _backward_ops(make, loss_fn, plan: ooc.Plan) -> collections.Counter[str]:  # noqa: ANN001
    torch.manual_seed(0)
    model = make()
    ooc.wrap(model, plan, backend="cpu")
    try:
        loss = loss_fn(model)
        with _Dispatched() as seen:
            loss.backward()
    finally:
        ooc.unwrap(model)
    return seen.calls


def _peak(make, loss_fn, plan: ooc.Plan, backend: str) -> ooc.MemoryReport:  # noqa: ANN001
    torch.manual_seed(0)
    model = make()
    ooc.wrap(model, plan, backend=backend)
    try:
        runtime_of(model).tracker.log = []
        loss_fn(model).backward()
        return ooc.memory_report(model)
    finally:
        ooc.unwrap(model)


def _check_left_out(make, loss_fn, prof, expected: list[str], caches, monkeypatch, backend: str) -> None:  # noqa: ANN001
    """Caching the softmax: each block's re-run leaves out the ``expected`` ops (by name), the ones the
    profile predicts; the backward dispatches exactly those fewer ops than a re-run that leaves out
    nothing; the measured peak is the schedule's."""
    plan = _caching(prof, SOFTMAX)
    assert all(b.cached_ops for b in plan.blocks)
    skipping = _backward_ops(make, loss_fn, plan)
    left_out = [sorted(c.left_out) for c in caches]
    assert left_out == [sorted(rerun_skipped(b.ops, d.cached_ops)) for b, d in zip(prof.blocks, plan.blocks)]
    assert [[b.ops[k].name for k in ks] for b, ks in zip(prof.blocks, left_out)] == [expected] * len(prof.blocks)
    report = _peak(make, loss_fn, plan, backend)
    assert (report.peak_bytes, report.current_bytes) == (build_schedule(plan, prof).peak_bytes, 0)
    with monkeypatch.context() as m:
        m.setattr(ooc.op_profile, "dead_ops", lambda *args: frozenset())
        everything = _backward_ops(make, loss_fn, plan)
        assert _peak(make, loss_fn, plan, backend).peak_bytes == report.peak_bytes
    names = collections.Counter(expected * len(prof.blocks))
    assert {name: everything[name] - skipping[name] for name in names} == names


# -- (a) the re-run leaves them out: models ---------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", "chaos"])
def test_gpt_rerun_leaves_out_the_scores_the_cached_softmax_reads(backend: str, gpt_profile, caches, monkeypatch) -> None:
    """scores = q @ k^T (bmm), * scale (mul), masked_fill: only the softmax reads them."""
    _check_left_out(lambda: GPT(NANO), lambda m: gpt_loss(m, gpt_batch()), gpt_profile,
                    ["aten.bmm.default", "aten.mul.Tensor", "aten.masked_fill.Scalar"], caches, monkeypatch, backend)
    plan = _caching(gpt_profile, SOFTMAX)
    # Dropout after the softmax (and on both residuals): the masks are drawn again bit for bit.
    results = train_side_by_side(lambda: GPT(NANO), gpt_loss, [gpt_batch(seed=s) for s in range(2)],
                                 lambda m: ooc.wrap(m, plan, backend=backend, check_recompute=True))
    assert results == [(True, True, True)] * 2


def test_hf_llama_eager_rerun_leaves_out_the_scores_the_cached_softmax_reads(caches, monkeypatch) -> None:
    """HF Llama's eager attention: scores (bmm), * scaling (mul), + causal mask (add)."""
    pytest.importorskip("transformers")
    make, x, prof = tiny_llama_op_profile("eager")
    loss = lambda m: m(input_ids=x, labels=x).loss  # noqa: E731
    _check_left_out(make, loss, prof, ["aten.bmm.default", "aten.mul.Tensor", "aten.add.Tensor"], caches, monkeypatch, "cpu")
    plan = _caching(prof, SOFTMAX)
    results = train_side_by_side(make, lambda m, b: m(input_ids=b, labels=b).loss, [x, x.flip(1)],
                                 lambda m: ooc.wrap(m, plan, backend="chaos"))
    assert results == [(True, True, True)] * 2


def test_the_forward_records_nothing_once_nothing_can_be_left_out(gpt_profile, caches, monkeypatch) -> None:  # noqa: ANN001
    """Past the last cached op, with no candidate left, the forward looks at no op's storages (NOTE
    [the re-run leaves ops out]: each op's bookkeeping is host time, on the critical path where kernels
    are short). Caching each block's first addmm (the qkv projection) leaves nothing out: the forward
    reads the storages of the ops up to it alone, and the gradients are plain PyTorch's."""
    first = [next(k for k, op in enumerate(b.ops) if op.name == "aten.addmm.default") for b in gpt_profile.blocks]
    plan = ooc.Plan(blocks=tuple(ooc.BlockPlan("recompute", cached_ops=(k,)) for k in first),
                    min_swap_bytes=gpt_profile.min_swap_bytes)
    assert not any(rerun_skipped(b.ops, (k,)) for b, k in zip(gpt_profile.blocks, first))
    assert all(k + 1 < len(b.ops) for b, k in zip(gpt_profile.blocks, first))  # ops after it to leave alone
    read, calls = ooc.op_profile._read_storages, [0]

    def counted(args: tuple, kwargs: dict) -> set[int]:
        calls[0] += 1
        return read(args, kwargs)

    monkeypatch.setattr(ooc.op_profile, "_read_storages", counted)
    results = train_side_by_side(lambda: GPT(NANO), gpt_loss, [gpt_batch(seed=s) for s in range(2)],
                                 lambda m: ooc.wrap(m, plan, backend="cpu"))
    assert results == [(True, True, True)] * 2
    assert [c.left_out for c in caches] == [{}] * len(caches) and len(caches) == 2 * len(first)
    assert calls[0] <= 2 * sum(k + 1 for k in first)


# -- (b) measured profiles record what each op reads, and predict the left-out set ------------------


def test_measured_reads_are_the_ops_whose_storages_an_op_reads(gpt_profile) -> None:
    ops = gpt_profile.blocks[1].ops
    assert all(op.reads is not None for b in gpt_profile.blocks for op in b.ops)
    at = {name: [k for k, op in enumerate(ops) if op.name == name] for name in {op.name for op in ops}}
    softmax, = at[SOFTMAX]
    assert ops[softmax].reads == (softmax - 1,) and ops[softmax - 1].name == "aten.masked_fill.Scalar"
    scores = max(k for k in at["aten.bmm.default"] if k < softmax)
    assert ops[scores + 2].name == "aten.mul.Tensor" and ops[scores + 2].reads == (scores,)  # through _unsafe_view
    assert all(ops[k].reads == () for k in at["aten.view.default"] + at["aten.transpose.int"])  # views read nothing
    assert ops[-1].returned and len(ops[-1].reads) == 2  # the residual add: the first add and the MLP's output


@pytest.mark.parametrize("which", ["gpt", "gpt-autocast", "cnn", "llama-sdpa", "llama-eager"])
def test_the_measured_profile_predicts_what_the_rerun_leaves_out(which: str, gpt_profile, cnn_profile, caches) -> None:
    """Random cached sets: the runtime leaves out exactly ``rerun_skipped`` of the measured profile,
    something in most plans, and the gradients equal plain PyTorch. Under autocast the weights'
    casts stay in autocast's cache after the forward: the runtime runs them, the profile says so."""
    if which == "gpt":
        make, prof, loss_fn, batches = (lambda: GPT(NANO)), gpt_profile, gpt_loss, [gpt_batch(seed=s) for s in range(2)]
    elif which == "gpt-autocast":
        def loss_fn(m: nn.Module, b: object) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return gpt_loss(m, b)

        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            prof = ooc.profile(GPT(NANO), gpt_batch(), ops=True, codec_errors=False, reps=1)
        assert any(op.outlives_forward for b in prof.blocks for op in b.ops)
        make, batches = (lambda: GPT(NANO)), [gpt_batch(seed=s) for s in range(2)]
    elif which == "cnn":
        x, y = image_batch()
        make, prof, loss_fn, batches = small_resnet, cnn_profile, ce_loss, [(x, y), (x.flip(0), y)]
    else:
        pytest.importorskip("transformers")
        make, x, prof = tiny_llama_op_profile(which.split("-")[1])
        loss_fn, batches = (lambda m, b: m(input_ids=b, labels=b).loss), [x, x.flip(1)]
    rng = random.Random(stable_seed("predicts", which))
    some = 0
    for _ in range(3):
        plan = random_cached_plan(prof, rng)
        caches.clear()
        results = train_side_by_side(make, loss_fn, batches, lambda m, p=plan: ooc.wrap(m, p, backend="cpu"))
        assert results == [(True, True, True)] * 2, plan
        predicted = [sorted(rerun_skipped(b.ops, d.cached_ops)) for b, d in zip(prof.blocks, plan.blocks)]
        assert [sorted(c.left_out) for c in caches] == predicted * len(batches), plan
        some += sum(map(bool, predicted))
    assert some  # not vacuous: some plan leaves something out


def test_ooc_profile_ops_writes_what_each_op_reads(tmp_path) -> None:  # noqa: ANN001
    from ooc.apps.cli import main

    path = tmp_path / "prof.json"
    assert main(["profile", "--model", "gpt:nano", "--batch", "2", "--seq", "16", "--reps", "1", "--ops", "--out", str(path)]) == 0
    blocks = json.loads(path.read_text())["blocks"]
    assert all(isinstance(op["reads"], list) for b in blocks for op in b["ops"])
    assert any(op["reads"] for b in blocks for op in b["ops"])


# -- (c) adversarial: what the forward did not show ---------------------------------------------------


class _Scores(nn.Module):
    """``scores = x @ w`` (mm), ``probs = softmax(scores)``: with the softmax cached, the re-run leaves
    the mm out unless ``read`` (a mode of this module) reads the scores another way."""

    def __init__(self, read: str = "") -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) / 3)
        self.scale = nn.Parameter(torch.linspace(1, 2, 6))
        self.read = read
        self.calls = [0]  # a list: a re-run puts the module's own attributes back (NOTE [attributes a forward sets])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[0] += 1
        rerun = self.calls[0] > 1
        scores = x @ self.w
        if self.read == "rerun-copies":  # a view in the forward, a copy in the re-run: the same op
            scores = _MaybeView.apply(scores, rerun)
        probs = F.softmax(scores.view(scores.shape) if self.read == "through-view" else scores, dim=-1)
        if self.read == "item":
            return probs * scores.sum().item()
        if self.read == "in-place":
            scores.add_(1)
        if self.read == "stash":
            self.stashed = scores.detach()
        if self.read == "unseen-kernel":  # as a Triton kernel launched directly: no op dispatched
            doubled = torch.empty_like(probs)
            doubled.detach().numpy()[:] = scores.detach().numpy() * 2
            return doubled * self.scale
        if self.read in ("saved", "rerun-saves"):
            return _SaveFirst.apply(scores if self.read == "saved" or rerun else probs, probs)
        # Doubling saves nothing (autograd saving a left-out output is the other refusal); the
        # product with a parameter saves the doubled tensor: the re-run goes on to it.
        return ((scores if self.read == "rerun-reads" and rerun else probs) * 2) * self.scale


class _SaveFirst(torch.autograd.Function):
    """``2 * b``, saving ``a`` (which it does not read) for its backward: the gradient of ``a`` is ``a``."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(a)
        return b * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        (a,) = ctx.saved_tensors
        return grad * a, grad * 2


class _MaybeView(torch.autograd.Function):
    """``ooc_test::maybe_view``: an op (seen by the dispatch modes) declared a view, which copies when asked."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, copy: bool) -> torch.Tensor:  # noqa: ANN001
        return torch.ops.ooc_test.maybe_view(x, copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return grad, None


@pytest.fixture(scope="module")
def maybe_view() -> Iterator[None]:
    lib = torch.library.Library("ooc_test", "DEF")
    lib.define("maybe_view(Tensor(a) x, bool copy) -> Tensor(a)")
    lib.impl("maybe_view", lambda x, copy: x.clone() if copy else x.view(x.shape), "CompositeExplicitAutograd")
    yield
    lib._destroy()


class _Model(nn.Module):
    def __init__(self, read: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Scores(read), nn.Linear(6, 6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x))


def _softmax_plan(read: str) -> ooc.Plan:
    from ooc.op_profile import OpRecorder

    recorder = OpRecorder(torch.device("cpu"))

    def pack(t: torch.Tensor) -> torch.Tensor:
        with recorder.paused():  # the hook's detach is not the block's (NOTE [counting a block's ops])
            return t.detach()

    block, x = _Scores(read), torch.randn(3, 6, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
        block(x)
    return ooc.Plan.of([ooc.BlockPlan("recompute", cached_ops=(recorder.names.index(SOFTMAX),)), "keep"])


def _left_out_and_grads(read: str, caches) -> tuple[list[str], bool]:  # noqa: ANN001
    """The names of the ops the re-run left out, and whether the gradients (and, where the block
    stashes its scores, the stashed tensor) equal plain PyTorch's."""
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    results = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = _Model(read)
        if wrap:
            ooc.wrap(model, _softmax_plan(read), backend="chaos", blocks=model.blocks)
        inputs = x.clone().requires_grad_()
        model(inputs).square().sum().backward()
        results.append([inputs.grad, *(p.grad for p in model.parameters()), getattr(model.blocks[0], "stashed", x)])
        if wrap:
            ooc.unwrap(model)
    cache, = caches
    equal = all((a is None and b is None) or torch.equal(a, b) for a, b in zip(*results))
    return [str(cache.funcs[k]) for k in cache.left_out], equal


@pytest.mark.parametrize("read", ["", "through-view"])
def test_the_plain_case_leaves_the_mm_out(read: str, caches) -> None:
    """The softmax reads the scores, directly or through a view: the re-run runs no mm, exactly."""
    assert _left_out_and_grads(read, caches) == (["aten.mm.default"], True)


@pytest.mark.parametrize("read", ["item", "in-place", "stash", "saved", "unseen-kernel"])
def test_an_output_read_or_held_outside_the_cache_is_not_left_out(read: str, caches) -> None:
    """Another op reads the scores (``.sum().item()``, an in-place add), the block stashes them in an
    attribute (alive after the forward), a custom Function saves them without reading them, or a
    kernel no dispatch sees reads them into a buffer from ``torch.empty``: the re-run computes the
    mm, and the gradients (and the stashed scores) are exact."""
    assert _left_out_and_grads(read, caches) == ([], True)


@pytest.mark.parametrize("read, what", [
    ("rerun-reads", r"op \d+ \(aten\.mul\.Tensor\) reads it"),
    ("rerun-saves", "autograd saves it for the backward"),
    ("rerun-copies", r"op \d+ \(ooc_test\.maybe_view\.default\), a view in the forward, copies it"),
])
def test_a_rerun_that_reads_or_saves_a_left_out_output_is_refused(read: str, what: str, caches, maybe_view) -> None:  # noqa: ANN001
    """The re-run does what the forward did not (the same ops, other arguments): it doubles the scores
    instead of the softmax, a custom Function saves the scores where the forward saved the softmax,
    or an op that made a view of them copies them. Each would hand on the uninitialised scores: it
    raises, naming the block and the op."""
    torch.manual_seed(0)
    model = _Model(read)
    ooc.wrap(model, _softmax_plan(read), backend="cpu", blocks=model.blocks)
    try:
        out = model(torch.randn(3, 6, requires_grad=True)).sum()
        assert [str(caches[0].funcs[k]) for k in caches[0].left_out] == ["aten.mm.default"]
        with pytest.raises(RecomputeError, match=rf"block blocks\.0: its re-run leaves out op \d+ \(aten\.mm\.default\).*"
                                                 rf"but in the re-run {what}.*leave op \d+ out of cached_ops"):
            out.backward()
    finally:
        ooc.unwrap(model)


@pytest.mark.parametrize("read", ["", "unseen-kernel", "stash"])
def test_a_profile_predicts_no_skip_the_runtime_declines(read: str, caches) -> None:
    """The measured profile of the block whose unseen kernel reads the scores records no ``reads``;
    that of the block that stashes its scores marks the mm ``outlives_forward``: either way the
    planner prices its re-run leaving nothing out, as the runtime runs it. The plain block's predict
    the mm, and the runtime leaves out what the profile predicts."""
    torch.manual_seed(0)
    model = _Model(read)
    prof = ooc.profile(model, torch.randn(3, 6), blocks=model.blocks, ops=True, codec_errors=False, reps=1)
    ops = prof.blocks[0].ops
    softmax = [k for k, op in enumerate(ops) if op.name == SOFTMAX]
    assert [ops[k].name for k in rerun_skipped(ops, softmax)] == ([] if read else ["aten.mm.default"])
    assert all((op.reads is None) == (read == "unseen-kernel") for op in ops)
    assert [op.name for op in ops if op.outlives_forward] == (["aten.mm.default"] if read == "stash" else [])
    assert all(op.reads is not None and not op.outlives_forward for op in prof.blocks[1].ops)
    left_out, exact = _left_out_and_grads(read, caches)
    assert (left_out, exact) == ([ops[k].name for k in rerun_skipped(ops, softmax)], True)
