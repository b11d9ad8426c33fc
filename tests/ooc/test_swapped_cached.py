"""Swapped cached outputs (issue 15, per-tensor swap inside a block): a selective RECOMPUTE's
``swapped_ops`` go to the host after the block's forward and come back before its re-run, through
the swap engine (NOTE [swapped cached ops] in ooc.scheduler.schedule). Gradients equal plain
PyTorch bit for bit, on the CPU backend and on the chaos backend (copies run late, in any order the
events allow); the measured peak equals the schedule's; a returned output cannot be swapped."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import random
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves

import ooc
import ooc.backend
from ooc.models import GPT
from ooc.models.gpt import GPTConfig
from ooc.op_profile import OpRecorder
from ooc.recompute import PlanMismatchWarning, RecomputeError
from ooc.runtime import runtime_of
from ooc.scheduler import build_schedule
from tests.helpers import (
    NANO,
    ce_loss,
    gpt_batch,
    gpt_loss,
    image_batch,
    image_op_profile,
    small_resnet,
    stable_seed,
    tiny_llama_op_profile,
    train_side_by_side,
)


class _VitBlock(nn.Module):
    """Pre-norm encoder block: attention through SDPA (with dropout), an MLP, dropout on both residuals."""

    def __init__(self, dim: int = 32, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, t, c)), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)


class _Vit(nn.Module):
    """A small ViT: 4x4 patches of a 16x16 image, a class token, three encoder blocks."""

    def __init__(self, dim: int = 32, depth: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.blocks = nn.ModuleList([_VitBlock(dim) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


@pytest.fixture(scope="module")
def vit_profile():
    return image_op_profile(_Vit())


def _returned_ops(make, call, blocks=lambda m: m.blocks) -> list[set[int]]:  # noqa: ANN001
    """Per block of ``make()``, the ops whose outputs the block returns (found without ooc: a dispatch
    mode that names the creator of each storage, NOTE [counting a block's ops])."""
    torch.manual_seed(0)
    model = make()
    result: list[set[int]] = []
    for block in blocks(model):
        original = block.forward

        def forward(*args, original=original, **kwargs):  # noqa: ANN002, ANN003, ANN202
            recorder = OpRecorder(torch.device("cpu"))

            def pack(t: torch.Tensor) -> torch.Tensor:
                with recorder.paused():
                    return t.detach()

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
                out = original(*args, **kwargs)
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            result.append({recorder._creator[p] for t in outs if (p := t.untyped_storage().data_ptr()) in recorder._creator})
            return out

        block.forward = forward
    call(model)
    return result


@pytest.fixture(scope="module")
def returned():
    return {
        "gpt": _returned_ops(lambda: GPT(NANO), lambda m: gpt_loss(m, gpt_batch())),
        "cnn": _returned_ops(small_resnet, lambda m: m(image_batch()[0])),
        "vit": _returned_ops(_Vit, lambda m: m(image_batch()[0])),
    }


def _marked(prof) -> list[set[int]]:  # noqa: ANN001
    """Per block, the ops the measured profile marks ``returned``."""
    return [{k for k, op in enumerate(b.ops) if op.returned} for b in prof.blocks]


def test_measured_profiles_mark_the_ops_whose_outputs_the_block_returns(gpt_profile, cnn_profile, vit_profile,
                                                                         returned) -> None:
    for name, prof in (("gpt", gpt_profile), ("cnn", cnn_profile), ("vit", vit_profile)):
        assert _marked(prof) == returned[name] and all(returned[name]), name


class _ViewEndBlock(_VitBlock):
    """A block that returns a view of its residual add: its last op is the view, the storage it
    returns is the add's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out.view(out.shape[0], -1, out.shape[-1])


def _view_end_vit() -> nn.Module:
    model = _Vit()
    model.blocks = nn.ModuleList([_ViewEndBlock() for _ in model.blocks])
    return model


def test_op_level_plans_from_a_measured_profile_never_swap_a_returned_output_and_equal_plain() -> None:
    """Blocks returning a view of an earlier op's output: the measured profile marks that op, the
    options the op-level planner is handed (a link fast enough to hide every cached output) swap
    cached outputs but never it, and plans of those options run bit-identically to plain PyTorch
    with their predicted peak."""
    from ooc.scheduler import preset
    from ooc.scheduler.costmodel import build_options

    x, y = image_batch()
    torch.manual_seed(0)
    prof = ooc.profile(_view_end_vit(), (x,), loss_fn=lambda out: F.cross_entropy(out, y), ops=True,
                       codec_errors=False, min_swap_bytes=1024)
    marked = _marked(prof)
    assert marked == _returned_ops(_view_end_vit, lambda m: m(x))
    assert all(len(p.ops) - 1 not in b and b for b, p in zip(marked, prof.blocks))  # the last op is the view
    link = dataclasses.replace(preset("h100-sxm"), h2d=1e15, d2h=1e15, h2d_duplex=1e15, d2h_duplex=1e15,
                               copy_latency_s=0.0, copy_issue_s=0.0)
    opts = build_options(prof, link, selective=4, selective_swaps=3)
    variants = [[c for k in range(opts.m) if opts.allows(i, k) and (c := opts.choice(i, k)).swapped_ops]
                for i in range(opts.n)]
    assert all(variants), variants
    assert all(not set(c.swapped_ops) & marked[i] for i, vs in enumerate(variants) for c in vs)
    plans = [ooc.Plan(tuple(vs[j % len(vs)] for vs in variants), prefetch=1, min_swap_bytes=1024)
             for j in range(max(map(len, variants)))]
    for plan in plans:
        results = train_side_by_side(_view_end_vit, ce_loss, [(x, y), (x.flip(0), y)],
                                     lambda m, p=plan: ooc.wrap(m, p, backend="chaos"))
        assert results == [(True, True, True)] * 2, plan
        report, _ = _measure(_view_end_vit, lambda m: F.cross_entropy(m(x), y), plan)
        assert report.peak_bytes == build_schedule(plan, prof).peak_bytes, plan


def _block(block, rng: random.Random, letter: str, returned: set[int]) -> ooc.BlockPlan:  # noqa: ANN001
    """``K`` keep, ``S`` swap, ``R`` recompute, ``r`` recompute with its input swapped, ``C`` selective
    recompute (a random subset of the cacheable ops), ``W`` selective with a random part of the
    cached ops swapped (never a returned one), ``w`` the same with its input swapped."""
    if letter in "CWw":
        cacheable = [k for k, op in enumerate(block.ops) if op.cacheable]
        cached = tuple(sorted(rng.sample(cacheable, rng.randint(1, len(cacheable)))))
        if letter == "C":
            return ooc.BlockPlan("recompute", cached_ops=cached)
        movable = [k for k in cached if k not in returned and block.ops[k].output_bytes]
        if not movable:  # only a returned op was drawn: cache one more that can move
            extra = rng.choice([k for k in cacheable if k not in returned and block.ops[k].output_bytes])
            cached, movable = tuple(sorted({*cached, extra})), [extra]
        swapped = tuple(sorted(rng.sample(movable, rng.randint(1, len(movable)))))
        return ooc.BlockPlan("recompute", cached_ops=cached, swapped_ops=swapped, swap_input=letter == "w")
    return {"R": ooc.BlockPlan("recompute"), "r": ooc.BlockPlan("recompute", swap_input=True),
            "K": ooc.BlockPlan("keep"), "S": ooc.BlockPlan("swap")}[letter]


def _random_plan(prof, returned: list[set[int]], rng: random.Random, letters: str, *, prefetch: int = 2) -> ooc.Plan:  # noqa: ANN001
    """A random plan over ``letters`` with at least one block that swaps cached outputs."""
    blocks: list[ooc.BlockPlan] = []
    while not any(b.swapped_ops for b in blocks):
        blocks = [_block(block, rng, rng.choice(letters), ret) for block, ret in zip(prof.blocks, returned)]
    return ooc.Plan(blocks=tuple(blocks), min_swap_bytes=prof.min_swap_bytes, prefetch=prefetch)


def _without_swapped(plan: ooc.Plan) -> ooc.Plan:
    from dataclasses import replace

    return replace(plan, blocks=tuple(replace(b, swapped_ops=()) for b in plan.blocks))


# -- gradients ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", "chaos"])
@pytest.mark.parametrize("seed", range(3))
def test_gpt_with_dropout_mixed_plans_equal_plain(seed: int, backend: str, gpt_profile, returned) -> None:
    plan = _random_plan(gpt_profile, returned["gpt"], random.Random(stable_seed("gpt", seed)), "KSRrCWWw")
    batches = [gpt_batch(seed=s) for s in range(2)]
    results = train_side_by_side(lambda: GPT(NANO), gpt_loss, batches,
                                 lambda m: ooc.wrap(m, plan, backend=backend, check_recompute=seed == 0))
    assert results == [(True, True, True)] * 2, plan


@pytest.mark.parametrize("backend", ["cpu", "chaos"])
@pytest.mark.parametrize("seed", range(2))
def test_cnn_with_batchnorm_mixed_plans_equal_plain(seed: int, backend: str, cnn_profile, returned) -> None:
    plan = _random_plan(cnn_profile, returned["cnn"], random.Random(stable_seed("cnn", seed)), "KSRCWw")
    x, y = image_batch()
    results = train_side_by_side(small_resnet, ce_loss, [(x, y), (x.flip(0), y)], lambda m: ooc.wrap(m, plan, backend=backend))
    assert results == [(True, True, True)] * 2, plan


@pytest.mark.parametrize("backend", ["cpu", "chaos"])
def test_vit_with_dropout_mixed_plans_equal_plain(backend: str, vit_profile, returned) -> None:
    # Attention's dropout (decomposed on the CPU) and the residual dropouts draw numbers: never cached.
    assert all(any("bernoulli" in op.name and not op.cacheable for op in b.ops) for b in vit_profile.blocks)
    x, y = image_batch()
    for seed in range(2):
        plan = _random_plan(vit_profile, returned["vit"], random.Random(stable_seed("vit", backend, seed)), "WwCS")
        results = train_side_by_side(_Vit, ce_loss, [(x, y), (x.flip(0), y)], lambda m, p=plan: ooc.wrap(m, p, backend=backend))
        assert results == [(True, True, True)] * 2, plan


def test_hf_vit_swapped_cached_outputs_equal_plain() -> None:
    transformers = pytest.importorskip("transformers")

    def make() -> nn.Module:
        config = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=3,
                                        num_attention_heads=4, intermediate_size=64, num_labels=10,
                                        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
        return transformers.ViTForImageClassification(config).train()

    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([1, 7])
    loss = lambda m, b: m(pixel_values=b[0], labels=b[1]).loss  # noqa: E731
    torch.manual_seed(0)
    prof = ooc.profile(make(), {"pixel_values": x, "labels": y}, ops=True, codec_errors=False, reps=1)
    returned = _returned_ops(make, lambda m: loss(m, (x, y)), lambda m: m.vit.layers)
    assert [b.name for b in prof.blocks] == [f"vit.layers.{k}" for k in range(3)] and all(returned)
    assert _marked(prof) == returned  # the profile names them itself (OpProfile.returned)
    for seed in range(2):
        plan = _random_plan(prof, returned, random.Random(stable_seed("hf-vit", seed)), "Ww")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = train_side_by_side(make, loss, [(x, y), (x.flip(0), y)],
                                         lambda m, p=plan: ooc.wrap(m, p, backend="chaos"))
        assert results == [(True, True, True)] * 2, plan


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_llama_swapped_cached_outputs_equal_plain(attn: str) -> None:
    """Decoder layers called with keyword arguments (rotary embeddings, masks), grouped-query attention."""
    pytest.importorskip("transformers")
    make, x, prof = tiny_llama_op_profile(attn)
    loss = lambda m, b: m(input_ids=b, labels=b).loss  # noqa: E731
    returned = _returned_ops(make, lambda m: loss(m, x), lambda m: m.model.layers)
    assert len(returned) == len(prof) and all(returned)
    plan = _random_plan(prof, returned, random.Random(stable_seed("llama", attn)), "WwC")
    results = train_side_by_side(make, loss, [x, x.flip(1)], lambda m: ooc.wrap(m, plan, backend="chaos"))
    assert results == [(True, True, True)] * 2, plan
    measured, _ = _measure(make, lambda m: loss(m, x), plan)
    assert measured.peak_bytes == build_schedule(plan, prof).peak_bytes, plan


@pytest.mark.parametrize("backend", ["cpu", "chaos"])
def test_a_retained_graph_reruns_from_the_swapped_cache(backend: str, gpt_profile, returned) -> None:
    """Two backwards through one graph: the second re-run takes the swapped-in outputs again."""
    plan = _random_plan(gpt_profile, returned["gpt"], random.Random(stable_seed("retain")), "W")
    batch = gpt_batch()
    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = GPT(NANO)
        if wrap:
            ooc.wrap(model, plan, backend=backend)
        torch.manual_seed(3)
        loss = gpt_loss(model, batch)
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in model.parameters()]
        loss.backward()
        grads.append(first + [p.grad.clone() for p in model.parameters()])
        if wrap:
            swapped_in = ooc.memory_report(model).swapped_in_bytes
            ooc.unwrap(model)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    moved = sum(b.ops[k].output_bytes for b, d in zip(gpt_profile.blocks, plan.blocks) for k in d.swapped_ops)
    assert swapped_in == moved  # brought back once: the second backward reads the same copies


def test_two_graphs_alive_at_once_keep_their_own_swapped_outputs(gpt_profile, returned) -> None:
    """Gradient accumulation over two forwards before one backward: each pass releases and brings
    back its own swapped outputs; the gradients equal plain PyTorch's and nothing stays counted."""
    plan = _random_plan(gpt_profile, returned["gpt"], random.Random(stable_seed("accumulate")), "WwK")
    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = GPT(NANO)
        if wrap:
            ooc.wrap(model, plan, backend="chaos")
        torch.manual_seed(5)
        losses = [gpt_loss(model, gpt_batch(seed=s)) for s in range(2)]
        (losses[0] + losses[1]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if wrap:
            assert ooc.memory_report(model).current_bytes == 0
            ooc.unwrap(model)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("backend", ["cpu", "chaos"])
@pytest.mark.parametrize("how", ["backward", "retain_graph", "grad_of_some"])
@pytest.mark.parametrize("model", ["gpt", "cnn"])
def test_a_forward_refused_after_swapping_cached_outputs_reruns_whole(model: str, how: str, backend: str, gpt_profile,
                                                                       cnn_profile, returned) -> None:
    """NOTE [a forward the plan does not fit]: in eval mode the forward stops matching its plan
    (GPT: at its first dropout; the CNN: BatchNorm runs other ops) after some outputs were cached and
    swapped out; the schedule still brings those back, and the re-run does not read them. The
    gradients are plain PyTorch's bit for bit (twice through a retained graph; ``autograd.grad`` of
    some parameters) and nothing stays counted."""
    prof, make, loss_fn, batch = (gpt_profile, lambda: GPT(NANO), gpt_loss, gpt_batch()) if model == "gpt" else \
        (cnn_profile, small_resnet, ce_loss, image_batch())
    plan = _random_plan(prof, returned[model], random.Random(stable_seed("refused", model)), "WC")
    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        net = make()
        if wrap:
            ooc.wrap(net, plan, backend=backend)
        net.eval()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loss = loss_fn(net, batch)
            if how == "grad_of_some":
                grads.append(list(torch.autograd.grad(loss, list(net.parameters())[::3])))
            else:
                loss.backward(retain_graph=how == "retain_graph")
                if how == "retain_graph":
                    loss.backward()
                grads.append([p.grad for p in net.parameters()])
        del loss
        if wrap:
            assert any(w.category is PlanMismatchWarning for w in seen)
            report = ooc.memory_report(net)
            assert report.current_bytes == 0 and report.swapped_in_bytes > 0  # cached and swapped before the refusal
            ooc.unwrap(net)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(*grads))


# -- memory ---------------------------------------------------------------------------------------


def _measure(make, call, plan: ooc.Plan, backend: str = "cpu") -> tuple[ooc.MemoryReport, list]:  # noqa: ANN001
    torch.manual_seed(0)
    model = make()
    ooc.wrap(model, plan, backend=backend)
    try:
        runtime_of(model).tracker.log = log = []
        call(model).backward()
        return ooc.memory_report(model), log
    finally:
        ooc.unwrap(model)


def _designed(prof, returned: list[set[int]]) -> list[ooc.Plan]:  # noqa: ANN001
    """Plans whose peak the swapped outputs lower: every movable cacheable op cached, and swapped."""
    def w(b: int, swap_input: bool = False) -> ooc.BlockPlan:
        block = prof.blocks[b]
        cached = tuple(k for k, op in enumerate(block.ops) if op.cacheable)
        swapped = tuple(k for k in cached if k not in returned[b] and block.ops[k].output_bytes)
        return ooc.BlockPlan("recompute", cached_ops=cached, swapped_ops=swapped, swap_input=swap_input)

    n = len(prof)
    return [
        ooc.Plan(blocks=(w(0),) + (ooc.BlockPlan("keep"),) * (n - 1), min_swap_bytes=prof.min_swap_bytes, prefetch=0),
        ooc.Plan(blocks=tuple(w(b) for b in range(n)), min_swap_bytes=prof.min_swap_bytes, prefetch=1),
        ooc.Plan(blocks=tuple(w(b, swap_input=b % 2 == 0) for b in range(n)), min_swap_bytes=prof.min_swap_bytes),
    ]


def test_measured_peak_equals_prediction_with_swapped_cached_outputs(gpt_profile, returned) -> None:
    """Three designed plans (the swapped outputs lower the predicted peak) and six random ones mixing
    every policy, at prefetch depths 0 to 2: measured == predicted, exactly."""
    rng = random.Random(stable_seed("peak"))
    plans = _designed(gpt_profile, returned["gpt"]) + [
        _random_plan(gpt_profile, returned["gpt"], rng, "KSRrCWWw", prefetch=k % 3) for k in range(6)]
    mismatches = []
    for k, plan in enumerate(plans):
        report, _ = _measure(lambda: GPT(NANO), lambda m: gpt_loss(m, gpt_batch()), plan)
        predicted = build_schedule(plan, gpt_profile).peak_bytes
        if report.peak_bytes != predicted or report.current_bytes != 0:
            mismatches.append((k, plan, predicted, report.peak_bytes, report.current_bytes))
        if k < 3:  # the designed ones: swapping the outputs lowers the predicted peak
            assert predicted < build_schedule(_without_swapped(plan), gpt_profile).peak_bytes, plan
    assert mismatches == []


@pytest.mark.parametrize("backend", ["cpu", "chaos"])
def test_cnn_measured_peak_equals_prediction(backend: str, cnn_profile, returned) -> None:
    x, y = image_batch()
    rng = random.Random(stable_seed("cnn-peak"))
    plans = _designed(cnn_profile, returned["cnn"]) + [
        _random_plan(cnn_profile, returned["cnn"], rng, "KSRCWw", prefetch=k) for k in range(3)]
    for plan in plans:
        report, _ = _measure(small_resnet, lambda m: F.cross_entropy(m(x), y), plan, backend)
        assert (report.peak_bytes, report.current_bytes) == (build_schedule(plan, cnn_profile).peak_bytes, 0), plan


def test_swapping_the_cached_outputs_lowers_the_peak_by_their_bytes(gpt_profile, returned) -> None:
    """First block selective with its cached outputs swapped, the rest kept, no prefetch ahead: the
    peak (when the backward starts) is lower than with the outputs kept by exactly their bytes."""
    plan = _designed(gpt_profile, returned["gpt"])[0]
    call = lambda m: gpt_loss(m, gpt_batch())  # noqa: E731
    swapped, _ = _measure(lambda: GPT(NANO), call, plan)
    kept, _ = _measure(lambda: GPT(NANO), call, _without_swapped(plan))
    moved = sum(gpt_profile.blocks[0].ops[k].output_bytes for k in plan.blocks[0].swapped_ops)
    assert moved > 0
    assert kept.peak_bytes - swapped.peak_bytes == moved
    assert (swapped.swapped_out_bytes, swapped.swapped_in_bytes) == (moved, moved)
    assert (kept.swapped_out_bytes, kept.swapped_in_bytes) == (0, 0)


def test_swapped_outputs_follow_the_schedules_release_and_swap_in(gpt_profile, returned) -> None:
    """Per block, the tracker's log: the cache is allocated in the forward (kept and swapped alike),
    the swapped part is freed by the RELEASE and allocated again by the SWAP_IN."""
    plan = _random_plan(gpt_profile, returned["gpt"], random.Random(stable_seed("log")), "WwC")
    report, log = _measure(lambda: GPT(NANO), lambda m: gpt_loss(m, gpt_batch()), plan)
    for b, (block, decision) in enumerate(zip(gpt_profile.blocks, plan.blocks)):
        moved = sum(block.ops[k].output_bytes for k in decision.swapped_ops)
        moved += block.input_swappable_bytes if decision.swap_input else 0
        cached = sum(block.ops[k].output_bytes for k in decision.cached_ops)
        assert sum(e[2] for e in log if e[:2] == ("cache", b)) == cached, b
        assert -sum(e[2] for e in log if e[:2] == ("release", b)) == moved, b
        assert sum(e[2] for e in log if e[:2] == ("swap_in", b)) == moved, b
    assert report.current_bytes == 0


class _TwoMul(nn.Module):
    """``(x * 2) * 3``: two cacheable ops, nothing saved for backward (a product by a number saves nothing)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2) * 3


class _Sandwich(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(64, 64), _TwoMul(), nn.Linear(64, 64)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_block_that_saves_nothing_holds_its_swapped_outputs_as_planned(prefetch: int) -> None:
    """The block's recompute frame is held by nothing once its forward ends (no saved tensor, no
    unpack hook): its swapped output must live until the schedule releases it, come back at the
    SWAP_IN, and be freed when the block's backward ends (NOTE [a frame that saves nothing])."""
    torch.manual_seed(0)
    model = _Sandwich()
    x = torch.randn(32, 64, requires_grad=True)
    prof = ooc.profile(model, (x,), blocks=model.blocks, ops=True, codec_errors=False, reps=1, min_swap_bytes=1024)
    assert prof.blocks[1].saved_bytes == 0 and [op.cacheable for op in prof.blocks[1].ops] == [True, True]
    plan = ooc.Plan(blocks=(ooc.BlockPlan("keep"), ooc.BlockPlan("recompute", cached_ops=(0,), swapped_ops=(0,)),
                            ooc.BlockPlan("keep")), min_swap_bytes=1024, prefetch=prefetch)
    ooc.wrap(model, plan, blocks=model.blocks, backend="chaos")
    try:
        runtime_of(model).tracker.log = log = []
        model(x).backward()
        report = ooc.memory_report(model)
    finally:
        ooc.unwrap(model)
    moved = prof.blocks[1].ops[0].output_bytes
    assert [e[2] for e in log if e[0] in ("release", "swap_in")] == [-moved, moved]
    assert (report.peak_bytes, report.current_bytes) == (build_schedule(plan, prof).peak_bytes, 0)


# -- refusals and units ---------------------------------------------------------------------------


def test_swapping_the_output_the_block_returns_is_refused(gpt_profile, returned) -> None:
    last = max(returned["gpt"][1])
    assert gpt_profile.blocks[1].ops[last].cacheable  # the block's residual add: cacheable, but returned
    blocks = [ooc.BlockPlan("keep")] * len(gpt_profile)
    blocks[1] = ooc.BlockPlan("recompute", cached_ops=(3, last), swapped_ops=(3, last))
    torch.manual_seed(0)
    model = GPT(NANO)
    ooc.wrap(model, ooc.Plan(blocks=tuple(blocks), min_swap_bytes=1024), backend="chaos")
    try:
        with pytest.raises(RecomputeError, match=rf"block blocks\.1: its plan swaps the output of op {last} "
                                                 r"\(aten\.add\.Tensor\), which the block returns.*leave op "
                                                 rf"{last} out of swapped_ops"):
            gpt_loss(model, gpt_batch())
        runtime_of(model).backend.synchronize()
        gc.collect()
        assert ooc.memory_report(model).current_bytes == 0  # the refused forward's bytes went with it
        # Cached but not swapped, the same output is fine.
        ooc.unwrap(model)
        blocks[1] = ooc.BlockPlan("recompute", cached_ops=(3, last), swapped_ops=(3,))
        ooc.wrap(model, ooc.Plan(blocks=tuple(blocks), min_swap_bytes=1024), backend="chaos")
        gpt_loss(model, gpt_batch()).backward()
    finally:
        ooc.unwrap(model)


def test_swap_all_swaps_every_storage_whatever_its_size() -> None:
    from ooc.backend.cpu import CpuBackend
    from ooc.pool import HostPool
    from ooc.saved import SwapContext, SwappedView, make_pack_hook
    from ooc.scheduler.plan import Codec
    from ooc.tracker import MemoryTracker

    backend = CpuBackend()
    try:
        tracker = MemoryTracker(1, backend.device)
        ctx = SwapContext(backend, HostPool(backend), tracker, ["b"])
        small, empty = torch.randn(4), torch.empty(0)

        def hook(**kw):  # noqa: ANN003, ANN202
            return make_pack_hook(block=0, swap=True, what="cache", device=backend.device, skip_ptrs=frozenset(),
                                  min_swap_bytes=1 << 20, ctx=ctx, on_kept=lambda *a: None, on_swapped=lambda s: None, **kw)

        assert isinstance(hook()(small), torch.Tensor)  # below min_swap_bytes: kept
        packed = hook(swap_all=True)(small)
        assert isinstance(packed, SwappedView) and torch.equal(packed.unpack(), small)
        assert isinstance(hook(swap_all=True)(empty), torch.Tensor)  # nothing to move
        with pytest.raises(ValueError, match="swap_all needs swap=True and codec none"):
            hook(swap_all=True, codec=Codec.INT8)
        del packed
        gc.collect()
    finally:
        backend.close()


def test_run_recomputed_needs_a_swap_hook_and_swapped_among_cached() -> None:
    from ooc.recompute import run_recomputed
    from ooc.saved import unpack

    lin = nn.Linear(4, 4)
    common = dict(name="b", device=torch.device("cpu"), save_input=lambda t: t, load_input=unpack,
                  recompute_pack=lambda: (lambda t: t), range_name="r", timer=lambda what: contextlib.nullcontext())
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"swapped_ops \[2\] are not among cached_ops"):
        run_recomputed(lin.forward, lin, (x,), {}, cached_ops=(1,), keep_cached=lambda t: t, swapped_ops=(2,), **common)
    with pytest.raises(ValueError, match="swapped_ops needs swap_cached"):
        run_recomputed(lin.forward, lin, (x,), {}, cached_ops=(1,), keep_cached=lambda t: t, swapped_ops=(1,), **common)


class _NoComputeWait(ooc.backend.CpuBackend):
    """The bug: compute never waits for a copy (a released storage, a copied-back one read at once)."""

    def wait_compute(self, event) -> None:  # noqa: ANN001
        return None


class _NoProducerWait(ooc.backend.CpuBackend):
    """The bug: a copy out starts without waiting for the compute that wrote its source."""

    def copy_d2h(self, dst, src, after):  # noqa: ANN001, ANN201
        return super().copy_d2h(dst, src, ())


@pytest.mark.parametrize("broken, message", [(_NoComputeWait, "H2D copy"), (_NoProducerWait, "D2H copy")],
                         ids=["compute-skips-the-copy-back", "copy-out-skips-the-producer"])
def test_the_stream_order_checker_sees_the_swapped_cached_copies(broken, message: str, gpt_profile, returned) -> None:  # noqa: ANN001
    """Only swapped cached outputs move in this plan (no SWAP block, no swapped input): a sync missing
    on their path raises on the CPU backend, as it would race on a GPU."""
    from ooc.backend.order import StreamOrderError

    rng = random.Random(stable_seed("order"))
    plan = _random_plan(gpt_profile, returned["gpt"], rng, "WK")
    plan = ooc.Plan(blocks=tuple(b if b.policy is ooc.Policy.KEEP else ooc.BlockPlan("recompute", cached_ops=b.cached_ops,
                                                                                   swapped_ops=b.swapped_ops)
                                 for b in plan.blocks), min_swap_bytes=1 << 30)
    backend = broken(chaos=ooc.backend.ChaosConfig(seed=2, max_delay_s=0.002), check_order=True)
    torch.manual_seed(0)
    model = GPT(NANO)
    ooc.wrap(model, plan, backend=backend)
    try:
        with pytest.raises(StreamOrderError, match=message):
            gpt_loss(model, gpt_batch()).backward()
    finally:
        ooc.unwrap(model)
        backend.close()


# -- a graph dropped without its backward ---------------------------------------------------------


LEAK = GPTConfig(vocab_size=65, block_size=32, n_layer=3, n_head=2, n_embd=32, dropout=0.0)


class _Interrupted(Exception):
    pass


def _live_storages() -> dict[int, int]:
    """Bytes of each storage a live Python tensor views (as tests/ooc/test_leaks.py counts them)."""
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    storages = (t.untyped_storage() for t in tensors if not t.is_meta and not isinstance(t, FakeTensor))
    return {s.data_ptr(): s.nbytes() for s in storages if s.nbytes() > 0}


@pytest.mark.parametrize("backend", ["cpu", "chaos"])
def test_a_graph_dropped_without_backward_frees_the_swapped_cached_outputs(backend: str) -> None:
    torch.manual_seed(0)
    batch = gpt_batch(batch=2, seq=8)
    prof = ooc.profile(GPT(LEAK), batch, ops=True, codec_errors=False, reps=1, min_swap_bytes=1024)
    returned = _returned_ops(lambda: GPT(LEAK), lambda m: gpt_loss(m, batch))
    plan = ooc.Plan(blocks=tuple(_designed(prof, returned)[1].blocks), min_swap_bytes=1024)
    assert all(b.swapped_ops for b in plan.blocks)
    model = GPT(LEAK)
    ooc.wrap(model, plan, backend=backend)
    try:
        runtime = runtime_of(model)
        model(*batch)[1].backward()  # one whole step first: the host pool holds its buffers from now on
        model.zero_grad(set_to_none=True)
        baseline = _live_storages()
        pooled = runtime.pool.allocated_bytes

        def interrupt(_module, _inputs, _output) -> None:
            raise _Interrupted

        handle = model.blocks[1].register_forward_hook(interrupt)  # after block 1 cached and swapped
        for _ in range(20):
            with pytest.raises(_Interrupted):
                model(*batch)
        handle.remove()
        for _ in range(20):  # a validation forward without no_grad
            logits, loss = model(*batch)
            del logits, loss
        moved = sum(b.ops[k].output_bytes for b, d in zip(prof.blocks, plan.blocks) for k in d.swapped_ops)
        assert runtime.tracker.swapped_out == moved > 0  # the last forward's cached outputs did go out
        assert runtime.tracker.current == 0
        assert runtime.pool.in_use_bytes == 0
        assert runtime.pool.allocated_bytes == pooled
        # A copy out still queued holds its source until it runs: wait for the copy engines first.
        runtime.backend.synchronize()
        # Nothing lives that did not before (a storage alive at the baseline may have died since: after
        # the chaos tests above, one of 2048 bytes was seen at the baseline and gone a moment later).
        after = _live_storages()
        assert {p: n for p, n in after.items() if baseline.get(p) != n} == {}
        model(*batch)[1].backward()
        assert ooc.memory_report(model).current_bytes == 0
    finally:
        ooc.unwrap(model)


# -- end to end -----------------------------------------------------------------------------------


def test_end_to_end_cli_op_profile_hand_plan_through_wrap(tmp_path) -> None:  # noqa: ANN001
    """``ooc profile --ops`` on the demo GPT (gpt:tiny, dropout 0.1), a plan written by hand that
    swaps some cached matmul outputs (never a block's last op), three training steps through
    ``ooc.wrap``: bit-identical to the same plan with those outputs kept (and to plain PyTorch), and
    each step's peak lower by exactly the swapped bytes, as the schedule predicts."""
    import copy

    from ooc.apps.cli import main, reference_model
    from ooc.scheduler.profile import Profile

    path = tmp_path / "tiny.json"
    assert main(["profile", "--model", "gpt:tiny", "--batch", "2", "--seq", "32", "--reps", "1", "--ops", "--out", str(path)]) == 0
    prof = Profile.load(str(path))
    addmm = [[k for k, op in enumerate(b.ops) if op.name == "aten.addmm.default"] for b in prof.blocks]
    assert all(len(ks) == 4 and ks[-1] < len(b.ops) - 1 for ks, b in zip(addmm, prof.blocks))
    # Blocks 0-1: cache the four matmuls, swap qkv and fc1 (the two largest); blocks 2-3: recompute;
    # the rest: keep. No prefetch ahead: the swapped bytes are on the host when the backward starts.
    blocks = [ooc.BlockPlan("recompute", cached_ops=tuple(ks), swapped_ops=(ks[0], ks[2])) for ks in addmm[:2]]
    blocks += [ooc.BlockPlan("recompute")] * 2 + [ooc.BlockPlan("keep")] * (len(prof) - 4)
    swapped = ooc.Plan(blocks=tuple(blocks), min_swap_bytes=prof.min_swap_bytes, prefetch=0)
    kept = _without_swapped(swapped)
    moved = sum(prof.blocks[b].ops[k].output_bytes for b in range(2) for k in swapped.blocks[b].swapped_ops)
    assert moved > 0

    torch.manual_seed(0)
    plain, _ = reference_model("gpt:tiny", 2, 32)
    models = [plain] + [copy.deepcopy(plain) for _ in range(2)]
    for model, plan in zip(models[1:], (kept, swapped)):
        ooc.wrap(model, plan, backend="chaos")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    try:
        for step in range(3):
            x = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(step))
            losses, peaks = [], []
            for model, opt in zip(models, opts):
                opt.zero_grad(set_to_none=True)
                torch.manual_seed(100 + step)  # the same dropout masks for all three
                loss = model(x, torch.roll(x, -1, 1))[1]
                loss.backward()
                losses.append(loss.detach())
                if ooc.is_wrapped(model):
                    peaks.append(ooc.memory_report(model).peak_bytes)
            assert all(torch.equal(losses[0], other) for other in losses[1:]), step
            for ps in zip(*(m.parameters() for m in models)):
                assert all(torch.equal(ps[0].grad, p.grad) for p in ps[1:]), step
            assert peaks == [build_schedule(kept, prof).peak_bytes, build_schedule(swapped, prof).peak_bytes], step
            assert peaks[0] - peaks[1] == moved, step
            for opt in opts:
                opt.step()
    finally:
        for model in models[1:]:
            ooc.unwrap(model)
