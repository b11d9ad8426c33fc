"""T5 under ooc: what is exact, and what is exact only up to the order of a sum (issue 13, item 3).

T5's blocks read tensors that need a gradient from outside their own input, and several blocks
share them: every decoder block's cross-attention reads the encoder output (for keys and values),
and the relative position bias that the first block of each stack computes is read by every later
block of that stack. Under ooc (any plan, keep-all included) the gradients differ from the plain
backward by float rounding (up to about 4e-8 at these sizes, in 40 of the parameters, on both
stacks): autograd sums those shared tensors' gradients in another order. The loss is exact. Models
whose blocks pass each other only the hidden state (every other zoo model: HF decoders pass rotary
cos/sin to every layer, but those need no gradient) are exact bit for bit (test_zoo.py). The README
states this guarantee; a rewrite that makes T5 exact should turn these tests into bit-for-bit ones.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ooc
from tests.zoo.models import MODELS

pytest.importorskip("transformers")
T5 = MODELS["t5"]


def _one_step(plan: ooc.Plan) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    plain = T5.build().train()
    wrapped = copy.deepcopy(plain)
    ooc.wrap(wrapped, plan, backend="chaos")
    batch = T5.batch(0)
    losses = []
    try:
        for model in (plain, wrapped):
            torch.manual_seed(100)
            loss = T5.loss(model, batch)
            loss.backward()
            losses.append(loss.detach())
    finally:
        ooc.unwrap(wrapped)
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in (plain, wrapped)]
    return grads[0], grads[1], (losses[0], losses[1])


@pytest.mark.parametrize("plan", [
    ["keep", "keep", "keep", "keep"],
    ["recompute", "swap", "keep", "recompute"],
    ["keep", "keep", "recompute", "recompute"],
], ids=lambda p: "-".join(p))
def test_loss_exact_and_gradients_a_rounding_apart(plan: list) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, wrapped, (loss_plain, loss_wrapped) = _one_step(ooc.Plan.of(plan, min_swap_bytes=4096))
    assert torch.equal(loss_plain, loss_wrapped)
    for name, grad in plain.items():
        close = torch.allclose(grad, wrapped[name], rtol=1e-5, atol=1e-7)
        assert close, f"{name}: {(grad - wrapped[name]).abs().max().item()} apart, more than rounding"


def test_the_bound_is_not_vacuous() -> None:
    """The plain model against itself is exact, and ooc's difference is bounded above zero only by
    rounding: a gradient scaled by (1 + 1e-4) fails the same check."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, wrapped, _ = _one_step(ooc.Plan.of(["keep"] * 4))
    grad = plain["decoder.block.0.layer.0.SelfAttention.q.weight"]
    assert not torch.allclose(grad, grad * (1 + 1e-4), rtol=1e-5, atol=1e-7)
