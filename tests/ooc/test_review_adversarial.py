"""Adversarial checks of the selective re-run that leaves ops out (NOTE [the re-run leaves ops out] in
ooc.op_profile): a re-run either gives plain PyTorch's gradients bit for bit or raises."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc
from ooc.op_profile import OpRecorder
from tests.helpers import random_cached_plan

SOFTMAX = "aten._softmax.default"


def _unseen_double(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Writes ``2 * src`` into ``dst`` as a Triton kernel launched directly would: no op dispatched."""
    dst.detach().numpy()[...] = src.detach().numpy() * 2


class _Unseen(nn.Module):
    """``scores = x @ w``; ``probs = softmax(scores)`` (the cached op); a kernel no dispatch shows reads
    the scores into a buffer, which ``how`` then uses."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) / 3)
        self.scale = nn.Parameter(torch.linspace(1, 2, 6))
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = x @ self.w
        probs = F.softmax(scores, dim=-1)
        if self.how == "in-place-after":  # the kernel's output, then an in-place op on it (a fused bias, relu_)
            buf = torch.empty_like(probs)
            _unseen_double(scores, buf)
            buf.add_(1)
        elif self.how == "partly-written":  # a seen op writes a part, the kernel the rest
            buf = torch.empty(probs.shape[0], probs.shape[1] + 1)
            buf[:, 0] = 0
            _unseen_double(scores, buf[:, 1:])
            buf = buf[:, 1:]
        elif self.how == "half-copied":  # a seen copy writes the left half, the kernel the right; all is read
            buf = torch.empty_like(probs)
            buf[:, :3] = x[:, :3]
            _unseen_double(scores[:, 3:], buf[:, 3:])
        elif self.how == "strided-gaps":  # a seen fill writes every other column, the kernel the gaps
            buf = torch.empty_like(probs)
            buf[:, ::2] = 0
            _unseen_double(scores[:, 1::2], buf[:, 1::2])
        elif self.how == "copied-within":  # the kernel writes one half, a seen copy reads it into the other
            buf = torch.empty(probs.shape[0], 2 * probs.shape[1])
            _unseen_double(scores, buf[:, :6])
            buf[:, 6:] = buf[:, :6]
            buf = buf[:, 6:]
        elif self.how == "returned-half":  # a seen copy writes the left half, the kernel the right; no op reads it
            buf = torch.empty_like(probs)
            buf[:, :3] = probs[:, :3] * self.scale[:3]
            _unseen_double(scores[:, 3:], buf[:, 3:])
            return buf
        elif self.how == "resized":  # grown by resize_ (as torch.empty(..., out=) and older code do): as blank
            buf = probs.new_empty(0).resize_(probs.shape)
            _unseen_double(scores, buf)
        elif self.how == "out-of-empty":  # torch.empty(..., out=) resizes its out: blank too
            buf = torch.empty(probs.shape, out=probs.new_empty(0))
            _unseen_double(scores, buf)
        elif self.how == "set-to-empty":  # a tensor set_ onto an empty buffer's storage
            store = torch.empty(probs.shape).untyped_storage()
            buf = probs.new_empty(0).set_(store, 0, probs.shape, probs.stride())
            _unseen_double(scores, buf)
        elif self.how == "covered-in-two":  # two seen copies write the whole buffer, no kernel
            buf = torch.empty_like(probs)
            buf[:, :2] = x[:, :2]
            buf[:, 2:] = probs[:, 2:]
        elif self.how == "covered-strided":  # two seen writes of alternate columns cover the buffer, no kernel
            buf = torch.empty_like(probs)
            buf[:, ::2] = x[:, ::2]
            buf[:, 1::2] = 1
        elif self.how == "read-where-written":  # a seen copy writes all but a column nothing reads, no kernel
            buf = torch.empty(probs.shape[0], probs.shape[1] + 1)
            buf[:, 1:] = x
            buf = buf[:, 1:]
        else:  # the plain case the NOTE covers: the product reads the unwritten buffer
            buf = torch.empty_like(probs)
            _unseen_double(scores, buf)
        return (buf + probs) * self.scale


class _Model(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Unseen(how), nn.Linear(6, 6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x))


def _softmax_plan(block: nn.Module) -> ooc.Plan:
    recorder = OpRecorder(torch.device("cpu"))

    def pack(t: torch.Tensor) -> torch.Tensor:
        with recorder.paused():
            return t.detach()

    x = torch.randn(3, 6, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
        block(x)
    return ooc.Plan.of([ooc.BlockPlan("recompute", cached_ops=(recorder.names.index(SOFTMAX),)), "keep"])


def _step_grads(model: nn.Module, plan: ooc.Plan | None, x: torch.Tensor) -> list[torch.Tensor]:
    """One backward of ``model`` on ``x`` (wrapped with ``plan`` around its ``blocks``, unless
    ``None``): the input's gradient, then the parameters'."""
    if plan is not None:
        ooc.wrap(model, plan, backend="cpu", blocks=model.blocks)
    try:
        inputs = x.clone().requires_grad_()
        model(inputs).square().sum().backward()
    finally:
        if plan is not None:
            ooc.unwrap(model)
    return [inputs.grad, *(p.grad for p in model.parameters())]


def _grads(how: str, wrap: bool, caches) -> tuple[list[torch.Tensor], list[str]]:  # noqa: ANN001
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = _Model(how)
    grads = _step_grads(model, _softmax_plan(_Unseen(how)) if wrap else None, x)
    left_out = [str(caches[-1].funcs[k]) for k in caches[-1].left_out] if wrap else []
    return grads, left_out


@pytest.mark.parametrize("how", [
    "",
    "in-place-after",
    "partly-written",
    "half-copied",
    "strided-gaps",
    "copied-within",
    "returned-half",
    "resized",
    "out-of-empty",
    "set-to-empty",
])
def test_an_unseen_kernel_into_an_empty_buffer_is_seen_whatever_follows(how: str, caches, poisoned) -> None:
    """The unseen kernel's buffer is read by an in-place op, or was partly written by a seen op (a
    block of columns, every other column; the block returns it unread), or is read by a seen copy into
    its other half: the forward
    still shows that a kernel ran unseen, the re-run leaves nothing out, the gradients are exact."""
    plain, _ = _grads(how, False, caches)
    wrapped, left_out = _grads(how, True, caches)
    assert all(torch.equal(a, b) for a, b in zip(plain, wrapped)), left_out
    assert left_out == []


@pytest.mark.parametrize("how", ["covered-in-two", "covered-strided", "read-where-written"])
def test_seen_writes_that_cover_what_is_read_leave_the_scores_out(how: str, caches, poisoned) -> None:
    """Seen ops write a buffer from torch.empty in parts that cover it, or cover what is read of it,
    and no kernel runs unseen: nothing shows one, the re-run still leaves the mm out, exactly."""
    plain, _ = _grads(how, False, caches)
    wrapped, left_out = _grads(how, True, caches)
    assert all(torch.equal(a, b) for a, b in zip(plain, wrapped)), left_out
    assert left_out == ["aten.mm.default"]



@pytest.mark.parametrize("write, read, flagged", [
    (lambda b: b.fill_(1), lambda b: b + 1, False),
    (lambda b: b.t().copy_(torch.ones(6, 4)), lambda b: b + 1, False),
    (lambda b: b.view(2, 2, 6).permute(2, 0, 1).zero_(), lambda b: b + 1, False),
    (lambda b: b[1:].fill_(1), lambda b: b + 1, True),
    (lambda b: b[1:].fill_(1), lambda b: b[1:] + 1, False),
    (lambda b: b[:, ::2].fill_(1), lambda b: b[:, ::2] + 1, False),
    (lambda b: b[:, ::2].fill_(1), lambda b: b[:, 1] + 1, True),
    (lambda b: b.view(-1).view(torch.uint8)[:12].zero_(), lambda b: b[0, :3] + 1, False),
    (lambda b: b.view(-1).view(torch.uint8)[:13].zero_(), lambda b: b[0, :4] + 1, True),
    (lambda b: torch.add(torch.ones(2, 6), 1, out=b[:2]), lambda b: b[:2] + 1, False),
    (lambda b: b[:2].fill_(1), lambda b: b[:2].add_(1), False),
    (lambda b: b[:2].fill_(1), lambda b: b[1:3].add_(1), True),
    (lambda b: b[:2].fill_(1), lambda b: b[2:].copy_(b[:2]), False),
    (lambda b: b[2:].fill_(1), lambda b: b[2:].copy_(b[:2]), True),
    (lambda b: b.fill_(1).resize_(8, 6), lambda b: b[4:] + 1, True),
    (lambda b: b.resize_(2, 6), lambda b: b + 1, True),
    (lambda b: torch.empty(0).set_(b.untyped_storage(), 0, (2, 6), (6, 1)), lambda b: b + 1, True),
    (lambda b: b.fill_(1).t_(), lambda b: b + 1, False),
], ids=["whole", "whole-transposed", "whole-permuted", "rows-read-all", "rows-read-rows", "strided-read-written",
        "strided-read-gap", "bytes-read-written", "bytes-read-one-more", "out-read-written", "in-place-on-written",
        "in-place-on-unwritten", "copy-from-written", "copy-from-unwritten", "resize-grown-read-new",
        "resize-shrunk-no-write", "set-onto-it-no-write", "transposed-in-place-written"])
def test_seen_writes_clear_exactly_the_bytes_they_write(write, read, flagged: bool, monkeypatch) -> None:  # noqa: ANN001
    """A buffer from torch.empty (4 x 6 floats) is blank where no seen op wrote it, at byte grain and
    in any layout; an op that reads a blank byte (an in-place op other than a copy reads what it writes)
    shows an unseen kernel. A write of the whole buffer, in any order of its dimensions, keeps no record.
    A resize_ writes nothing, and one that grows the buffer moves it into new uninitialised bytes; a
    set_ onto its storage and a t_ change only metadata."""
    from ooc.op_profile import _UnseenWrites

    if write(torch.empty(4, 6)).numel() == 24:
        monkeypatch.setattr(_UnseenWrites, "_mask", lambda *_: pytest.fail("a whole write made a record"))
    recorder = OpRecorder(torch.device("cpu"))
    with recorder:
        buf = torch.empty(4, 6)
        write(buf)
        read(buf)
    assert (recorder.unseen.reason is not None) == flagged, recorder.unseen.reason


# -- models ooc's tests did not write: random cached sets, the left-out outputs poisoned ------------


@pytest.fixture
def poisoned(monkeypatch) -> None:  # noqa: ANN001
    """Every uninitialised output a re-run hands out is filled with 0x7F bytes (a large finite float):
    a re-run that reads one gives other gradients, not by luck the forward's bytes again."""
    allocate = ooc.op_profile._Layout.allocate

    def filled(self):  # noqa: ANN001, ANN202
        out, storages = allocate(self)
        for s in storages:
            if s.nbytes():
                torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).fill_(0x7F)
        return out, storages

    monkeypatch.setattr(ooc.op_profile._Layout, "allocate", filled)


def _hf(which: str, attn: str) -> tuple[object, object, object]:
    """(make a model in training mode, a batch, the loss of a model on a batch)."""
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    if which == "gpt2":
        config = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                         attn_implementation=attn, use_cache=False)
        make = lambda: transformers.GPT2LMHeadModel(config).train()  # noqa: E731
        x = torch.randint(0, 97, (2, 12), generator=g)
        mask = torch.ones_like(x)
        mask[1, :3] = 0
        return make, (x, mask), lambda m, b: m(input_ids=b[0], attention_mask=b[1], labels=b[0]).loss
    if which == "bert":
        config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, max_position_embeddings=32, attn_implementation=attn)
        make = lambda: transformers.BertForMaskedLM(config).train()  # noqa: E731
        x = torch.randint(0, 97, (2, 12), generator=g)
        mask = torch.ones_like(x)
        mask[0, -4:] = 0
        return make, (x, mask), lambda m, b: m(input_ids=b[0], attention_mask=b[1], labels=b[0]).loss
    if which == "vit":
        config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=64, num_labels=5, attn_implementation=attn)
        make = lambda: transformers.ViTForImageClassification(config).train()  # noqa: E731
        return make, (torch.randn(2, 3, 16, 16, generator=g), torch.tensor([1, 3])), \
            lambda m, b: m(pixel_values=b[0], labels=b[1]).loss
    raise ValueError(which)


def _kwargs(which: str, batch) -> dict:  # noqa: ANN001
    if which == "vit":
        return {"pixel_values": batch[0], "labels": batch[1]}
    return {"input_ids": batch[0], "attention_mask": batch[1], "labels": batch[0]}


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("which, attn", [("gpt2", "eager"), ("gpt2", "sdpa"), ("bert", "eager"), ("bert", "sdpa"),
                                         ("vit", "eager"), ("vit", "sdpa")])
def test_hf_models_random_cached_sets_equal_plain(which: str, attn: str, autocast: bool, caches, poisoned) -> None:
    import random

    from ooc.scheduler.oplevel import rerun_skipped

    make, batch, loss = _hf(which, attn)
    if autocast:
        plain_loss = loss

        def loss(m, b):  # noqa: ANN001, ANN202
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return plain_loss(m, b)
    torch.manual_seed(0)
    model = make()
    if autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            prof = ooc.profile(model, _kwargs(which, batch), ops=True, codec_errors=False, reps=1)
    else:
        prof = ooc.profile(model, _kwargs(which, batch), ops=True, codec_errors=False, reps=1)
    rng = random.Random(f"{which}-{attn}-{autocast}")
    left = 0
    for _ in range(3):
        plan = random_cached_plan(prof, rng)
        caches.clear()
        from tests.helpers import train_side_by_side
        results = train_side_by_side(make, loss, [batch, batch], lambda m, p=plan: ooc.wrap(m, p, backend="cpu"))
        assert results == [(True, True, True)] * 2, plan
        predicted = [set(rerun_skipped(b.ops, d.cached_ops)) for b, d in zip(prof.blocks, plan.blocks)]
        measured = [set(c.left_out) for c in caches][: len(predicted)]
        if autocast:
            # The weights' casts stay alive in autocast's cache after the forward: the runtime keeps
            # them, the profile cannot tell (the planner prices their skip: time, not gradients).
            assert all(m <= p for m, p in zip(measured, predicted)), plan
        else:
            assert measured == predicted, plan
        left += sum(len(c.left_out) for c in caches)
    assert left


# -- a compiled submodule inside a selectively recomputed block ---------------------------------------


class _CompiledTail(nn.Module):
    """``scores = x @ w``; ``probs = softmax(scores)`` (the cached op); a ``torch.compile``d function
    (Inductor's kernels: no op dispatched) reads the scores too."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) / 3)
        self.scale = nn.Parameter(torch.linspace(1, 2, 6))
        self.tail = torch.compile(lambda s: s * 2 + 1, backend="inductor")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = x @ self.w
        probs = F.softmax(scores, dim=-1)
        return (self.tail(scores) + probs) * self.scale


class _CompiledModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_CompiledTail(), nn.Linear(6, 6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x))


def test_a_compiled_function_reading_an_output_a_cached_op_reads(caches, poisoned) -> None:
    """Inductor's kernels read the scores and write buffers no ``empty`` op made: the re-run must not
    leave the mm out (or must raise), and the gradients equal plain PyTorch's."""
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = _CompiledModel()
        model(x.clone().requires_grad_()).sum().backward()  # compiled outside ooc's modes
        model.zero_grad(set_to_none=True)
        grads.append(_step_grads(model, _softmax_plan(_Unseen("")) if wrap else None, x))
    left_out = [str(caches[-1].funcs[k]) for k in caches[-1].left_out]
    torch._dynamo.reset()  # drop the compiled code and the fake tensors it holds (later tests count live tensors)
    assert all(torch.equal(a, b) for a, b in zip(*grads)), left_out


# -- a retained graph, double backward, two graphs alive --------------------------------------------


def _gpt_softmax_plan():  # noqa: ANN202
    from ooc.models import GPT
    from tests.helpers import NANO_NO_DROPOUT, gpt_batch

    torch.manual_seed(0)
    prof = ooc.profile(GPT(NANO_NO_DROPOUT), gpt_batch(), ops=True, codec_errors=False, reps=1)
    plan = ooc.Plan(blocks=tuple(ooc.BlockPlan("recompute", cached_ops=tuple(k for k, op in enumerate(b.ops) if op.name == SOFTMAX))
                                 for b in prof.blocks), min_swap_bytes=prof.min_swap_bytes)
    return (lambda: GPT(NANO_NO_DROPOUT)), plan


@pytest.mark.parametrize("how", ["retain", "double", "two-graphs"])
def test_rerun_with_left_out_ops_across_backwards(how: str, caches, poisoned) -> None:
    from tests.helpers import gpt_batch, gpt_loss

    make, plan = _gpt_softmax_plan()
    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = make()
        if wrap:
            ooc.wrap(model, plan, backend="cpu")
        try:
            params = list(model.parameters())
            if how == "retain":
                loss = gpt_loss(model, gpt_batch())
                loss.backward(retain_graph=True)
                loss.backward()
            elif how == "double":
                loss = gpt_loss(model, gpt_batch())
                first = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
                sum(g.square().sum() for g in first if g is not None).backward()
            else:
                a, b = gpt_loss(model, gpt_batch(seed=1)), gpt_loss(model, gpt_batch(seed=2))
                b.backward()
                a.backward()
        finally:
            if wrap:
                ooc.unwrap(model)
        grads.append([p.grad for p in params])
    assert sum(len(c.left_out) for c in caches) > 0
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(*grads))


class _TwoHeads(nn.Module):
    """Its input goes straight into two linears (BERT's query, key and value): under autocast each
    casts it (the input is no leaf in the forward: autocast caches no cast of it)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.q(x), dim=-1) * self.k(x)


def test_a_block_that_casts_its_input_twice_under_autocast() -> None:
    """The re-run's input must be no leaf where the forward's was none: autocast caches the casts of
    leaves that require grad, and the re-run would cast the input once (an op fewer than the forward,
    a RecomputeError before the fix); the gradients equal plain PyTorch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(6), _TwoHeads(), nn.Linear(6, 6))  # layer_norm: float32 under autocast
    recorder = OpRecorder(torch.device("cpu"))
    x = torch.randn(3, 6, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model[0](x)
        with recorder:
            model[1](h)
    softmax = recorder.names.index(SOFTMAX)
    plan = ooc.Plan.of(["keep", ooc.BlockPlan("recompute", cached_ops=(softmax,)), "keep"])
    grads = []
    for wrap in (False, True):
        if wrap:
            ooc.wrap(model, plan, backend="cpu", blocks=list(model))
        model.zero_grad(set_to_none=True)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().square().sum()
            loss.backward()
        finally:
            if wrap:
                ooc.unwrap(model)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_an_op_profile_made_under_autocast_counts_a_training_steps_ops(caches) -> None:  # noqa: ANN001
    """The caller's autocast spans the profile's forwards: the weights' casts of the first stayed in
    autocast's cache, the measured forwards dispatched fewer ops than a training step's (whose
    autocast is new), and every op index a plan named was off."""
    from ooc.models import GPT
    from tests.helpers import NANO_NO_DROPOUT, gpt_batch, gpt_loss

    torch.manual_seed(0)
    model = GPT(NANO_NO_DROPOUT)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prof = ooc.profile(model, gpt_batch(), ops=True, codec_errors=False, reps=2)
    first = [next(k for k, op in enumerate(b.ops) if op.cacheable) for b in prof.blocks]
    ooc.wrap(model, ooc.Plan.of([ooc.BlockPlan("recompute", cached_ops=(k,)) for k in first]), backend="cpu")
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = gpt_loss(model, gpt_batch())
        loss.backward()
    finally:
        ooc.unwrap(model)
    assert [[str(f) for f in c.funcs] for c in caches] == [[op.name for op in b.ops] for b in prof.blocks]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_backward_inside_autocast_with_a_selective_plan(dropout: float, caches) -> None:
    """A backward inside the forward's autocast (torch advises against it, users do it) finds the
    forward's weight casts still cached at the re-run: the re-run casts anew, as the forward did, and
    the gradients are the plain model's, bit for bit."""
    from ooc.models import GPT
    from tests.helpers import NANO, gpt_batch, gpt_loss

    config = replace(NANO, dropout=dropout)

    def grads(plan: ooc.Plan | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = GPT(config)
        if plan is not None:
            ooc.wrap(model, plan, backend="cpu")
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                gpt_loss(model, gpt_batch()).backward()
        finally:
            if plan is not None:
                ooc.unwrap(model)
        return [p.grad for p in model.parameters()]

    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prof = ooc.profile(GPT(config), gpt_batch(), ops=True, codec_errors=False, reps=1)
    plan = ooc.Plan.of([ooc.BlockPlan("recompute", cached_ops=tuple(k for k, op in enumerate(b.ops) if op.name == SOFTMAX))
                        for b in prof.blocks])
    plain = grads(None)
    wrapped = grads(plan)
    assert all(torch.equal(a, b) for a, b in zip(plain, wrapped, strict=True))
    assert len(caches) == len(prof.blocks) and all(c.left_out for c in caches)


@pytest.mark.parametrize("which, attn", [("gpt2", "eager"), ("bert", "sdpa"), ("vit", "eager")])
def test_hf_models_measured_peak_is_the_schedules(which: str, attn: str, caches) -> None:
    import random

    from ooc.runtime import runtime_of
    from ooc.scheduler import build_schedule

    make, batch, loss = _hf(which, attn)
    torch.manual_seed(0)
    prof = ooc.profile(make(), _kwargs(which, batch), ops=True, codec_errors=False, reps=1)
    rng = random.Random(f"peak-{which}")
    for _ in range(3):
        plan = random_cached_plan(prof, rng)
        torch.manual_seed(0)
        model = make()
        ooc.wrap(model, plan, backend="cpu")
        try:
            runtime_of(model).tracker.log = []
            loss(model, batch).backward()
            report = ooc.memory_report(model)
        finally:
            ooc.unwrap(model)
        assert (report.peak_bytes, report.current_bytes) == (build_schedule(plan, prof).peak_bytes, 0), plan


class _EmptyRead(nn.Module):
    """``scores = x @ w`` read by the softmax (the cached op) and by an op whose output holds no byte
    on the block's device (``new_zeros(0)``; on a GPU, ``.cpu()`` of the scores, for a log, is one too)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = x @ self.w
        self.empty = scores.new_zeros(0)
        return F.softmax(scores, dim=-1) * 2


def test_the_profile_predicts_the_left_out_ops_past_an_op_with_no_bytes(caches) -> None:  # noqa: ANN001
    """An op that reads the scores and holds no byte on the device is a computing reader at run time
    (it is no view): the planner must not take it for a view, nor price the mm as skipped."""
    from ooc.scheduler.oplevel import rerun_skipped

    torch.manual_seed(0)
    model = nn.Sequential(_EmptyRead(), nn.Linear(6, 6))
    x = torch.randn(3, 6)
    prof = ooc.profile(model, x, blocks=list(model), ops=True, codec_errors=False, reps=1)
    ops = prof.blocks[0].ops
    softmax = [k for k, op in enumerate(ops) if op.name == SOFTMAX]
    ooc.wrap(model, ooc.Plan.of([ooc.BlockPlan("recompute", cached_ops=tuple(softmax)), "keep"]), backend="cpu",
             blocks=list(model))
    try:
        model(x.requires_grad_()).sum().backward()
    finally:
        ooc.unwrap(model)
    assert sorted(rerun_skipped(ops, softmax)) == sorted(caches[-1].left_out)


class _TiedSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.lin(x), dim=-1) * x


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("first", ["keep", "recompute"])
def test_a_weight_shared_by_two_blocks_under_autocast(first: str, inside: bool, caches) -> None:  # noqa: ANN001
    """Two blocks share a weight (ALBERT, tied layers): under autocast the second block's forward finds
    the first's cast of it cached and dispatches no _to_copy, but its re-run (autocast's cache empty,
    or emptied) casts it: the re-run runs that cast uncounted instead of raising RecomputeError, and the
    gradients are plain PyTorch's, bit for bit (backward after the autocast, or inside it)."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(_TiedSoftmax(), _TiedSoftmax(), nn.Linear(6, 6))
        model[1].lin.weight = model[0].lin.weight
        return model

    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        profiled = make()
        prof = ooc.profile(profiled, x, blocks=list(profiled), ops=True, codec_errors=False, reps=1)
    softmax = [tuple(k for k, op in enumerate(b.ops) if op.name == SOFTMAX) for b in prof.blocks]
    plan = ooc.Plan.of([ooc.BlockPlan(first, cached_ops=softmax[0] if first == "recompute" else ()),
                        ooc.BlockPlan("recompute", cached_ops=softmax[1]), "keep"])
    grads = []
    for wrap in (False, True):
        model = make()
        if wrap:
            ooc.wrap(model, plan, backend="cpu", blocks=list(model))
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().square().sum()
                if inside:
                    loss.backward()
            if not inside:
                loss.backward()
        finally:
            if wrap:
                ooc.unwrap(model)
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert caches and all(c.left_out for c in caches)


def test_two_forwards_in_one_autocast_say_why_the_plan_does_not_fit() -> None:
    """Gradient accumulation inside one ``torch.autocast``: the second forward finds the weights' casts
    of the first in autocast's cache and runs fewer ops than a step's (what the plan's op indices
    count), so its plan cannot fit; the warning says so and what to do, not only to re-profile, and
    the block re-runs whole: the accumulated gradients are plain PyTorch's."""
    torch.manual_seed(0)
    model = nn.Sequential(_TiedSoftmax(), nn.Linear(6, 6))
    plain = copy.deepcopy(model)
    x = torch.randn(3, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prof = ooc.profile(model, x, blocks=list(model), ops=True, codec_errors=False, reps=1)
    last = len(prof.blocks[0].ops) - 1
    ooc.wrap(model, ooc.Plan.of([ooc.BlockPlan("recompute", cached_ops=(last,)), "keep"]), backend="cpu", blocks=list(model))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().sum().backward()  # the first forward fits
            with pytest.warns(ooc.recompute.PlanMismatchWarning, match="autocast"):
                model(x).float().sum().backward()
    finally:
        ooc.unwrap(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain(x).float().sum().backward()
        plain(x).float().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
