"""HostAdamW(loss_scale=LossScale()): fp16 loss scaling inside the optimizer (NOTE [loss scaling in
the optimizer] in ooc.optim.loss_scale), against torch.amp.GradScaler + AdamW(fused=True)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ooc
from ooc.checkpoint import Checkpointer
from ooc.errors import OocError
from ooc.models import GPT
from ooc.optim import HostAdamW, LossScale
from tests.helpers import gpt_batch
from tests.ooc.test_distributed_users import Net, _batch, _on_two_ranks

STEPS = 7
OVERFLOW = {2, 3}
"""Steps whose loss is made inf: their gradients are inf or NaN, so the step is skipped and the
scale backs off (twice in a row here, then grows again every ``growth_interval`` good steps)."""
SCALE = LossScale(init_scale=2.0**10, growth_interval=2)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    torch.manual_seed(step)
    loss = model(*gpt_batch(seed=step))[1]
    return loss * float("inf") if step in OVERFLOW else loss


def _with_grad_scaler(model: nn.Module, max_grad_norm: float | None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE.init_scale, growth_interval=SCALE.growth_interval)
    scales = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        scaler.scale(_loss(model, step)).backward()
        if max_grad_norm is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _with_host_adamw(trained: nn.Module, **options: object) -> tuple[list[float], list[bool]]:
    opt = HostAdamW(trained.parameters(), lr=1e-3, weight_decay=0.1, loss_scale=SCALE, **options)
    scales, skipped = [], []
    try:
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            opt.scale(_loss(trained, step)).backward()
            opt.step()
            scales.append(opt.get_scale())
            skipped.append(opt.last_step_skipped)
        opt.synchronize()
    finally:
        opt.close()
    return scales, skipped


@pytest.mark.parametrize("options", [
    {"pipelined": True}, {"pipeline": False}, {"pipelined": True, "max_grad_norm": 0.5},
    {"pipelined": True, "device_params_below": 100}, {"pipelined": True, "device_params_below": 100, "max_grad_norm": 0.5},
], ids=["pipelined", "in step()", "clipped", "small on device", "small on device, clipped"])
def test_trains_as_grad_scaler_and_fused_adamw_bit_for_bit(options: dict) -> None:
    """Weights and scales equal GradScaler's + AdamW(fused=True)'s after every step, overflowing
    steps skipped and the scale backing off and growing as GradScaler's does; the pipelined runs go
    through a wrapped model (its blocks are buckets whose updates wait for step())."""
    options = dict(options)
    pipelined = options.pop("pipelined", False)
    torch.manual_seed(0)
    reference = GPT("nano")
    model = copy.deepcopy(reference)
    expected = _with_grad_scaler(reference, options.get("max_grad_norm"))
    if pipelined:
        ooc.wrap(model, ooc.Plan.uniform("keep", len(model.blocks)), backend="cpu")
        options["model"] = model
    try:
        scales, skipped = _with_host_adamw(model, **options)
    finally:
        if pipelined:
            ooc.unwrap(model)
    assert scales == expected
    assert skipped == [step in OVERFLOW for step in range(STEPS)]
    assert expected[1:4] == [2.0**11, 2.0**10, 2.0**9]  # grew once, then backed off twice
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_a_skipped_step_changes_no_weight_moment_or_step_count() -> None:
    torch.manual_seed(0)
    model = GPT("nano")
    ooc.wrap(model, ooc.Plan.uniform("keep", len(model.blocks)), backend="cpu")
    opt = HostAdamW(model.parameters(), lr=1e-3, model=model, loss_scale=LossScale(init_scale=8.0))
    try:
        opt.scale(_loss(model, 0)).backward()
        opt.step()
        before = copy.deepcopy(opt.state_dict())
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        opt.zero_grad()
        opt.scale(_loss(model, min(OVERFLOW))).backward()
        opt.step()
        assert opt.last_step_skipped and opt.get_scale() == 4.0
        after = opt.state_dict()
        assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
        for key, state in before["state"].items():
            assert all(torch.equal(v, after["state"][key][f]) for f, v in state.items())
        assert before["ooc"]["loss_scale"] == {"scale": 8.0, "growth_tracker": 1}
        assert after["ooc"]["loss_scale"] == {"scale": 4.0, "growth_tracker": 0}
    finally:
        opt.close()
        ooc.unwrap(model)


def test_the_scale_resumes_from_a_checkpoint(tmp_path) -> None:  # noqa: ANN001
    """A version holds the scale and its growth count: training resumed from it scales, skips and
    updates as the run that never stopped (weights and scales equal)."""
    torch.manual_seed(0)
    whole = GPT("nano")
    resumed = copy.deepcopy(whole)
    expected, _ = _with_host_adamw(whole)
    opt = HostAdamW(resumed.parameters(), lr=1e-3, weight_decay=0.1, loss_scale=SCALE)
    ckpt = Checkpointer(tmp_path, resumed, opt)
    scales = []
    for step in range(STEPS):
        if step == 4:  # after the overflows: the scale is 2**9 with one good step counted
            ckpt.close()
            opt.close()
            opt = HostAdamW(resumed.parameters(), lr=1e-3, weight_decay=0.1, loss_scale=SCALE)
            ckpt = Checkpointer(tmp_path, resumed, opt)
            ckpt.restore()
            assert opt.get_scale() == 2.0**9
        opt.zero_grad(set_to_none=True)
        opt.scale(_loss(resumed, step)).backward()
        opt.step()
        scales.append(opt.get_scale())
        ckpt.save(step)
    ckpt.close()
    opt.close()
    assert scales == expected
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), resumed.parameters()))


def test_a_load_that_fails_leaves_the_scale_as_it_was() -> None:
    """load_state_dict of a state whose groups do not fit raises (torch's check), and changes nothing:
    the scale took the refused checkpoint's before the check, and training went on with it beside
    the old moments."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = HostAdamW(model.parameters(), loss_scale=LossScale(init_scale=8.0))
    try:
        opt.scale(model(torch.ones(1, 4)).sum()).backward()
        opt.step()
        saved = opt.state_dict()
        saved["ooc"]["loss_scale"] = {"scale": 2.0, "growth_tracker": 0}
        saved["param_groups"][0]["params"] = saved["param_groups"][0]["params"][:3]
        with pytest.raises(ValueError, match="doesn't match the size"):
            opt.load_state_dict(saved)
        assert opt.state_dict()["ooc"]["loss_scale"] == {"scale": 8.0, "growth_tracker": 1}
    finally:
        opt.close()


def fp16_from_an_overflowing_scale(model: GPT, plan: ooc.Plan, backend: str,
                                   batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Train fp16 ``model`` wrapped in ``plan`` 16 steps on ``batch``, from a scale of 2**24, which
    overflows fp16's gradients: the steps are skipped and the scale halves until it fits (2**15 for
    the nano GPT), then the loss goes down. The CPU test and the CUDA one (tests/gpu) share this."""
    ooc.wrap(model, plan, backend=backend)
    opt = HostAdamW(model.parameters(), lr=3e-3, model=model, loss_scale=LossScale(init_scale=2.0**24))
    losses, skipped = [], []
    try:
        for _ in range(16):
            opt.zero_grad()
            torch.manual_seed(0)  # the same dropout masks at every step
            loss = model(*batch)[1]
            opt.scale(loss.float()).backward()
            opt.step()
            losses.append(loss.item())
            skipped.append(opt.last_step_skipped)
    finally:
        opt.close()
        ooc.unwrap(model)
    first_good = skipped.index(False)
    assert 0 < first_good < 12 and not any(skipped[first_good:])
    assert losses[-1] < losses[first_good]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp16_weights_train_once_the_scale_backs_off_below_overflow() -> None:
    """fp16 parameters on the host optimizer (fp32 masters)."""
    torch.manual_seed(0)
    model = GPT("nano").half()
    fp16_from_an_overflowing_scale(model, ooc.Plan.uniform("recompute", len(model.blocks)), "cpu", gpt_batch(seed=0))


def test_fp16_gradients_kept_on_the_device_are_unscaled_in_fp32_as_fused_adamw_does() -> None:
    """fp16 parameters kept on their device (``device_params_below``) are updated by torch's fused
    AdamW there: weights and scales equal GradScaler's + AdamW(fused=True)'s, whose kernel unscales
    each gradient in fp32. Unscaled in place, in fp16, the small gradients (below fp16's normal
    range, the ones the scale is for) lost their low bits or became 0."""
    torch.manual_seed(0)
    reference = GPT("nano").half()
    model = copy.deepcopy(reference)
    expected = _with_grad_scaler(reference, None)
    scales, skipped = _with_host_adamw(model, device_params_below=10**9)
    assert scales == expected and skipped == [step in OVERFLOW for step in range(STEPS)]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def _ddp_grad_scaler(rank: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = Net()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE.init_scale, growth_interval=SCALE.growth_interval)
    scales = []
    for step in range(4):
        x, y = _batch(rank, step)
        loss = F.mse_loss(ddp(x), y)
        scaler.scale(loss * float("inf") if (rank, step) == (1, 1) else loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, scales


def _host_adamw_scaled(rank: int, **options: object) -> tuple[dict[str, torch.Tensor], list[float], list[bool]]:
    torch.manual_seed(0)
    model = Net()
    ooc.wrap(model, ooc.Plan.uniform("keep", 3), blocks=model.blocks)
    data_parallel = ooc.distributed.DataParallel(shard=options.pop("shard", False), timeout_s=60)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, loss_scale=SCALE, data_parallel=data_parallel, **options)
    scales, skipped = [], []
    try:
        for step in range(4):
            x, y = _batch(rank, step)
            loss = F.mse_loss(model(x), y)
            opt.scale(loss * float("inf") if (rank, step) == (1, 1) else loss).backward()
            opt.step()
            opt.zero_grad()
            scales.append(opt.get_scale())
            skipped.append(opt.last_step_skipped)
        opt.synchronize()
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        opt.close()
        ooc.unwrap(model)
    return weights, scales, skipped


def _scaled_against_ddp(rank: int) -> dict[str, object]:
    reference, expected = _ddp_grad_scaler(rank)
    found = {}
    for name, options in {"": {}, "sharded": {"shard": True}, "small on device": {"device_params_below": 20}}.items():
        weights, scales, skipped = _host_adamw_scaled(rank, **options)
        found[name] = ([k for k in reference if not torch.equal(reference[k], weights[k])], scales == expected, skipped)
    return found


def test_data_parallel_ranks_skip_a_step_that_overflowed_on_one_rank_together() -> None:
    """An inf on rank 1 alone: every rank skips the step and backs off, as DDP + GradScaler do (DDP
    averages the inf into every rank's gradients). torch's GradScaler on HostAdamW's ranks checked
    each rank's own gradients: rank 1 skipped step() alone, and rank 0's next exchange waited for it."""
    for rank, found in enumerate(_on_two_ranks(_scaled_against_ddp)):
        for name, (differ, same_scales, skipped) in found.items():
            assert not differ and same_scales, f"rank {rank} {name}: weights {differ}, scales equal {same_scales}"
            assert skipped == [False, True, False, False], f"rank {rank} {name}"


def test_bad_loss_scale_settings_are_refused() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(TypeError, match="LossScale"):
        HostAdamW(model.parameters(), loss_scale=2.0**16)
    for bad in ({"growth_factor": 1.0}, {"backoff_factor": 1.0}, {"init_scale": 0.0}, {"growth_interval": 0}):
        with pytest.raises(ValueError, match="LossScale"):
            LossScale(**bad)
    opt = HostAdamW(model.parameters())
    with pytest.raises(OocError, match="loss_scale"):
        opt.scale(model(torch.ones(1, 4)).sum())
    assert opt.get_scale() is None and not opt.last_step_skipped
    opt.close()


def test_a_grad_scaler_on_a_pipelined_optimizer_is_refused_pointing_to_loss_scale() -> None:
    """GradScaler unscales after the pipelined updates read the gradients: step() refuses the step
    (as for any change there) and names the way that works."""
    from ooc.optim.pipeline import PipelineError

    torch.manual_seed(0)
    model = GPT("nano")
    ooc.wrap(model, ooc.Plan.uniform("keep", len(model.blocks)), backend="cpu")
    opt = HostAdamW(model.parameters(), lr=1e-3, model=model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    try:
        scaler.scale(_loss(model, 0)).backward()
        with pytest.raises(PipelineError, match=r"loss_scale=ooc\.optim\.LossScale\(\)"):
            scaler.step(opt)
        # It ran on the scaled gradients, without a word: GradScaler's unscale kernel leaves the
        # gradients' version counters alone, which the check of changed gradients goes by.
        assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")  # a plain step() is not refused
    finally:
        opt.close()
        ooc.unwrap(model)


@pytest.mark.parametrize("unscale_in_the_loop", [False, True])
def test_a_grad_scaler_drives_an_optimizer_that_updates_in_step(unscale_in_the_loop: bool) -> None:
    """pipeline=False on one rank reads the gradients in step(): a GradScaler works there as on
    torch's AdamW (NOTE [a GradScaler drives HostAdamW]), with its own unscale_ in the loop or not,
    overflowing steps skipped; weights and scales bit for bit."""
    torch.manual_seed(0)
    reference = GPT("nano")
    model = copy.deepcopy(reference)
    expected = _with_grad_scaler(reference, None)
    opt = HostAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, pipeline=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE.init_scale, growth_interval=SCALE.growth_interval)
    scales = []
    try:
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            scaler.scale(_loss(model, step)).backward()
            if unscale_in_the_loop:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    finally:
        opt.close()
    assert scales == expected
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")


def test_a_grad_scaler_on_fp16_gradients_is_refused_pointing_to_loss_scale() -> None:
    """GradScaler hands its scale to step(), which unscaled the gradients in place: fp16 ones in
    fp16, losing what lay below fp16's normal range (GradScaler.unscale_ refuses fp16 gradients for
    that; torch's fused AdamW divides in fp32). loss_scale= unscales them in fp32 on the host."""
    torch.manual_seed(0)
    model = GPT("nano").half()
    opt = HostAdamW(model.parameters(), lr=1e-3, pipeline=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        scaler.scale(_loss(model, 0).float()).backward()
        with pytest.raises(OocError, match=r"fp16.*loss_scale=ooc\.optim\.LossScale\(\)"):
            scaler.step(opt)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    finally:
        opt.close()


class _ForwardingOptimizer:
    """An optimizer wrapper that forwards ``step``, ``zero_grad`` and ``param_groups`` but no other
    attribute, as some frameworks' wrappers do: GradScaler then does not see HostAdamW's
    ``_step_supports_amp_scaling`` and unscales the gradients itself before ``step()``."""

    def __init__(self, optimizer: HostAdamW) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def step(self, closure=None):  # noqa: ANN001, ANN201
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


@contextlib.contextmanager
def _pipelined_behind_a_wrapper() -> Iterator[tuple[nn.Module, _ForwardingOptimizer, torch.amp.GradScaler]]:
    """The nano GPT wrapped all-KEEP, a pipelined HostAdamW behind ``_ForwardingOptimizer``, and a
    GradScaler at 2^10; the optimizer is closed and the model unwrapped afterwards."""
    torch.manual_seed(0)
    model = GPT("nano")
    ooc.wrap(model, ooc.Plan.uniform("keep", len(model.blocks)), backend="cpu")
    opt = HostAdamW(model.parameters(), lr=1e-3, model=model)
    try:
        yield model, _ForwardingOptimizer(opt), torch.amp.GradScaler("cpu", init_scale=2.0**10)
    finally:
        opt.close()
        ooc.unwrap(model)


def test_a_grad_scaler_through_a_wrapper_on_a_pipelined_optimizer_is_refused_pointing_to_loss_scale() -> None:
    """Through a wrapper that hides ``_step_supports_amp_scaling``, GradScaler unscaled the gradients
    after the pipelined updates had read them, with a kernel that leaves their version counters
    alone, and step() trained on the scaled gradients without a word. Now step() sees GradScaler
    calling it and refuses, naming loss_scale=."""
    from ooc.optim.pipeline import PipelineError

    with _pipelined_behind_a_wrapper() as (model, wrapper, scaler):
        scaler.scale(_loss(model, 0)).backward()
        with pytest.raises(PipelineError, match=r"unscaled the gradients itself.*loss_scale=ooc\.optim\.LossScale\(\)"):
            scaler.step(wrapper)


def test_a_grad_scaler_through_a_wrapper_drives_an_optimizer_that_updates_in_step() -> None:
    """pipeline=False reads the gradients in step(), after GradScaler unscaled them itself: it
    trains as GradScaler + AdamW(fused=True), bit for bit, overflowing steps skipped."""
    torch.manual_seed(0)
    reference = GPT("nano")
    model = copy.deepcopy(reference)
    expected = _with_grad_scaler(reference, None)
    opt = HostAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, pipeline=False)
    wrapper = _ForwardingOptimizer(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE.init_scale, growth_interval=SCALE.growth_interval)
    scales = []
    try:
        for step in range(STEPS):
            wrapper.zero_grad(set_to_none=True)
            scaler.scale(_loss(model, step)).backward()
            scaler.step(wrapper)
            scaler.update()
            scales.append(scaler.get_scale())
    finally:
        opt.close()
    assert scales == expected
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_a_grad_scaler_through_a_wrapper_and_loss_scale_both_is_refused() -> None:
    """The loss scaled twice (GradScaler through a wrapper, and loss_scale=): refused, not trained
    on gradients unscaled once."""
    torch.manual_seed(0)
    model = GPT("nano")
    opt = HostAdamW(model.parameters(), lr=1e-3, pipeline=False, loss_scale=LossScale())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    try:
        scaler.scale(opt.scale(_loss(model, 0))).backward()
        with pytest.raises(OocError, match=r"scales the loss itself.*not both"):
            scaler.step(_ForwardingOptimizer(opt))
    finally:
        opt.close()


def test_a_step_a_grad_scaler_skipped_through_a_wrapper_names_loss_scale() -> None:
    """An overflow: GradScaler skips step() (it never calls into HostAdamW), after the pipelined
    updates had applied the non-finite gradients in the backward. Nothing can refuse that step; the
    warning at zero_grad() names the likely cause and the way that works."""
    from ooc.optim.pipeline import UncommittedStepWarning

    with _pipelined_behind_a_wrapper() as (model, wrapper, scaler):
        scaler.scale(_loss(model, min(OVERFLOW))).backward()
        scaler.step(wrapper)
        scaler.update()
        with pytest.warns(UncommittedStepWarning, match=r"GradScaler.*skips step\(\).*loss_scale=ooc\.optim\.LossScale\(\)"):
            wrapper.zero_grad()
