"""Compressed swaps under patterns their own tests did not try (an adversarial pass over the codecs):
a non-finite activation is reported by the backward whose graph holds it, whatever other forwards ran
in between, and a finite activation comes back finite."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ooc
from ooc.models import GPT
from ooc.saved import NonFiniteActivationError
from tests.helpers import NANO_NO_DROPOUT, gpt_batch


def _poisoned_gpt() -> tuple[nn.Module, list[bool]]:
    """A nano GPT under an int8 swap of every block whose blocks.1 MLP writes a NaN into its output
    while ``poison[0]`` is set (a forward hook: the weights stay as they are)."""
    torch.manual_seed(0)
    model = GPT(NANO_NO_DROPOUT)
    poison = [False]

    def hook(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        if not poison[0]:
            return None
        out = out.clone()
        out[0, 0, 0] = float("nan")
        return out

    model.blocks[1].mlp.fc.register_forward_hook(hook)
    ooc.wrap(model, ooc.Plan.of([ooc.BlockPlan("swap", codec="int8")] * 4, min_swap_bytes=1024), backend="cpu")
    return model, poison


def test_a_nan_activation_of_the_first_of_two_forwards_is_reported_by_their_backward() -> None:
    # Two forwards, one backward (two micro-batches summed into one loss): the second forward started
    # a new pass, which zeroed the NaN counts of the first while its graph still held the NaN codes,
    # so the backward ran to NaN gradients without a word.
    model, poison = _poisoned_gpt()
    try:
        poison[0] = True
        first = model(*gpt_batch())[1]
        poison[0] = False
        second = model(*gpt_batch(seed=1))[1]
        with pytest.raises(NonFiniteActivationError, match=r"blocks\.1 \("):
            (first + second).backward()
    finally:
        ooc.unwrap(model)


def test_a_clean_forward_after_a_poisoned_one_backwards_on_its_own() -> None:
    # The other order of the same two passes: each backward reads its own forward's counts.
    model, poison = _poisoned_gpt()
    try:
        poison[0] = True
        first = model(*gpt_batch())[1]
        poison[0] = False
        second = model(*gpt_batch(seed=1))[1]
        second.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        with pytest.raises(NonFiniteActivationError, match=r"blocks\.1 \("):
            first.backward()
    finally:
        ooc.unwrap(model)
