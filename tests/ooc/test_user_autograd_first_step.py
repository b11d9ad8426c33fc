"""``wrap(model, budget=...)`` without a sample plans from the first training step: a first step whose
backward leaves blocks out (``backward(inputs=...)``, ``torch.autograd.grad`` with respect to a later
block's parameters) measures nothing of them, and is measured again (NOTE [a measured step's backward
reaches every block] in ``ooc.runtime``)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

import ooc
from ooc.models import GPT
from ooc.runtime import BudgetExceededWarning, runtime_of
from tests.helpers import NANO, gpt_batch

BUDGET = 130_000
"""Bytes: the nano GPT at batch 2 x 16 keeps its last block only; keeping all four takes 339 KiB."""


def _in_part(model: nn.Module, loss: torch.Tensor) -> None:
    loss.backward(inputs=[model.blocks[3].mlp.fc.weight])


def _grad_of_one_block(model: nn.Module, loss: torch.Tensor) -> None:
    (grad,) = torch.autograd.grad(loss, [model.blocks[1].attn.qkv.weight], retain_graph=True)
    model.blocks[1].attn.qkv.weight.grad = grad


def _in_part_then_whole(model: nn.Module, loss: torch.Tensor) -> None:
    _grad_of_one_block(model, loss)
    loss.backward()


FIRST_STEPS: dict[str, Callable[[nn.Module, torch.Tensor], None]] = {
    "backward-inputs": _in_part, "autograd-grad": _grad_of_one_block, "grad-then-backward": _in_part_then_whole}


@pytest.mark.parametrize("first", list(FIRST_STEPS))
def test_a_first_step_whose_backward_leaves_blocks_out_plans_from_a_whole_one(first: str) -> None:
    # The plan was chosen from the first backward's re-runs, which left the blocks before out: they
    # measured as saving nothing, the planner kept every block, and the next steps went over the budget.
    torch.manual_seed(0)
    plain = GPT(NANO)
    wrapped = copy.deepcopy(plain)
    ooc.wrap(wrapped, budget=BUDGET, backend="cpu")
    batch = gpt_batch(batch=2, seq=16)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                for model in (plain, wrapped):
                    model.zero_grad(set_to_none=True)
                    torch.manual_seed(step)  # dropout
                    loss = model(*batch)[1]
                    FIRST_STEPS[first](model, loss) if step == 0 else loss.backward()
                for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
                    assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), (step, name)
        assert not [w for w in caught if issubclass(w.category, BudgetExceededWarning)]
        said = [str(w.message) for w in caught if "did not reach block(s)" in str(w.message)]
        assert len(said) == 1
        plan = runtime_of(wrapped).plan
        assert [b.policy.value for b in plan.blocks] == ["recompute", "recompute", "recompute", "keep"]
        assert ooc.memory_report(wrapped).peak_bytes <= BUDGET
    finally:
        ooc.unwrap(wrapped)


def test_steps_whose_backward_always_leaves_blocks_out_stay_recomputed() -> None:
    torch.manual_seed(0)
    model = GPT(NANO)
    ooc.wrap(model, budget=BUDGET, backend="cpu")
    batch = gpt_batch(batch=2, seq=16)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                _in_part(model, model(*batch)[1])
        assert [str(w.message).count("did not reach block(s) blocks.0, blocks.1, blocks.2 ") for w in caught] == [1]
        assert runtime_of(model).deferred is not None  # no plan chosen: every block recomputed
        assert ooc.memory_report(model).peak_bytes <= BUDGET
    finally:
        ooc.unwrap(model)
