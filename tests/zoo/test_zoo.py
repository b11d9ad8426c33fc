"""The zoo (tests/zoo/models.py) trained 3 steps plain and wrapped, under keep/swap/recompute mixes
and a budget: the loss, every gradient and the final state_dict equal plain PyTorch bit for bit
(issue 13). Every model is built from a config; nothing is downloaded."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import ooc
from ooc.blocks import find_blocks
from ooc.runtime import runtime_of
from tests.zoo.models import MODELS, train_side_by_side

EXACT = [name for name in MODELS if name != "t5"]
"""T5's decoder reads the encoder output twice (test_t5.py states and tests what holds for it)."""
MIXES = {  # policies cycled over the chain, backend, whether the chain includes the stem
    "recompute-swap-keep": (["recompute", "swap", "keep"], "chaos", False),
    "swap-keep-recompute": (["swap", "keep", "recompute"], "cpu", False),
    "stem-recompute-input-swapped": ([ooc.BlockPlan("recompute", swap_input=True), "recompute", "swap"], "chaos", True),
}


def _mix(policies: list, n: int) -> ooc.Plan:
    return ooc.Plan.of([policies[i % len(policies)] for i in range(n)], min_swap_bytes=4096)


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("model", EXACT)
def test_mix_equals_plain(model: str, mix: str) -> None:
    zoo = MODELS[model]
    policies, backend, stem = MIXES[mix]

    def wrap(m: nn.Module) -> None:
        chain = find_blocks(m, sample=zoo.sample(zoo.batch(0)) if stem else None)
        ooc.wrap(m, _mix(policies, len(chain)), blocks=list(chain.modules), backend=backend)

    train_side_by_side(zoo, wrap)


@pytest.mark.parametrize("model", EXACT)
def test_budget_from_a_sample_equals_plain(model: str) -> None:
    """``wrap(budget=..., sample=...)``: the chain includes the stem (NOTE [the stem joins the chain])."""
    zoo = MODELS[model]
    sample = zoo.sample(zoo.batch(0))

    def wrap(m: nn.Module) -> None:
        saved = ooc.describe(copy.deepcopy(m), sample).saved_bytes  # a copy: its forward updates BatchNorm statistics
        ooc.wrap(m, budget=3 * saved // 4, sample=sample, backend="chaos")
        chosen = runtime_of(m).plan
        assert len({b.label() for b in chosen.blocks}) >= 2, f"the budget should force a mix:\n{chosen}"

    train_side_by_side(zoo, wrap)


@pytest.mark.parametrize("model", ["llama-eager", "gpt_neox-sdpa", "bert", "timm-resnet18", "timm-convnext"])
def test_budget_from_the_first_step_equals_plain(model: str) -> None:
    """``wrap(budget=...)`` without a sample: the first step runs every block recomputed and is
    measured, the plan takes over from the second (the README's first example)."""
    zoo = MODELS[model]
    sample = zoo.sample(zoo.batch(0))

    def wrap(m: nn.Module) -> None:
        c = copy.deepcopy(m)
        report = ooc.describe(c, sample, blocks=list(find_blocks(c).modules))  # the chain as found: no sample, no stem
        ooc.wrap(m, budget=int(0.75 * report.saved_bytes * report.chosen.saved_share), backend="chaos")

    def check(m: nn.Module) -> None:
        chosen = runtime_of(m).plan
        assert len({b.label() for b in chosen.blocks}) >= 2, f"the budget should force a mix:\n{chosen}"

    train_side_by_side(zoo, wrap, check)


@pytest.mark.parametrize("model", list(MODELS))
def test_chain_covers_most_saved_activations(model: str) -> None:
    zoo = MODELS[model]
    torch.manual_seed(0)
    report = ooc.describe(zoo.build().train(), zoo.sample(zoo.batch(0)))
    assert report.chosen.saved_share >= 0.85, str(report)
