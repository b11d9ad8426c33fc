"""The runtime under autograd patterns its own tests did not try (issue 12, an adversarial pass):
each either equals plain PyTorch bit for bit and returns every byte, or raises a clear error."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import ooc
from ooc.models import GPT
from ooc.runtime import runtime_of
from tests.helpers import NANO, gpt_batch


def _second_backward(model: torch.nn.Module, how: str, seed: int) -> torch.Tensor:
    """Two backwards through one graph: ``retain_graph`` twice, or two losses sharing the graph.
    Returns the loss, which holds the graph (as a loop's ``loss`` variable does until the next one)."""
    torch.manual_seed(seed)  # dropout
    logits, loss = model(*gpt_batch(batch=2, seq=16, seed=seed))
    loss.backward(retain_graph=True)
    (loss if how == "retain" else logits.pow(2).mean()).backward()
    return loss


@pytest.mark.parametrize("how", ["retain", "two-losses"])
@pytest.mark.parametrize("policy", ["keep", "swap", "recompute"])
def test_a_second_backward_through_one_graph_trains_streamed_weights_exactly(policy: str, how: str) -> None:
    # The end-of-backward callback (which hands streamed weights and their gradients back to the
    # host) ran for a pass's first backward only: after the second, the optimizer updated the
    # device copies, which the next release then threw away.
    torch.manual_seed(0)
    plain = GPT(NANO)
    wrapped = copy.deepcopy(plain)
    ooc.wrap(wrapped, ooc.Plan.uniform(policy, NANO.n_layer, min_swap_bytes=0).streaming(range(NANO.n_layer)),
             backend="cpu")
    resident = ooc.memory_report(wrapped).param_bytes  # the parameters outside the chain
    try:
        for model in (plain, wrapped):
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for step in range(3):
                _second_backward(model, how, step)
                opt.step()
                opt.zero_grad()
        for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
            assert torch.equal(a, b), name
        report = ooc.memory_report(wrapped)
        assert report.current_bytes == 0
        assert report.param_bytes == resident  # every streamed block's weights are back on the host
    finally:
        ooc.unwrap(wrapped)


@pytest.mark.parametrize("policy", ["keep", "swap", "recompute"])
def test_the_tracker_returns_to_zero_after_a_second_backward(policy: str) -> None:
    # A recomputed block re-saves its tensors in every backward; those of the second were counted
    # and never freed, so the next step's peak started from them.
    torch.manual_seed(0)
    model = GPT(NANO)
    ooc.wrap(model, ooc.Plan.uniform(policy, NANO.n_layer, min_swap_bytes=0), backend="cpu")
    try:
        torch.manual_seed(0)
        model(*gpt_batch(batch=2, seq=16))[1].backward()
        clean_peak = ooc.memory_report(model).peak_bytes
        loss = _second_backward(model, "retain", 0)
        assert runtime_of(model).tracker.current == 0
        torch.manual_seed(0)
        loss = model(*gpt_batch(batch=2, seq=16))[1]  # the previous graph lives until here
        loss.backward()
        report = ooc.memory_report(model)
        assert (report.current_bytes, report.peak_bytes) == (0, clean_peak)
    finally:
        ooc.unwrap(model)


@pytest.mark.parametrize("after_a_step", [False, True])
@pytest.mark.parametrize("how", ["deepcopy of a block", "torch.save"])
def test_copying_a_wrapped_model_is_a_clear_error(how: str, after_a_step: bool) -> None:
    # Both raised "TypeError: cannot pickle '_thread.lock' object", which names nothing of ooc's.
    # copy.deepcopy(model) of the whole wrapped model gives a plain copy (tests/zoo/test_ema.py).
    torch.manual_seed(0)
    model = GPT(NANO)
    ooc.wrap(model, ooc.Plan.uniform("swap", NANO.n_layer), backend="cpu")
    try:
        if after_a_step:
            model(*gpt_batch(batch=2, seq=16))[1].backward()
        with pytest.raises(ooc.WrapError, match=r"state_dict.*copy\.deepcopy\(model\).*unwrap"):
            copy.deepcopy(model.blocks[0]) if how == "deepcopy of a block" else torch.save(model, io.BytesIO())
        plain = GPT(NANO)
        plain.load_state_dict(model.state_dict())  # what the message proposes works
        model(*gpt_batch(batch=2, seq=16))[1].backward()  # and the wrapped model is unharmed
    finally:
        ooc.unwrap(model)
    copy.deepcopy(model)  # unwrapped, it copies as any module


@pytest.mark.parametrize("kwargs", [
    dict(prefetch=-1, budget="1GiB", sample=True), dict(include_params="no"), dict(check_recompute="yes"),
    dict(hardware=3, budget="1GiB", sample=True),
], ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items() if k in ("prefetch", "include_params",
                                                                           "check_recompute", "hardware")))
def test_wrap_refuses_mistyped_options(kwargs: dict) -> None:
    # prefetch=-1 with a budget raised "IndexError: index -2 is out of bounds"; include_params="no"
    # read as True; hardware=3 was ignored for the CPU preset.
    model = GPT(NANO)
    if kwargs.get("sample"):
        kwargs["sample"] = gpt_batch(batch=2, seq=16)
    with pytest.raises(ooc.WrapError, match=next(k for k in kwargs if k not in ("budget", "sample"))):
        ooc.wrap(model, backend="cpu", **kwargs)
    assert not ooc.is_wrapped(model)


def test_plan_without_a_sample_says_so() -> None:
    with pytest.raises(ooc.WrapError, match="sample"):
        ooc.plan(GPT(NANO), None, budget="1GiB", backend="cpu")
    with pytest.raises(ooc.WrapError, match="prefetch"):
        ooc.plan(GPT(NANO), gpt_batch(batch=2, seq=16), budget="1GiB", backend="cpu", prefetch=-3)


def test_a_torch_func_transform_over_a_wrapped_model_is_a_clear_error() -> None:
    # It failed inside the runtime with "Cannot access data pointer of Tensor that doesn't have storage".
    model = GPT(NANO)
    batch = gpt_batch(batch=2, seq=16)
    ooc.wrap(model, backend="cpu")
    try:
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p: dict) -> torch.Tensor:
            return torch.func.functional_call(model, p, batch)[1]

        with pytest.raises(ooc.WrapError, match="unwrap.*torch.func"):
            torch.func.grad(loss)(params)
        model(*batch)[1].backward()  # the model is unharmed
    finally:
        ooc.unwrap(model)


@pytest.mark.parametrize("planner", ["op-level", "greedy"])
def test_a_budget_below_every_plan_does_not_advise_another_planner(planner: str) -> None:
    """Below the smallest peak any plan reaches, ``optimal`` fits nothing either: the error used to
    say "try planner='optimal'" all the same."""
    from ooc.api import plan_for_profile
    from ooc.scheduler.hardware import preset

    torch.manual_seed(0)
    prof = ooc.profile(GPT(NANO), gpt_batch(batch=2, seq=16), ops=True, codec_errors=False, reps=1, backend="cpu")
    with pytest.raises(ooc.BudgetError) as info:
        plan_for_profile(prof, 1024, hardware=preset("cpu"), planner=planner)
    assert info.value.minimum_bytes > 1024 and "try planner='optimal'" not in str(info.value)
