"""Selective recompute (issue 15) under what users do around a training step: validation forwards,
eval mode, the caller's own in-place ops, batches unlike the profiled one, models that skip layers
at random (LayerDrop). Gradients equal plain PyTorch bit for bit (a forward the
plan does not fit re-runs whole, with a :class:`~ooc.recompute.PlanMismatchWarning` saying why), or a
:class:`~ooc.recompute.RecomputeError` says why not; a forward that is never differentiated runs as
plain PyTorch runs it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ooc
from ooc.backend.cpu import CpuBackend
from ooc.backend.order import StreamOrderError
from ooc.models import GPT
from ooc.recompute import PlanMismatchWarning, RecomputeError
from tests.helpers import NANO, gpt_batch, gpt_loss, train_side_by_side


def _last_cacheable_plan(prof) -> ooc.Plan:  # noqa: ANN001
    """Every block recomputed, caching its last cacheable op: past the dropouts, which a forward in
    eval mode does not run (it runs fewer ops than the training step the profile measured)."""
    return ooc.Plan(blocks=tuple(
        ooc.BlockPlan("recompute", cached_ops=(max(k for k, op in enumerate(b.ops) if op.cacheable),)) for b in prof.blocks),
        min_swap_bytes=prof.min_swap_bytes)


def test_a_validation_forward_in_eval_mode_with_grad_enabled_runs(gpt_profile) -> None:
    """``model.eval()`` then ``model(x)`` without ``torch.no_grad()`` (a validation loss): the forward runs
    other ops than the plan's cached_ops index, but its graph is never differentiated, so it runs as
    plain PyTorch does (it raised RecomputeError); the training step after it equals plain PyTorch."""
    plan = _last_cacheable_plan(gpt_profile)
    results = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = GPT(NANO)
        if wrap:
            ooc.wrap(model, plan, backend="cpu")
        try:
            model.eval()
            validation = gpt_loss(model, gpt_batch(seed=1)).detach()
            model.train()
            torch.manual_seed(1)
            loss = gpt_loss(model, gpt_batch())
            loss.backward()
        finally:
            if wrap:
                ooc.unwrap(model)
        results.append((validation, loss.detach(), [p.grad for p in model.parameters()]))
    (v1, l1, g1), (v2, l2, g2) = results
    assert torch.equal(v1, v2) and torch.equal(l1, l2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_a_backward_through_an_eval_mode_forward_the_plan_does_not_fit_says_why(gpt_profile) -> None:
    """The same forward differentiated: the re-run cannot take the plan's outputs, so it warns, naming
    eval mode, and re-runs each block whole; the gradients are plain PyTorch's in eval mode (it
    raised RecomputeError)."""
    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = GPT(NANO)
        if wrap:
            ooc.wrap(model, _last_cacheable_plan(gpt_profile), backend="cpu")
        try:
            model.eval()
            loss = gpt_loss(model, gpt_batch())
            if wrap:
                with pytest.warns(PlanMismatchWarning, match=r"block blocks\.3: its plan caches op \d+ but its forward ran "
                                                              r"\d+ ops.*eval mode.*re-ran the block whole"):
                    loss.backward()
            else:
                loss.backward()
        finally:
            if wrap:
                ooc.unwrap(model)
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))  # its last op, the add, makes what it returns


class _ShiftedChain(nn.Module):
    """``x = block(x); x += 1``: the caller shifts each block's output in place, which plain PyTorch
    allows (no node saved it yet: the next block saves it shifted)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Mlp(), _Mlp(), _Mlp()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            x += 1
        return x.square().mean()


def test_the_caller_changing_a_cached_output_the_rerun_never_reads() -> None:
    """Every block caches its add (the output it returns), which the caller then shifts in place. The
    re-run stops at the last tensor the block saves, before the add: it never reads the cache's
    changed bytes, so the step runs and equals plain PyTorch (it raised RecomputeError before the
    re-run began)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    prof = ooc.profile(_ShiftedChain(), x, ops=True, codec_errors=False, reps=1)
    adds = [[k for k, op in enumerate(b.ops) if op.name == "aten.add.Tensor"] for b in prof.blocks]
    assert all(len(a) == 1 and b.ops[a[0]].returned and b.ops[a[0]].cacheable for a, b in zip(adds, prof.blocks))
    plan = ooc.Plan(blocks=tuple(ooc.BlockPlan("recompute", cached_ops=tuple(a)) for a in adds))
    results = train_side_by_side(_ShiftedChain, lambda m, b: m(b), [x, x.flip(0)], lambda m: ooc.wrap(m, plan, backend="cpu"))
    assert results == [(True, True, True)] * 2



def _llama_padded_profile_and_batches() -> tuple[object, ooc.Plan, dict, dict]:
    """HF Llama with sdpa attention, profiled on a batch with padding (its mask sends attention down
    the math path, op by op) and a plan caching each block's last cacheable op; a batch like it and
    one without padding (the fused kernel: 11 ops fewer per block)."""
    pytest.importorskip("transformers")
    from tests.helpers import tiny_llama

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (2, 12), generator=g)
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    torch.manual_seed(0)
    prof = ooc.profile(tiny_llama("sdpa"), {"input_ids": ids, "attention_mask": padded, "labels": ids}, ops=True,
                       codec_errors=False, reps=1)
    return (lambda: tiny_llama("sdpa")), _last_cacheable_plan(prof), \
        {"input_ids": ids, "attention_mask": padded, "labels": ids}, \
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def test_hf_llama_sdpa_trains_on_a_batch_without_padding_after_a_profile_with_it() -> None:
    """cached_ops index the profiled forward's ops; a batch whose forward runs other ops (HF sdpa
    attention: with padding the math path, without it one fused kernel) cannot take the plan. Its
    backward raised RecomputeError; now each such block re-runs whole (plain recompute), warning."""
    make, plan, padded, full = _llama_padded_profile_and_batches()
    results = train_side_by_side(make, lambda m, b: m(**b).loss, [padded, full], lambda m: ooc.wrap(m, plan, backend="cpu"))
    assert results == [(True, True, True)] * 2


def test_a_batch_that_runs_other_ops_than_the_profiled_one_says_so() -> None:
    """The warning names the likely cause (it told to leave the op out of cached_ops, or to make the
    plan from this model's op-level profile, which it was)."""
    make, plan, _, full = _llama_padded_profile_and_batches()
    torch.manual_seed(0)
    model = make()
    ooc.wrap(model, plan, backend="cpu")
    try:
        loss = model(**full).loss
        with pytest.warns(PlanMismatchWarning, match=r"ran other ops than the profiled one \(Hugging Face sdpa attention "
                                                      r"runs one fused kernel for a batch without padding"):
            loss.backward()
    finally:
        ooc.unwrap(model)


def _bart(layerdrop: float):  # noqa: ANN202
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(
        vocab_size=97, d_model=32, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.1, use_cache=False,
        attn_implementation="eager", encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop)
    return transformers.BartForConditionalGeneration(config).train()


def test_a_model_with_layerdrop_trains_when_its_first_step_skips_a_layer() -> None:
    """LayerDrop (HF ``layerdrop``, ``encoder_layerdrop``, ``decoder_layerdrop``; Wav2Vec2 and HuBERT
    default to 0.1) skips layers at random in training. A first training forward that skipped one
    made the first-forward check unwrap the model ("blocks [...] of the chain never ran ... Pass
    blocks=[...]", which no blocks= fixes); skips in later steps trained and equalled plain PyTorch
    already. With a plan given, the first step is taken as it comes too, selective plans included."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 97, (2, 12), generator=g)
    torch.manual_seed(0)
    prof = ooc.profile(_bart(0.0), {"input_ids": ids, "labels": ids}, ops=True, codec_errors=False, reps=1)
    plan = _last_cacheable_plan(prof)
    # train_side_by_side seeds each step with its index: LayerDrop skips layers in step 0.
    results = train_side_by_side(lambda: _bart(0.5), lambda m, b: m(input_ids=b, labels=b).loss, [ids] * 3,
                                 lambda m: ooc.wrap(m, plan, backend="cpu"))
    assert results == [(True, True, True)] * 3


def test_a_first_step_that_layerdrop_skipped_says_so_when_ooc_plans_from_it() -> None:
    """Without a plan ooc measures the first step to plan from it, and every block must run in it: the
    error names LayerDrop (it told to pass blocks=[...])."""
    torch.manual_seed(0)
    model = _bart(0.5)
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    ooc.wrap(model, budget="1MiB", backend="cpu")
    with pytest.raises(ooc.BlockError, match=r"config has encoder_layerdrop=0\.5: LayerDrop skips layers at random"):
        model(input_ids=ids, labels=ids)
    assert not ooc.is_wrapped(model)


@pytest.mark.parametrize("held", ["output", "detached", "view"])
def test_an_activation_a_forward_hook_kept_and_the_caller_changed_is_refused(held: str, gpt_profile) -> None:
    """A forward hook keeps each block's qkv projection (the output itself, a ``detach()`` or a view of
    it), which the caller changes in place after the forward. Plain PyTorch saved no qkv, so its
    gradients are the forward's values'; the plan caches the qkv ``addmm``, whose re-run took the
    changed bytes from the cache: silently wrong gradients. The re-run refuses them, as it does a
    changed block output."""
    addmm = [next(k for k, op in enumerate(b.ops) if op.name == "aten.addmm.default") for b in gpt_profile.blocks]
    assert all(not gpt_profile.blocks[i].ops[k].saved_bytes for i, k in enumerate(addmm))
    plan = ooc.Plan(blocks=tuple(ooc.BlockPlan("recompute", cached_ops=(k,)) for k in addmm), min_swap_bytes=1024)
    kept: list[torch.Tensor] = []
    keep = {"output": lambda o: o, "detached": lambda o: o.detach(), "view": lambda o: o[..., :4]}[held]
    torch.manual_seed(0)
    model = GPT(NANO)
    for block in model.blocks:
        block.attn.qkv.register_forward_hook(lambda _m, _args, out: kept.append(keep(out)))
    ooc.wrap(model, plan, backend="cpu")
    try:
        loss = gpt_loss(model, gpt_batch())
        with torch.no_grad():
            kept[-1].mul_(0.5)
        with pytest.raises(RecomputeError, match=rf"block blocks\.3: the output of op {addmm[3]} \(aten\.addmm\.default\), "
                                                 "which its plan caches, is modified in place after the forward"):
            loss.backward()
    finally:
        ooc.unwrap(model)


def _swapped_qkv_run(gpt_profile, change: Callable[[GPT, list[torch.Tensor]], None],  # noqa: ANN001
                     backend: str | CpuBackend = "cpu") -> list[list[torch.Tensor]]:
    """Plain PyTorch, then the plan that caches and swaps each block's qkv ``addmm`` (on ``backend``), on
    the nano GPT whose qkv outputs a forward hook keeps; ``change(model, kept)`` (after building the
    model) changes them in place somewhere. Returns each run's gradients."""
    addmm = [next(k for k, op in enumerate(b.ops) if op.name == "aten.addmm.default") for b in gpt_profile.blocks]
    plan = ooc.Plan(blocks=tuple(ooc.BlockPlan("recompute", cached_ops=(k,), swapped_ops=(k,)) for k in addmm),
                    min_swap_bytes=1024)
    grads = []
    for wrap in (False, True):
        kept: list[torch.Tensor] = []
        torch.manual_seed(0)
        model = GPT(NANO)
        for block in model.blocks:
            block.attn.qkv.register_forward_hook(lambda _m, _args, out, kept=kept: kept.append(out))
        change(model, kept)
        if wrap:
            ooc.wrap(model, plan, backend=backend)
        try:
            torch.manual_seed(1)
            gpt_loss(model, gpt_batch()).backward()
        finally:
            if wrap:
                ooc.unwrap(model)
        grads.append([p.grad for p in model.parameters()])
    return grads


def test_a_swapped_activation_changed_while_its_copy_is_in_flight_is_refused(gpt_profile) -> None:
    """The plan swaps each block's qkv output; the caller changes block 0's in place during block 1's
    forward, before the schedule's RELEASE orders its copy to the host before compute. That change
    races the copy (the stream-order checker sees it), so the re-run could read either value: with the
    checker off, as a user runs, the re-run refuses (it was not watched at all)."""
    def during_the_next_block(model: GPT, kept: list[torch.Tensor]) -> None:
        def change(_m: nn.Module, _args: tuple) -> None:
            with torch.no_grad():
                kept[0].mul_(0.5)
        model.blocks[1].register_forward_pre_hook(change)

    checked, unchecked = CpuBackend(check_order=True), CpuBackend(check_order=False)
    try:
        with pytest.raises(StreamOrderError, match=r"D2H copy .* is not ordered before aten::mul_ \(write\)"):
            _swapped_qkv_run(gpt_profile, during_the_next_block, checked)
        with pytest.raises(RecomputeError, match=r"block blocks\.0: the output of op \d+ \(aten\.addmm\.default\), which its "
                                                 "plan caches, is modified in place after the forward while its copy to the "
                                                 "host was in flight"):
            _swapped_qkv_run(gpt_profile, during_the_next_block, unchecked)
    finally:
        checked.close()
        unchecked.close()


def test_a_swapped_activation_changed_after_its_copy_trains_as_plain_pytorch(gpt_profile) -> None:
    """The same change once the forward is over (block 0's copy is then ordered before compute): the
    host copy holds the forward's value, which is what plain PyTorch's gradients come from (it saved
    no qkv), so the step trains bit for bit as plain PyTorch, without an error."""
    def after_the_forward(model: GPT, kept: list[torch.Tensor]) -> None:
        def change(_m: nn.Module, _args: tuple, out: torch.Tensor) -> None:
            with torch.no_grad():
                kept[0].mul_(0.5)
        model.register_forward_hook(change)

    plain, wrapped = _swapped_qkv_run(gpt_profile, after_the_forward)
    assert all(torch.equal(a, b) for a, b in zip(plain, wrapped, strict=True))


class _TwoDropouts(nn.Module):
    """In training: t, addmm, dropout (4 ops), tanh, mul, t, addmm, dropout (4 ops), add; in eval mode the
    dropouts run nothing, so the add it returns is op 6, where the training forward ran its tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.fc1(x))
        return x + self.drop(self.fc2(torch.tanh(h) * h))


class _ChainOf(nn.Module):
    """Three blocks made by ``block`` and a scalar loss."""

    def __init__(self, block: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _DropoutChain() -> _ChainOf:  # noqa: N802 - used as a model class
    return _ChainOf(_TwoDropouts)


@pytest.mark.parametrize("differentiated", [False, True], ids=["validation", "backward"])
def test_an_eval_forward_whose_output_is_a_swapped_op_of_the_training_forward(differentiated: bool) -> None:
    """The plan swaps each block's tanh (op 6: cacheable, not returned in the profiled training step).
    In eval mode the block returns its add at op 6, a swapped output the block returns. The validation
    forward raised RecomputeError ("its plan swaps the output of op 6 ..., which the block returns");
    it is a forward the plan does not fit: it runs, and a backward through it re-runs each block whole,
    warning, with plain PyTorch's gradients. The training step after it equals plain PyTorch too."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    prof = ooc.profile(_DropoutChain(), x, ops=True, codec_errors=False, reps=1, min_swap_bytes=64)
    tanh = prof.blocks[0].ops[6]
    assert (tanh.name, tanh.cacheable, tanh.returned, tanh.output_bytes > 0) == ("aten.tanh.default", True, False, True)
    plan = ooc.Plan(blocks=(ooc.BlockPlan("recompute", cached_ops=(6,), swapped_ops=(6,)),) * 3, min_swap_bytes=64)
    results = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = _DropoutChain()
        if wrap:
            ooc.wrap(model, plan, backend="cpu")
        try:
            model.eval()
            validation = model(x.flip(0))
            if differentiated:
                with pytest.warns(PlanMismatchWarning, match=r"its plan swaps the output of op 6 \(aten\.add\.Tensor\), "
                                                              r"which the block returns.*eval mode.*re-ran the block whole") \
                        if wrap else contextlib.nullcontext():
                    validation.backward()
            validation = validation.detach()
            model.train()
            torch.manual_seed(1)
            loss = model(x)
            loss.backward()
            if wrap:
                assert ooc.memory_report(model).current_bytes == 0
        finally:
            if wrap:
                ooc.unwrap(model)
        results.append((validation, loss.detach(), [p.grad for p in model.parameters()]))
    (v1, l1, g1), (v2, l2, g2) = results
    assert torch.equal(v1, v2) and torch.equal(l1, l2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


class _Centred(nn.Module):
    """Centres its hidden state over the batch when there is more than one row: a batch of 4 runs mm,
    mean, sub, tanh, mul, mm, add; a batch of one (an epoch's last) runs no mean or sub, so the add it
    returns is op 4, the training profile's mul."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(8, 16) / 3), nn.Parameter(torch.randn(16, 8) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w1
        if x.shape[0] > 1:
            h = h - h.mean(0)
        return x + (torch.tanh(h) * h) @ self.w2


def _CentredChain() -> _ChainOf:  # noqa: N802 - used as a model class
    return _ChainOf(_Centred)


def test_a_training_forward_whose_output_is_a_swapped_op_of_the_profiled_one() -> None:
    """A training forward that runs other ops than the profiled one (a batch of one row) returns the
    output of an op the plan swaps. The plan carries the profiled ops' signature, so that is told from
    a plan that swaps a returned output (an error): the block re-runs whole, as in eval mode, and
    trains as plain PyTorch (it raised RecomputeError)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g)
    torch.manual_seed(0)
    prof = ooc.profile(_CentredChain(), x, ops=True, codec_errors=False, reps=1, min_swap_bytes=64)
    mul = prof.blocks[0].ops[4]
    assert (mul.name, mul.cacheable, mul.returned, mul.output_bytes > 0) == ("aten.mul.Tensor", True, False, True)
    signature = prof.blocks[0].op_signature
    plan = ooc.Plan(blocks=(ooc.BlockPlan("recompute", cached_ops=(4,), swapped_ops=(4,), op_signature=signature),) * 3,
                    min_swap_bytes=64)
    with pytest.warns(PlanMismatchWarning, match=r"its plan swaps the output of op 4 \(aten\.add\.Tensor\).*this forward "
                                                 "ran other ops than the profiled one"):
        results = train_side_by_side(_CentredChain, lambda m, b: m(b), [x, x[:1]],
                                     lambda m: ooc.wrap(m, plan, backend="cpu"))
    assert results == [(True, True, True)] * 2


def test_a_plan_that_swaps_a_returned_output_of_the_profiled_forward_is_refused() -> None:
    """The same plan on the profiled batch: the forward ran the profiled ops (same signature) and
    returns op 6, which the plan swaps: a plan error, raised, not a re-run."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    prof = ooc.profile(_CentredChain(), x, ops=True, codec_errors=False, reps=1, min_swap_bytes=64)
    ops = prof.blocks[0].ops
    assert ops[-1].returned and ops[-1].cacheable
    last = len(ops) - 1
    plan = ooc.Plan(blocks=(ooc.BlockPlan("recompute", cached_ops=(last,), swapped_ops=(last,),
                                          op_signature=prof.blocks[0].op_signature),) * 3, min_swap_bytes=64)
    model = _CentredChain()
    ooc.wrap(model, plan, backend="cpu")
    try:
        with pytest.raises(RecomputeError, match=rf"its plan swaps the output of op {last} \(aten\.add\.Tensor\), which the "
                                                 "block returns"):
            model(x)
    finally:
        ooc.unwrap(model)
