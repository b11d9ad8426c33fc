"""An MLP chain: residual Linear-GELU blocks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLPBlock(nn.Module):
    """``x + W2 gelu(W1 LayerNorm(x))``: (..., width) -> (..., width)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPChain(nn.Module):
    """``MLPChain(in_features, width, depth, out_features)(x)``: (N, in_features) -> (N, out_features)."""

    def __init__(self, in_features: int = 32, width: int = 64, depth: int = 4, out_features: int = 10, hidden: int | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, width)
        self.blocks = nn.Sequential(*[MLPBlock(width, hidden or 4 * width) for _ in range(depth)])
        self.out = nn.Linear(width, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))
