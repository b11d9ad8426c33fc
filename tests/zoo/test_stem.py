"""NOTE [the stem joins the chain]: with a sample, the modules declared before the chain's
containers join it only if a trial forward shows them run once each, in order, before it."""

from __future__ import annotations

import torch
import torch.nn as nn

import ooc
from ooc.blocks import find_blocks


class _Net(nn.Module):
    def __init__(self, order: str) -> None:
        super().__init__()
        self.order = order
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        if order == "declared":
            self.act = nn.ReLU(inplace=True)
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.order == "declared":
            x = self.act(self.b(self.a(x)))
        elif self.order == "swapped":
            x = self.a(self.b(x))
        elif self.order == "twice":
            x = self.b(self.a(self.a(x)))
        elif self.order == "after":
            return self.b(self.layers(self.a(x)))
        return self.layers(x)


def _stem(order: str) -> tuple[str, ...]:
    model = _Net(order)
    names = find_blocks(model, sample=torch.randn(2, 4)).names
    assert find_blocks(model).names == ("layers.0", "layers.1")  # without a sample: as found
    return names[:-2]


def test_siblings_that_run_once_in_order_join_and_in_place_ones_stay_outside() -> None:
    assert _stem("declared") == ("a", "b")  # act is in place: it runs between b and layers.0, outside


def test_the_run_stops_at_a_sibling_out_of_order_twice_or_after() -> None:
    assert _stem("swapped") == ("b",)
    assert _stem("twice") == ("b",)
    assert _stem("after") == ()  # b, the closest, runs after the chain: nothing joins


def test_the_trial_forward_leaves_buffers_and_rng_as_they_were() -> None:
    model = nn.Sequential()
    model.bn = nn.BatchNorm1d(4)
    model.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(3, 4)
    rng = torch.get_rng_state()
    assert find_blocks(model, sample=x).names[0] == "bn"
    assert torch.equal(model.bn.running_mean, torch.zeros(4)) and model.bn.num_batches_tracked.item() == 0
    assert torch.equal(rng, torch.get_rng_state())


def test_a_wrapped_stem_trains_like_plain() -> None:
    torch.manual_seed(0)
    plain = _Net("declared")
    wrapped = _Net("declared")
    wrapped.load_state_dict(plain.state_dict())
    x = torch.randn(3, 4)
    ooc.wrap(wrapped, budget=10**6, sample=x, backend="chaos")
    try:
        for m in (plain, wrapped):
            m(x).square().sum().backward()
    finally:
        ooc.unwrap(wrapped)
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p.grad, q.grad)
