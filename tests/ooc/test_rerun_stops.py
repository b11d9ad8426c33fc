"""A re-run stops at the block's last saved tensor (NOTE [a re-run stops at the last save] in
ooc.scheduler.profile): the measured profile marks the ops after it ``replayed=False``, the runtime's
re-runs (plain and selective) dispatch exactly the replayed ops, and the cost model neither charges a
plain re-run for the others nor credits caching them."""

from __future__ import annotations

import functools
import random
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import ooc
import ooc.api
import ooc.recompute
from ooc.models import GPT
from ooc.scheduler import preset
from ooc.scheduler.analytic import gpt2_xl, wide_resnet
from ooc.scheduler.errors import ProfileError
from ooc.scheduler.oplevel import rerun_saved_s, selective_sets
from ooc.scheduler.planners import op_level
from ooc.scheduler.profile import Profile
from ooc.scheduler.schedule import build_schedule, selective_rerun_s
from tests.helpers import (
    NANO,
    NANO_NO_DROPOUT,
    ce_loss,
    gpt_batch,
    gpt_loss,
    image_batch,
    image_op_profile,
    random_cached_plan,
    small_resnet,
    stable_seed,
    tiny_llama_op_profile,
    train_side_by_side,
)

_METADATA = ("aten.detach.default", "aten.view.default")
"""Ops that make aliases only: ooc's hooks dispatch some around a re-run's ops (what they hand on)."""
_STATE = ("aten.clone.default",)
"""What a re-run dispatches before the block's forward: copies of the buffers from before the step
(NOTE [the re-run sees the forward's state])."""


class _Names(TorchDispatchMode):
    """The names of the ops that reach it, less aliasing ones (``_METADATA``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if str(func) not in _METADATA and (self.names or str(func) not in _STATE):
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def reruns(monkeypatch) -> list[object]:  # noqa: ANN001
    """Per re-run, in order: a selective one's op counter at its end (it counts the block's ops as
    the forward did, cached and left-out ones too), or the ops a plain one dispatched, by name,
    without aliasing ones and the copies of the state before the forward."""
    seen: list[object] = []
    recompute, replay_init = ooc.recompute.RecomputeFrame.recompute, ooc.recompute.Replay.__init__
    replays: list[ooc.recompute.Replay] = []

    def recorded_rerun(self, gid: int) -> None:  # noqa: ANN001
        before = len(replays)
        with _Names() as mode:
            recompute(self, gid)
        seen.append(replays[-1].count if len(replays) > before else mode.names)

    def recorded_replay(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        replay_init(self, *args, **kwargs)
        replays.append(self)

    monkeypatch.setattr(ooc.recompute.RecomputeFrame, "recompute", recorded_rerun)
    monkeypatch.setattr(ooc.recompute.Replay, "__init__", recorded_replay)
    return seen


@functools.cache
def _model(which: str):  # noqa: ANN202
    """(factory, profile, loss_fn, batches) of a test model, profiled once per test run (nothing
    changes them: each test makes its own models)."""
    if which in ("gpt", "gpt-no-dropout"):
        config = NANO if which == "gpt" else NANO_NO_DROPOUT
        torch.manual_seed(0)
        prof = ooc.profile(GPT(config), gpt_batch(), ops=True, codec_errors=False, reps=1)
        return (lambda: GPT(config)), prof, gpt_loss, [gpt_batch(seed=s) for s in range(2)]
    if which == "cnn":
        x, y = image_batch()
        return small_resnet, image_op_profile(small_resnet()), ce_loss, [(x, y), (x.flip(0), y)]
    pytest.importorskip("transformers")
    make, x, prof = tiny_llama_op_profile(which.split("-")[1])
    return make, prof, (lambda m, b: m(input_ids=b, labels=b).loss), [x, x.flip(1)]


@pytest.mark.parametrize("which", ["gpt", "gpt-no-dropout", "cnn", "llama-sdpa", "llama-eager"])
def test_the_runtime_reruns_exactly_the_ops_the_profile_marks_replayed(which: str, reruns: list[int]) -> None:
    """Plain and random selective re-runs dispatch the profile's replayed ops, no more and no fewer,
    and the gradients equal plain PyTorch."""
    make, prof, loss_fn, batches = _model(which)
    replayed = [sum(op.replayed for op in b.ops) for b in prof.blocks]
    assert all(0 < r <= len(b.ops) for r, b in zip(replayed, prof.blocks))
    names = [[op.name for op in b.ops[:r] if op.name not in _METADATA] for b, r in zip(prof.blocks, replayed)]
    rng = random.Random(stable_seed("rerun stops", which))
    plans = [ooc.Plan.uniform("recompute", len(prof), min_swap_bytes=prof.min_swap_bytes),
             *(random_cached_plan(prof, rng) for _ in range(2))]
    for plan in plans:
        reruns.clear()
        results = train_side_by_side(make, loss_fn, batches, lambda m, p=plan: ooc.wrap(m, p, backend="cpu"))
        assert results == [(True, True, True)] * len(batches), plan
        # The backward re-runs the blocks last to first, once per step.
        expected = [names[i] if not d.cached_ops else replayed[i] for i, d in enumerate(plan.blocks)]
        assert reruns == expected[::-1] * len(batches), plan


@pytest.mark.parametrize("which", ["gpt-no-dropout", "llama-eager"])
def test_a_block_without_dropout_never_reruns_its_last_matmul(which: str) -> None:
    """Not vacuous: the MLP's second matmul saves its input, the block's last saved tensor, before it
    runs; it and the residual add after it are not replayed (with dropout at the end, the CPU's
    dropout multiplies by a mask drawn before, which that product saves first: only it and the add
    are left)."""
    _, prof, _, _ = _model(which)
    for block in prof.blocks:
        tail = [op.name for op in block.ops if not op.replayed]
        assert any(name in ("aten.addmm.default", "aten.mm.default") for name in tail), tail
    _, with_dropout, _, _ = _model("gpt")
    assert all([op.name for op in b.ops if not op.replayed] == ["aten.mul.Tensor", "aten.add.Tensor"]
               for b in with_dropout.blocks)


def test_a_plain_rerun_is_priced_without_the_ops_it_never_reaches() -> None:
    """Without a measured re-run (``rerun_s``), at the block's forward times the replayed ops' share."""
    _, prof, _, _ = _model("gpt-no-dropout")
    block = replace(prof.blocks[1], rerun_s=None)
    plain = ooc.BlockPlan("recompute")
    share = sum(op.forward_s for op in block.ops if op.replayed) / sum(op.forward_s for op in block.ops)
    assert share < 1
    assert selective_rerun_s(plain, block, None) == pytest.approx(block.forward_s * share, rel=1e-12)
    tail = [k for k, op in enumerate(block.ops) if not op.replayed and op.cacheable and op.forward_s > 0]
    assert tail
    assert rerun_saved_s(block.ops, tail) == 0.0  # caching them skips nothing
    assert all(k not in s.ops for s in selective_sets(block.ops, count=8) for k in tail)


@pytest.mark.parametrize("which", ["gpt-no-dropout", "wrn"])
def test_the_op_level_planner_caches_no_op_after_the_last_save(which: str) -> None:
    if which == "wrn":
        prof = wide_resnet(batch=64, hardware=preset("h100-sxm"))
    else:
        prof = _model(which)[1]
    hw = preset("h100-sxm")
    keep = build_schedule(ooc.Plan.uniform("keep", len(prof), min_swap_bytes=prof.min_swap_bytes), prof).peak_bytes
    for fraction in (0.6, 0.4):
        plan = op_level(prof, hw, int(keep * fraction))
        assert all(block.ops[k].replayed for block, d in zip(prof.blocks, plan.blocks) for k in d.cached_ops)


def test_replayed_round_trips_and_only_a_tail_may_be_unreplayed() -> None:
    prof = Profile(gpt2_xl(1024, 1, preset("h100-sxm")).blocks[:2], outside_forward_s=1e-3)
    assert [op.replayed for op in prof.blocks[0].ops] == [True] * 14 + [False]  # the output add
    assert Profile.from_json(prof.to_json()) == prof
    block = prof.blocks[0]
    holed = tuple(replace(op, replayed=False) if k == 3 else op for k, op in enumerate(block.ops))
    with pytest.raises(ProfileError, match="only the block's last ops may be unreplayed"):
        replace(block, ops=holed)
    data = prof.to_dict()
    data["blocks"][0]["ops"][0]["replayed"] = "no"
    with pytest.raises(ProfileError, match="replayed"):
        Profile.from_dict(data)
    data["blocks"][0]["ops"][0]["replayed"] = True
    for op in data["blocks"][1]["ops"]:  # a profile from before the field: every op replayed
        op.pop("replayed")
    assert all(op.replayed for op in Profile.from_dict(data).blocks[1].ops)


def test_an_unreplayed_op_counts_nothing_in_a_model_only_hand_written() -> None:
    """A hand-written profile can say so too: the block's plain re-run skips its last op's time."""
    block = gpt2_xl(1024, 1, preset("h100-sxm")).blocks[0]
    everything = replace(block, ops=tuple(replace(op, replayed=True) for op in block.ops))
    assert selective_rerun_s(ooc.BlockPlan("recompute"), everything, None) == block.forward_s
    assert selective_rerun_s(ooc.BlockPlan("recompute"), block, None) == pytest.approx(
        block.forward_s - block.ops[-1].forward_s, rel=1e-12)


def test_a_block_that_saves_nothing_replays_nothing() -> None:
    """A block whose backward needs no saved tensor is never re-run: no op of it is replayed."""

    class Shift(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.blocks, self.head = nn.Linear(4, 4), nn.ModuleList([Shift(), Shift()]), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.first(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    x = torch.randn(3, 4)
    model = Chain()
    prof = ooc.profile(model, (x,), loss_fn=lambda out: out.sum(), ops=True, codec_errors=False, reps=1,
                       blocks=model.blocks)
    assert prof.blocks and all(b.ops and not any(op.replayed for op in b.ops) for b in prof.blocks)


def test_analytic_cnn_blocks_never_rerun_their_last_convolution() -> None:
    """A convolution saves its input before it runs: a WRN block's re-run stops before its second
    convolution (or, where the width changes, before the shortcut's, after the second)."""
    prof = wide_resnet(batch=8, hardware=preset("h100-sxm"))
    tails = {tuple(op.name for op in b.ops if not op.replayed) for b in prof.blocks}
    assert tails == {("conv2", "add"), ("shortcut", "add")}
    assert all(b.replayed_s < b.forward_s for b in prof.blocks)


def test_a_measured_profile_records_each_blocks_rerun_and_the_cost_model_prices_it() -> None:
    """``ooc.profile`` times each block's plain re-run (the pass with every block recomputed):
    ``BlockProfile.rerun_s``, what a plain RECOMPUTE is priced at; it round-trips through JSON."""
    torch.manual_seed(0)
    prof = ooc.profile(GPT(NANO_NO_DROPOUT), gpt_batch(), codec_errors=False, reps=1)
    assert all(b.rerun_s is not None and b.rerun_s > 0 for b in prof.blocks)
    block = prof.blocks[0]
    assert selective_rerun_s(ooc.BlockPlan("recompute"), block, None) == block.rerun_s == block.replayed_s
    assert Profile.from_json(prof.to_json()) == prof
    data = prof.to_dict()
    data["blocks"][0]["rerun_s"] = -1.0
    with pytest.raises(ProfileError, match="rerun_s"):
        Profile.from_dict(data)


def test_the_first_step_profile_takes_the_forwards_and_the_reruns_apart(monkeypatch) -> None:  # noqa: ANN001
    """``wrap(model, budget=...)`` without a sample profiles its first step (every block recomputed):
    a block's forward is its forward, not its re-run, which stops at its last save."""
    from ooc.profiler import FirstStepRecorder

    timed = {"forward": [3.0] * 4, "recompute": [2.0] * 4, "backward": [5.0] * 4}
    monkeypatch.setattr(FirstStepRecorder, "medians", lambda self: timed)
    profiles = []
    plan_for_profile = ooc.api.plan_for_profile
    monkeypatch.setattr(ooc.api, "plan_for_profile", lambda prof, *a, **k: (profiles.append(prof), plan_for_profile(prof, *a, **k))[1])
    torch.manual_seed(0)
    model = GPT(NANO_NO_DROPOUT)
    ooc.wrap(model, budget=1 << 30, backend="cpu")
    try:
        gpt_loss(model, gpt_batch()).backward()
    finally:
        ooc.unwrap(model)
    assert [(b.forward_s, b.rerun_s, b.backward_s) for b in profiles[0].blocks] == [(3.0, 2.0, 5.0)] * 4
