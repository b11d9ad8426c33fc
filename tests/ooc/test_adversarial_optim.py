"""HostAdamW's options and parameters off the happy path (issue 12, an adversarial pass): what
would train other weights than ``torch.optim.AdamW`` is refused up front, with a message."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import ooc
from ooc.errors import OocError
from ooc.models import GPT
from ooc.optim import HostAdamW
from ooc.optim.pipeline import PipelineError
from tests.helpers import NANO, gpt_batch


@pytest.mark.parametrize("kwargs", [
    dict(lr=math.nan), dict(lr=math.inf), dict(eps=math.nan), dict(weight_decay=math.nan), dict(lr="1e-3"),
    dict(betas=(0.9,)), dict(betas=(0.9, math.nan)), dict(max_grad_norm="1.0"),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_hyperparameters_that_are_not_finite_numbers_are_refused(kwargs: dict) -> None:
    # lr=nan trained every weight to NaN without a word (torch.optim.AdamW refuses it); a string
    # lr raised "'<' not supported between instances of 'str' and 'int'"; betas=(0.9,) failed later,
    # in the host thread.
    with pytest.raises((ValueError, TypeError), match=r"lr|eps|weight_decay|betas|max_grad_norm"):
        HostAdamW(torch.nn.Linear(2, 2).parameters(), **kwargs)


@pytest.mark.parametrize("kwargs", [dict(delayed_update="no"), dict(rollback=1), dict(device_params_below=1.5)],
                         ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()))
def test_options_of_the_wrong_type_are_refused(kwargs: dict) -> None:
    # delayed_update="no" read as True: the run trained with one-step-stale gradients.
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        HostAdamW(torch.nn.Linear(2, 2).parameters(), **kwargs)


def test_a_parameter_passed_twice_is_refused() -> None:
    # Accepted, it trained other weights than torch.optim.AdamW given the same list (which warns).
    model = GPT(NANO)
    with pytest.raises(ValueError, match="same parameter more than once"):
        HostAdamW([*model.parameters(), model.blocks[0].ln_1.weight], model=model)


def test_a_model_that_owns_none_of_the_parameters_is_refused() -> None:
    # The gates went on the other model's forward: this one's forward read weights while the host
    # thread wrote them, and training drifted from torch.optim.AdamW's.
    trained, other = GPT(NANO), GPT(NANO)
    with pytest.raises(ValueError, match="model= must be the module"):
        HostAdamW(trained.parameters(), model=other)
    HostAdamW([*trained.parameters(), torch.nn.Parameter(torch.ones(()))], model=trained).close()  # an extra one is fine


def test_a_module_in_place_of_the_parameters_is_the_model() -> None:
    """``HostAdamW(model)`` (transformers.Trainer's ``optimizer_cls_and_kwargs`` passes the model so) trains
    the model's parameters with ``model=model``; another model beside it is refused."""
    trained, other = GPT(NANO), GPT(NANO)
    with pytest.raises(ValueError, match="in place of the parameters and another model="):
        HostAdamW(trained, model=other)
    opt = HostAdamW(trained, lr=1e-2)
    try:
        assert opt.param_groups[0]["params"] == list(trained.parameters())
        assert len(opt.buckets) > 1  # bucketed by the model's chain, not one bucket of loose parameters
    finally:
        opt.close()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        torch.manual_seed(step)  # dropout
        model(*gpt_batch(batch=2, seq=16, seed=step))[1].backward()
        opt.step()
        opt.zero_grad()


def _streamed_plan() -> ooc.Plan:
    return ooc.Plan.uniform("keep", NANO.n_layer).streaming(range(NANO.n_layer))


def _streaming_run(change: str, reference_steps: int) -> tuple[torch.nn.Module, torch.nn.Module, HostAdamW]:
    """A reference trained ``reference_steps`` steps with torch.optim.AdamW, and its copy with a
    HostAdamW, streaming its weights already where ``change`` unwraps mid-run."""
    torch.manual_seed(0)
    reference = GPT(NANO)
    model = copy.deepcopy(reference)
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True), range(reference_steps))
    if change == "unwrap mid-run":
        ooc.wrap(model, _streamed_plan(), backend="cpu")
    return reference, model, HostAdamW(model.parameters(), lr=1e-2, model=model)


def _change_streaming(model: torch.nn.Module, change: str) -> None:
    if change == "unwrap mid-run":
        ooc.unwrap(model)
    else:
        ooc.wrap(model, _streamed_plan(), backend="cpu")


def _rebuilt_as_advised(model: torch.nn.Module, opt: HostAdamW) -> HostAdamW:
    """The advice after a change of streaming: a new HostAdamW that takes over the old one's state."""
    state = opt.state_dict()
    opt.close()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
    opt.load_state_dict(state)
    return opt


def _assert_same_weights(reference: torch.nn.Module, model: torch.nn.Module, opt: HostAdamW) -> None:
    opt.synchronize()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("change", ["wrap after the optimizer", "unwrap mid-run"])
def test_streaming_changed_under_a_live_optimizer_is_refused_and_the_advice_works(change: str) -> None:
    # The optimizer laid out its masters for the weights' homes when built; a streaming plan
    # installed (or removed) afterwards made it update copies the model no longer read, and the
    # weights drifted from torch.optim.AdamW's without a word.
    reference, model, opt = _streaming_run(change, reference_steps=4)
    try:
        _train(model, opt, range(2))
        _change_streaming(model, change)
        with pytest.raises(OocError, match="Build the HostAdamW after ooc.wrap"):
            model(*gpt_batch(batch=2, seq=16, seed=2))
        opt = _rebuilt_as_advised(model, opt)
        _train(model, opt, range(2, 4))
        _assert_same_weights(reference, model, opt)
    finally:
        opt.close()
        if ooc.is_wrapped(model):
            ooc.unwrap(model)


@pytest.mark.parametrize("change", ["wrap after the optimizer", "unwrap mid-run"])
def test_streaming_changed_right_after_a_step_waits_for_its_updates(change: str, monkeypatch) -> None:
    # NOTE [weights move at rest]: step() returns with its updates on their way; ooc.wrap copied the
    # streamed weights to the host from before them (ooc.unwrap: back to the device), so the run
    # rebuilt as the advice says went on from other weights than torch.optim.AdamW's (a CI flake;
    # here each update is slowed so that every one is still in flight).
    import time

    import ooc.optim.stages as stages

    real = stages.adamw

    def slow(*args, **kwargs) -> None:
        time.sleep(0.02)
        real(*args, **kwargs)

    reference, model, opt = _streaming_run(change, reference_steps=3)
    try:
        _train(model, opt, range(1))
        opt.synchronize()
        monkeypatch.setattr(stages, "adamw", slow)
        _train(model, opt, range(1, 2))  # returns at once; its updates take 0.02 s each
        _change_streaming(model, change)
        monkeypatch.setattr(stages, "adamw", real)
        opt = _rebuilt_as_advised(model, opt)
        _train(model, opt, range(2, 3))
        _assert_same_weights(reference, model, opt)
    finally:
        opt.close()
        if ooc.is_wrapped(model):
            ooc.unwrap(model)


def test_a_failed_host_update_says_how_to_go_on(monkeypatch) -> None:
    # Every later call raised "ooc's host optimizer stopped: <cause>" and nothing said what to do.
    import ooc.optim.stages as stages

    model = GPT(NANO)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)

    def fails(*_args, **_kwargs) -> None:
        raise RuntimeError("host kernel failed")

    monkeypatch.setattr(stages, "adamw", fails)
    try:
        with pytest.raises(PipelineError, match=r"host kernel failed.*close\(\) it, restore .* checkpoint"):
            _train(model, opt, range(1))
            opt.synchronize()
    finally:
        opt.close()
