"""Sparse gradients (``nn.Embedding(sparse=True)``) inside blocks whose weights are streamed (NOTE [sparse gradients of streamed weights] in ``ooc.streaming``): equal to plain PyTorch bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import ooc

PLANS = {  # no swaps: a process's first swap imports the codec kernels (seconds on a loaded CPU)
    "streamed-keep": ooc.Plan.uniform("keep", 4).streaming(range(4)),
    "streamed-mixed": ooc.Plan.of(["recompute", "keep", "keep", "recompute"], min_swap_bytes=0).streaming([0, 2, 3]),
}


class Embedded(nn.Module):
    """``(h (8, 16), ids (8,)) -> (h + fc(tanh(h + embedding(ids))), ids)``; the embedding's gradient is sparse."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 16, sparse=True)
        self.fc = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h + self.fc(torch.tanh(h + self.embedding(ids))), ids


class Chain(nn.Module):
    """Four :class:`Embedded` blocks; ``(h (8, 16), ids (8,)) -> (8, 16)``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Embedded() for _ in range(4)])

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h, ids = block(h, ids)
        return h


@pytest.mark.parametrize("plan", list(PLANS))
def test_sparse_embedding_gradients_accumulate_and_train_as_plain(plan: str) -> None:
    # A streamed block's release copied its gradients to the host through the copy engines' flat bytes,
    # which a sparse tensor has none of: the backward raised torch's NotImplementedError for as_strided.
    torch.manual_seed(0)
    plain = Chain()
    wrapped = copy.deepcopy(plain)
    ooc.wrap(wrapped, PLANS[plan], blocks=list(wrapped.blocks), backend="cpu")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(4)]
    try:
        for model in (plain, wrapped):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(2):
                opt.zero_grad(set_to_none=True)
                for h, ids in batches[2 * step:2 * step + 2]:  # two micro-batches accumulate
                    model(h, ids).square().mean().backward()
                opt.step()
        for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
            assert b.grad.layout == a.grad.layout, name
            assert torch.equal(a.grad.coalesce().to_dense() if a.grad.is_sparse else a.grad,
                               b.grad.coalesce().to_dense() if b.grad.is_sparse else b.grad), name
            assert torch.equal(a, b), name
    finally:
        ooc.unwrap(wrapped)
