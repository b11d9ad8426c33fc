"""Data parallel in the corners of a real model: frozen layers, clipping, sharding. Two gloo ranks on
this CPU (the harness of test_distributed_users), against one process that accumulates both ranks'
micro-batches (``accumulate=2``, each loss halved): two ranks halve a sum of two gradients exactly,
so the weights must be equal bit for bit, sharded or not.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ooc.distributed import DataParallel
from ooc.optim import HostAdamW
from tests.ooc.test_distributed_users import _differ, _gathered, _on_ranks

WORLD = 2
STEPS = 3


class Deep(nn.Module):
    """Twenty small layers, two of them frozen: enough gradient norms for the global norm's sum to be
    vectorized. (N, 8) -> (N, 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(20))
        for i in (3, 11):
            self.layers[i].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def _clipped(rank: int, *, world: int, shard: bool = False) -> dict[str, torch.Tensor]:
    """Train ``Deep`` with every step clipped (``max_grad_norm``); ``world`` 1: one process on every
    rank's batch."""
    torch.manual_seed(0)
    model = Deep()
    options: dict[str, Any] = ({"data_parallel": DataParallel(shard=shard, timeout_s=60)} if world > 1
                               else {"accumulate": WORLD})
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, max_grad_norm=1e-3, **options)
    for step in range(STEPS):
        for r in [rank] if world > 1 else range(WORLD):
            x, y = _batch(r, step)
            (F.mse_loss(model(x), y) / (1 if world > 1 else WORLD)).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _frozen_layers_clipped(rank: int) -> dict[str, list[str]]:
    one = _clipped(rank, world=1)
    return {name: sorted({k for w in _gathered(_clipped(rank, world=WORLD, shard=shard)) for k in _differ(one, w)})
            for name, shard in (("unsharded", False), ("sharded", True))}


def test_frozen_layers_clip_as_one_process_sharded_or_not() -> None:
    """A model with frozen layers passed whole to the optimizer (``model.parameters()``), clipped by
    ``max_grad_norm``: sharded, the global norm stacked a zero for every parameter without a gradient,
    where ``clip_grad_norm_`` (and the unsharded path) stack only the gradients that exist; the sum of
    the stack is vectorized, so the zeros moved the other norms to other lanes, the clip factor came
    out a rounding apart, and the sharded weights parted from one process's (and the unsharded run's)
    from the first step."""
    for rank, found in enumerate(_on_ranks(_frozen_layers_clipped, WORLD)):
        assert found == {"unsharded": [], "sharded": []}, (rank, found)
