"""EMA and SWA on a wrapped model: ``torch.optim.swa_utils.AveragedModel`` and timm's
``ModelEmaV2``/``ModelEmaV3`` keep their average in ``copy.deepcopy(model)``, which is a plain copy of
the user's module (NOTE [a deep copy of a wrapped model] in ooc.plain_copy), and they average as
on the plain model, bit for bit."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

import ooc
from ooc.models import GPT
from ooc.optim import HostAdamW
from tests.helpers import NANO, gpt_batch

STEPS = 3


def _averaged(make_average: Callable[[nn.Module], nn.Module], update: Callable[[nn.Module, nn.Module], None],
              wrapped: bool) -> dict[str, torch.Tensor]:
    """Train a nano GPT ``STEPS`` steps (HostAdamW on the wrapped model, else AdamW(fused=True)),
    updating the average after each; the average's state."""
    torch.manual_seed(0)
    model = GPT(NANO)
    if wrapped:
        ooc.wrap(model, ooc.Plan.of(["swap", "recompute", "keep", "swap"], min_swap_bytes=0), backend="cpu")
        opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    average = make_average(model)
    try:
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            model(*gpt_batch(batch=2, seq=16, seed=step))[1].backward()
            opt.step()
            if wrapped:
                opt.synchronize()  # the pipelined updates are in the weights before the average reads them
            update(average, model)
    finally:
        if wrapped:
            opt.close()
            ooc.unwrap(model)
    return {k: v.clone() for k, v in average.state_dict().items()}


def _swa() -> tuple[Callable, Callable]:
    from torch.optim.swa_utils import AveragedModel

    return AveragedModel, lambda average, model: average.update_parameters(model)


def _timm(name: str) -> tuple[Callable, Callable]:
    timm_utils = pytest.importorskip("timm.utils")
    ema = getattr(timm_utils, name)
    if name == "ModelEmaV3":
        return (lambda m: ema(m, decay=0.5)), (lambda average, model: average.update(model, step=None))
    return (lambda m: ema(m, decay=0.5)), (lambda average, model: average.update(model))


@pytest.mark.parametrize("kind", ["AveragedModel", "ModelEmaV2", "ModelEmaV3"])
def test_an_average_of_a_wrapped_model_equals_the_plain_models(kind: str) -> None:
    make, update = _swa() if kind == "AveragedModel" else _timm(kind)
    expected = _averaged(make, update, wrapped=False)
    got = _averaged(make, update, wrapped=True)
    assert got.keys() == expected.keys()
    assert [k for k in got if not torch.equal(got[k], expected[k])] == []


def test_a_deep_copy_of_a_wrapped_model_is_the_plain_module() -> None:
    """The copy runs as the plain model (no ooc forward or hook, nothing of the optimizer's), and
    the wrapped model trains on, unharmed."""
    torch.manual_seed(0)
    model = GPT(NANO)
    plain = copy.deepcopy(model)
    ooc.wrap(model, ooc.Plan.of(["swap", "keep", "recompute", "keep"], min_swap_bytes=0), backend="cpu")
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
    try:
        model(*gpt_batch(batch=2, seq=16))[1].backward()
        opt.step()
        opt.synchronize()
        plain.load_state_dict(model.state_dict())
        copied = copy.deepcopy(model)
        assert not ooc.is_wrapped(copied) and "__deepcopy__" not in copied.__dict__
        assert all("forward" not in m.__dict__ for m in copied.modules())
        assert not any(m._forward_pre_hooks or m._forward_hooks or m._state_dict_pre_hooks
                       or m._load_state_dict_pre_hooks for m in copied.modules())
        batch = gpt_batch(batch=2, seq=16, seed=1)
        torch.manual_seed(1)
        loss = copied(*batch)[1]
        loss.backward()  # the copy's gradients are its own: the optimizer saw no backward
        torch.manual_seed(1)  # the same dropout masks
        assert torch.equal(loss, plain(*batch)[1])
        assert opt.uncommitted_buckets() == []
        opt.zero_grad(set_to_none=True)
        model(*batch)[1].backward()
        opt.step()
        assert "__deepcopy__" in model.__dict__ and ooc.memory_report(model).swapped_out_bytes > 0
    finally:
        opt.close()
        ooc.unwrap(model)
    assert "__deepcopy__" not in model.__dict__
