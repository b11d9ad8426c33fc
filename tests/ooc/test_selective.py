"""Selective recompute (issue 15, the runtime side): the op-level profile, the forward that caches
op outputs and the re-run that takes them from the cache. Gradients equal plain PyTorch bit for bit;
the tracker counts the cache as the planner models it (NOTE [selective recompute] in ooc.op_profile)."""

from __future__ import annotations

import contextlib
import copy
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ooc
from ooc.models import GPT
from ooc.recompute import PlanMismatchWarning, RecomputeError
from ooc.scheduler.planners import annotate
from tests.helpers import (
    NANO,
    ce_loss,
    check_selective_step_memory,
    gpt_batch,
    gpt_loss,
    image_batch,
    random_selective_plan,
    small_resnet,
    stable_seed,
    tiny_llama_op_profile,
    train_side_by_side,
)


def _saved_outside_ops(model: nn.Module, blocks: list[nn.Module], call) -> list[int]:  # noqa: ANN001
    """Per block, bytes of the storages its forward saves that no op of the block made (its inputs),
    found without ooc: plain PyTorch with a pack hook that records every saved storage."""
    result = [0] * len(blocks)
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    originals = [b.forward for b in blocks]

    def measured(i: int):  # noqa: ANN202
        def forward(*args):  # noqa: ANN002, ANN202
            inputs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in args if isinstance(t, torch.Tensor)}
            seen: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                ptr = t.untyped_storage().data_ptr()
                if ptr in inputs and ptr not in state:
                    seen[ptr] = inputs[ptr]
                return t.detach()

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = originals[i](*args)
            result[i] = sum(seen.values())
            return out

        return forward

    try:
        for i, b in enumerate(blocks):
            b.forward = measured(i)
        call()
    finally:
        for b in blocks:
            del b.forward
    return result


# -- the op-level profile -------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["gpt", "cnn"])
def test_every_saved_byte_is_an_op_output_or_an_input(which: str, gpt_profile, cnn_profile) -> None:
    torch.manual_seed(0)
    if which == "gpt":
        model, prof, batch = GPT(NANO), gpt_profile, gpt_batch()
        blocks, call = list(model.blocks), lambda: model(*batch)
    else:
        model, prof, (x, _) = small_resnet(), cnn_profile, image_batch()
        blocks, call = list(model.blocks), lambda: model(x)
    inputs = _saved_outside_ops(model, blocks, call)
    for block, outside in zip(prof.blocks, inputs):
        assert block.ops, block.name
        assert sum(op.saved_bytes for op in block.ops) == block.saved_bytes - outside, block.name
        assert outside > 0  # the check above must tell the two apart: each block saves its input


def test_the_op_sequence_is_the_same_in_every_profile(gpt_profile) -> None:
    torch.manual_seed(0)
    again = ooc.profile(GPT(NANO), gpt_batch(), ops=True, codec_errors=False, reps=1, min_swap_bytes=1024)
    for a, b in zip(gpt_profile.blocks, again.blocks):
        assert [(o.name, o.output_bytes, o.saved_bytes, o.cacheable) for o in a.ops] == \
               [(o.name, o.output_bytes, o.saved_bytes, o.cacheable) for o in b.ops]
    plain = ooc.profile(GPT(NANO), gpt_batch(), codec_errors=False, reps=1, min_swap_bytes=1024)
    assert all(b.ops == () for b in plain.blocks)  # opt-in


def test_a_planned_selective_block_carries_the_signature_of_the_ops_its_forward_runs(gpt_profile, caches) -> None:  # noqa: ANN001
    """A planner's plan says which forward its op indices refer to (``op_signature``, from the
    profile's op names, filled by ``annotate`` as ``plan_for_profile`` does for every planner; which
    blocks a planner caches depends on the measured times, so the blocks are chosen here); the
    runtime's forward on a batch like the profiled one runs exactly those ops."""
    cacheable = [max(k for k, op in enumerate(b.ops) if op.cacheable and not op.returned) for b in gpt_profile.blocks]
    chosen = ooc.Plan(blocks=(ooc.BlockPlan("recompute", cached_ops=(cacheable[0],)), ooc.BlockPlan("keep"),
                              ooc.BlockPlan("recompute", cached_ops=(cacheable[2],)), ooc.BlockPlan("swap")),
                      min_swap_bytes=gpt_profile.min_swap_bytes)
    plan = annotate(chosen, gpt_profile)
    assert [b.op_signature for b in plan.blocks] == [gpt_profile.blocks[0].op_signature, None,
                                                     gpt_profile.blocks[2].op_signature, None]
    assert plan.blocks[0].op_signature is not None
    torch.manual_seed(0)
    model = GPT(NANO)
    ooc.wrap(model, plan, backend="cpu")
    try:
        gpt_loss(model, gpt_batch()).backward()
    finally:
        ooc.unwrap(model)
    assert [c.signature for c in caches] == [plan.blocks[0].op_signature, plan.blocks[2].op_signature]
    assert not any(c._ran_other_ops() or c.refused for c in caches)


def test_what_is_cacheable(gpt_profile) -> None:
    ops = gpt_profile.blocks[1].ops
    by_name: dict[str, set[bool]] = {}
    for op in ops:
        by_name.setdefault(op.name, set()).add(op.cacheable)
    assert by_name["aten.addmm.default"] == {True} and by_name["aten.bmm.default"] == {True}
    assert by_name["aten.bernoulli_.float"] == {False}  # random and in place
    assert by_name["aten.view.default"] == {False} and by_name["aten.transpose.int"] == {False}  # views
    assert by_name["aten.empty_like.default"] == {False}  # dropout's mask: filled in place afterwards
    assert all(op.output_bytes == 0 for op in ops if op.name in ("aten.view.default", "aten.div_.Scalar"))


def test_attention_without_dropout_is_cacheable_and_draws_nothing() -> None:
    from ooc.op_profile import OpRecorder, why_not_cacheable

    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    before = torch.get_rng_state()
    recorder = OpRecorder(q.device)
    with recorder:
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.equal(before, torch.get_rng_state())
    fused = [k for k, name in enumerate(recorder.names) if "scaled_dot_product" in name]
    assert fused and all(recorder.why_not[k] is None for k in fused), recorder.names
    # The same op asked for dropout draws numbers (tagged nondeterministic_seeded): never cached.
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert "random" in why_not_cacheable(op, (q, q, q, 0.5, True), {}, (out, out))
    assert why_not_cacheable(op, (q, q, q), {"dropout_p": 0.0}, (out, out)) is None
    assert "random" in why_not_cacheable(op, (q, q, q), {"dropout_p": 0.1}, (out, out))


# -- execution: gradients -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_gpt_with_dropout_random_cached_subsets_equal_plain(seed: int, gpt_profile) -> None:
    rng = random.Random(stable_seed("gpt", seed))
    plan = random_selective_plan(gpt_profile, rng, "CCcRK")
    batches = [gpt_batch(seed=s) for s in range(2)]
    results = train_side_by_side(lambda: GPT(NANO), gpt_loss, batches,
                                 lambda m: ooc.wrap(m, plan, backend="chaos", check_recompute=seed % 2 == 0))
    assert results == [(True, True, True)] * 2, plan


@pytest.mark.parametrize("seed", range(4))
def test_cnn_with_batchnorm_random_cached_subsets_equal_plain(seed: int, cnn_profile) -> None:
    rng = random.Random(stable_seed("cnn", seed))
    plan = random_selective_plan(cnn_profile, rng, "CCcS")
    x, y = image_batch()
    results = train_side_by_side(small_resnet, ce_loss, [(x, y), (x.flip(0), y)], lambda m: ooc.wrap(m, plan, backend="chaos"))
    assert results == [(True, True, True)] * 2, plan


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_llama_random_cached_subsets_equal_plain(attn: str) -> None:
    pytest.importorskip("transformers")
    make, x, prof = tiny_llama_op_profile(attn)
    sdpa = [op for b in prof.blocks for op in b.ops if "scaled_dot_product" in op.name]
    assert (attn == "sdpa") == bool(sdpa) and all(op.cacheable for op in sdpa)
    for seed in range(3):
        plan = random_selective_plan(prof, random.Random(stable_seed("llama", attn, seed)), "CCR")
        results = train_side_by_side(make, lambda m, b: m(input_ids=b, labels=b).loss, [x, x.flip(1)],
                                     lambda m, plan=plan: ooc.wrap(m, plan, backend="cpu"))
        assert results == [(True, True, True)] * 2, plan


# -- execution: memory ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_tracker_counts_the_cache_as_the_planner_models_it(seed: int, gpt_profile) -> None:
    torch.manual_seed(0)
    model = GPT(NANO)
    plan = random_selective_plan(gpt_profile, random.Random(stable_seed("memory", seed)), "CCRK")
    log: list = []
    report = check_selective_step_memory(model, gpt_profile, plan, gpt_batch(), "cpu", log)
    for b, (block, decision) in enumerate(zip(gpt_profile.blocks, plan.blocks)):
        cached = sum(e[2] for e in log if e[0] == "cache" and e[1] == b)
        assert cached == sum(block.ops[k].output_bytes for k in decision.cached_ops), b
        if decision.policy is ooc.Policy.RECOMPUTE:  # input + cache + the re-run's saves, less the cached ones
            resaved_cache = sum(block.ops[k].saved_bytes for k in decision.cached_ops)
            assert report.block_peak_bytes[b] == block.input_bytes + cached + block.saved_bytes - resaved_cache, b


# -- execution: the cache is used, and what cannot be cached is refused ----------------------------


class _Count(TorchDispatchMode):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.calls = name, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.calls += str(func) == self.name
        return func(*args, **(kwargs or {}))


def test_the_rerun_skips_the_cached_ops(gpt_profile) -> None:
    """The backward alone dispatches no ``addmm`` (its matmuls are ``mm``): each one seen there is a
    re-run's. With every ``addmm`` cached, the re-runs dispatch none."""
    addmm = [tuple(k for k, op in enumerate(b.ops) if op.name == "aten.addmm.default") for b in gpt_profile.blocks]
    assert all(len(ks) == 4 for ks in addmm)
    seen = []
    for cached in ((), ()), (addmm, addmm):
        torch.manual_seed(0)
        model = GPT(NANO)
        plan = ooc.Plan(blocks=tuple(ooc.BlockPlan("recompute", cached_ops=c) for c in cached[1]), min_swap_bytes=1024) \
            if cached[1] else ooc.Plan.uniform("recompute", len(addmm), min_swap_bytes=1024)
        ooc.wrap(model, plan, backend="cpu", blocks=model.blocks)
        loss = gpt_loss(model, gpt_batch())
        with _Count("aten.addmm.default") as count:
            loss.backward()
        ooc.unwrap(model)
        seen.append(count.calls)
    assert seen == [4 * len(addmm), 0]


def test_the_reruns_pack_hook_detaches_past_its_paused_mode(gpt_profile, monkeypatch) -> None:  # noqa: ANN001
    """The re-run's pack hook detaches each saved tensor that requires grad. Under the selective re-run
    alone that detach goes to its kernel past the paused Replay (each pass through a dispatch mode is
    microseconds of host time); under another mode it goes through both, as before, so that mode sees
    every one."""
    import ooc.recompute
    from ooc.op_profile import Replay

    plan = ooc.Plan(blocks=tuple(ooc.BlockPlan("recompute", cached_ops=(next(k for k, op in enumerate(b.ops)
                                                                             if op.name == "aten.addmm.default"),))
                                 for b in gpt_profile.blocks), min_swap_bytes=1024)
    dispatch, paused = Replay.__torch_dispatch__, [0]

    def counted(self: Replay, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
        paused[0] += bool(self._paused) and func is torch.ops.aten.detach.default
        return dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(Replay, "__torch_dispatch__", counted)

    def backward(outer: bool) -> tuple[int, int]:
        """(detaches the paused Replay passed on, detaches a mode around the backward saw)."""
        torch.manual_seed(0)
        model = GPT(NANO)
        ooc.wrap(model, plan, backend="cpu")
        loss = gpt_loss(model, gpt_batch())
        paused[0] = 0
        with _Count("aten.detach.default") if outer else contextlib.nullcontext() as count:
            loss.backward()
        ooc.unwrap(model)
        return paused[0], count.calls if outer else 0

    assert backward(outer=False) == (0, 0)
    passed_on, seen = backward(outer=True)
    assert passed_on > 0
    monkeypatch.setattr(ooc.recompute, "_detach", lambda tensor, replay: tensor.detach())
    assert backward(outer=True) == (passed_on, seen)


class _Flip(nn.Module):
    """exp in its first call, sin afterwards: a forward that is not deterministic."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        # In a list: a re-run puts the module's own attributes back as it found them (NOTE [attributes a
        # forward sets] in ooc.recompute), a count kept as an int among them too.
        self.calls = [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[0] += 1
        h = self.lin(x)
        return (h.exp() if self.calls[0] == 1 else h.sin()) * h


class _Pair(nn.Module):
    def __init__(self, first: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([first, nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x))


def _ops_of(module: nn.Module, x: torch.Tensor) -> list[str]:
    from ooc.op_profile import OpRecorder

    recorder = OpRecorder(x.device)

    def pack(t: torch.Tensor) -> torch.Tensor:
        with recorder.paused():  # the hook's own detach is not the block's (NOTE [counting a block's ops])
            return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
        module(x)
    return recorder.names


def test_a_rerun_that_runs_another_op_names_the_block_and_the_op() -> None:
    torch.manual_seed(0)
    model = _Pair(_Flip())
    x = torch.randn(3, 4, requires_grad=True)
    names = _ops_of(_Flip(), x)
    mm, exp = names.index("aten.addmm.default"), names.index("aten.exp.default")
    plan = ooc.Plan.of([ooc.BlockPlan("recompute", cached_ops=(mm,)), "keep"])
    ooc.wrap(model, plan, backend="cpu", blocks=model.blocks)
    try:
        out = model(x).sum()
        with pytest.raises(RecomputeError, match=rf"block blocks\.0: op {exp} of its re-run is aten\.sin\.default "
                                                 r"but its forward ran aten\.exp\.default"):
            out.backward()
    finally:
        ooc.unwrap(model)


class _Residual(nn.Module):
    """``out = lin(x) * 2; out += x``: the product is modified in place after it is made."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) * 2
        out += x
        return torch.relu(out)


@pytest.mark.parametrize("which, message", [
    ("aten.t.default", "returns a view of its input"),
    ("aten.add_.Tensor", "modifies a tensor in place"),
    ("aten.mul.Tensor", r"is modified in place by op 3 \(aten\.add_\.Tensor\) later in its forward"),
    (99, "its plan caches op 99 but its forward ran 5 ops"),
], ids=["view", "in-place", "modified-later", "out-of-range"])
def test_an_op_that_cannot_be_cached_is_refused(which, message: str) -> None:  # noqa: ANN001
    """The forward caches nothing from the refused op on (NOTE [a forward the plan does not fit]);
    the backward warns why and re-runs the block whole: the gradients are plain PyTorch's."""
    torch.manual_seed(0)
    model = _Pair(_Residual())
    plain = copy.deepcopy(model)
    x = torch.randn(3, 4, requires_grad=True)
    names = _ops_of(model.blocks[0], x)
    assert len(names) == 5, names
    index = which if isinstance(which, int) else names.index(which)
    ooc.wrap(model, ooc.Plan.of([ooc.BlockPlan("recompute", cached_ops=(index,)), "keep"]), backend="cpu", blocks=model.blocks)
    try:
        with pytest.warns(PlanMismatchWarning, match=rf"block blocks\.0: .*{message}.*re-ran the block whole"):
            model(x).sum().backward()
    finally:
        ooc.unwrap(model)
    plain(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
    # The profile marks every one of them uncacheable.
    fresh = _Pair(_Residual())
    prof = ooc.profile(fresh, x, blocks=fresh.blocks, ops=True, codec_errors=False, reps=1)
    assert [op.cacheable for op in prof.blocks[0].ops] == [False, True, False, False, True]


class _SumScaled(nn.Module):
    """Returns ``h = lin(x)`` and ``h.sum(-1) * s``: the sum reads ``h`` without saving it and the
    product saves the sum, so the re-run reads the cached ``h`` to recompute what it saves."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.s = nn.Parameter(torch.linspace(1, 2, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, h.sum(-1, keepdim=True) * self.s


class _Combine(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, g = pair
        return h * 2 + g  # saves nothing: only the cache sees a change of h


def test_a_cached_output_modified_after_the_forward_is_refused() -> None:
    """The block's output is a cached op's (unsaved) output; the caller changes it in place before the
    backward, and the re-run reads it (plain PyTorch, which saved no ``h``, gives the gradients of the
    forward's values: a re-run from the changed ones would give others)."""
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList([_SumScaled(), _Combine()])
    x = torch.randn(3, 4, requires_grad=True)
    names = _ops_of(model.blocks[0], x)
    ooc.wrap(model, ooc.Plan.of([ooc.BlockPlan("recompute", cached_ops=(names.index("aten.addmm.default"),)), "keep"]),
             backend="cpu", blocks=model.blocks)
    try:
        h, g = model.blocks[0](x)
        out = model.blocks[1]((h, g)).sum()
        with torch.no_grad():
            h[0] += 1  # through a view
        with pytest.raises(RecomputeError, match=r"block blocks\.0: the output of op 1 \(aten\.addmm\.default\).*"
                                                 "is modified in place after the forward"):
            out.backward()
    finally:
        ooc.unwrap(model)


def test_a_retained_graph_reruns_from_the_same_cache(gpt_profile) -> None:
    """Two backwards through one graph: the second re-run takes the cached outputs again."""
    plan = random_selective_plan(gpt_profile, random.Random(stable_seed("retain")), "C")
    batch = gpt_batch()
    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = GPT(NANO)
        if wrap:
            ooc.wrap(model, plan, backend="cpu")
        torch.manual_seed(3)
        loss = gpt_loss(model, batch)
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if wrap:
            ooc.unwrap(model)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_measured_op_profile_round_trips_through_json(gpt_profile) -> None:
    from ooc.scheduler.profile import Profile

    assert Profile.from_json(gpt_profile.to_json()) == gpt_profile


class _Biased(nn.Module):
    """``lin(x) + torch.zeros(...)`` then ``* torch.arange(...)``: factories (ops that take tensor options)
    whose outputs a plan may cache, as T5's cross-attention caches its ``zeros`` position bias."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) + torch.zeros(x.shape[-1], dtype=x.dtype)
        return torch.tanh(h) * torch.arange(1, 5, dtype=x.dtype)


def test_a_cached_factory_output_reruns_as_its_forward() -> None:
    """torch's Python binding of a factory re-wraps its output; had the cache's alias shared the
    output's version counter, it would dispatch a ``detach`` the forward counts and the re-run does not
    (RecomputeError: op 3 of its re-run is ... but its forward ran aten.detach.default)."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    names = _ops_of(_Biased(), x)
    factories = [names.index("aten.zeros.default"), names.index("aten.arange.start")]
    plan = ooc.Plan.of([ooc.BlockPlan("recompute", cached_ops=tuple(factories)), "keep"])
    results = train_side_by_side(lambda: _Pair(_Biased()), lambda m, b: m(b).sum(), [x, x.flip(0)],
                                 lambda m: ooc.wrap(m, plan, backend="cpu", blocks=m.blocks))
    assert results == [(True, True, True)] * 2
