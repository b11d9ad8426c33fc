"""A Lightning ``LightningModule`` whose model is ooc-wrapped and whose ``configure_optimizers``
returns ``HostAdamW``.

A small MLP chain trains a few steps on random data on the CPU (nothing is downloaded)::

    python examples/lightning_hostadamw.py
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn as nn

import ooc


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


class Classifier(L.LightningModule):
    def __init__(self, wrapped: bool = True) -> None:
        super().__init__()
        self.net = Net()
        self.wrapped = wrapped
        self.losses: list[float] = []
        if wrapped:
            # min_swap_bytes=0: this toy model's activations are a few KiB each, below the default threshold
            # (256 KiB; a swapped block leaves smaller tensors on the device, each copy costing ~10 us), so
            # the "swap" block would move nothing. A real model's MB-sized activations need no such setting.
            ooc.wrap(self.net, ooc.Plan.of(["recompute", "swap", "keep", "recompute"], min_swap_bytes=0))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.wrapped:
            return ooc.optim.HostAdamW(self.parameters(), lr=1e-2, model=self.net)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


def train(steps: int = 4, wrapped: bool = True) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``steps`` steps; return the losses and the final weights (``wrapped=False``: the same
    module plain, with ``torch.optim.AdamW(fused=True)``, for comparison)."""
    torch.manual_seed(0)
    module = Classifier(wrapped)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8 * steps, 16, generator=g), torch.randint(0, 10, (8 * steps,), generator=g))
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    weights = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    if wrapped:
        ooc.unwrap(module.net)
    return module.losses, weights


if __name__ == "__main__":
    losses, _ = train()
    print("losses:", " ".join(f"{loss:.4f}" for loss in losses))
