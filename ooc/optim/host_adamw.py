"""AdamW whose fp32 master weights and moments live in host memory (pinned on CUDA).

The device keeps only working copies of the parameters in their own dtype (fp32, bf16 or fp16); each
step brings the gradients to the host, runs torch's fused CPU AdamW kernel on the master weights and
copies the result back. On the CPU backend an fp32 parameter is its own master, so the step is the
fused kernel alone, and results equal ``torch.optim.AdamW(fused=True)`` bit for bit.

Not here yet (issue 5): the per-block pipeline that overlaps these updates with the backward, the
one-step-delayed variant, and sharding across data-parallel ranks.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw

from ooc.errors import OocError
from ooc.scheduler.units import format_bytes


class HostMemoryError(OocError, MemoryError):
    """The host cannot hold the optimizer's state; raised before anything is allocated."""

    def __init__(self, needed: int, available: int) -> None:
        self.needed = needed
        self.available = available
        super().__init__(
            f"HostAdamW needs {format_bytes(needed)} ({needed} bytes) of host memory for fp32 master weights "
            f"and Adam moments, but {format_bytes(available)} ({available} bytes) are available. Free host "
            "memory, or keep part of the model on a device optimizer."
        )


def available_host_bytes() -> int:
    """Memory the kernel reports available now (MemAvailable), else the free physical pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _own_master(p: torch.Tensor) -> bool:
    """A host fp32 parameter is updated in place: it is its own master copy."""
    return p.device.type == "cpu" and p.dtype == torch.float32


class HostAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with its state on the host (LR schedulers and ``state_dict`` work as usual).

    Host memory needed is 8 bytes per parameter for the moments, plus 4 for an fp32 master copy where
    the parameter is not itself a host fp32 tensor; it is checked before anything is allocated.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        tensors = [p for group in self.param_groups for p in group["params"]]
        for p in tensors:
            if not p.is_floating_point():
                raise TypeError(f"HostAdamW optimizes floating-point parameters, got {p.dtype}")
        needed = sum(p.numel() * 4 * (2 if _own_master(p) else 3) for p in tensors)
        available = available_host_bytes()
        if needed > available:
            raise HostMemoryError(needed, available)
        for p in tensors:
            self.state[p] = self._fresh_state(p)

    @staticmethod
    def _host_zeros_like(p: torch.Tensor) -> torch.Tensor:
        return torch.zeros(p.shape, dtype=torch.float32, pin_memory=p.is_cuda)

    def _fresh_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = {
            "step": torch.tensor(0.0),
            "exp_avg": self._host_zeros_like(p),
            "exp_avg_sq": self._host_zeros_like(p),
        }
        if not _own_master(p):
            master = self._host_zeros_like(p)
            master.copy_(p.detach())
            state["master"] = master
        return state

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            masters, grads, exp_avgs, exp_avg_sqs, steps, devices = [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                own = "master" not in state
                masters.append(p if own else state["master"])
                # Gradients to the host in fp32; the copy is synchronous, so the kernel reads whole data.
                grads.append(p.grad if own else p.grad.to("cpu", torch.float32))
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
                devices.append(None if own else p)
            if not masters:
                continue
            beta1, beta2 = group["betas"]
            adamw(masters, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, fused=True, amsgrad=False,
                  beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                  maximize=False)
            for p, master in zip(devices, masters):
                if p is not None:
                    p.copy_(master, non_blocking=p.is_cuda)  # the working copy, in the parameter's dtype
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``Optimizer.load_state_dict``, but the state stays on the host (the base class would move
        it to each parameter's device)."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and key != "step":
                    host = self._host_zeros_like(p)
                    host.copy_(value)
                    state[key] = host
                elif key == "step":
                    state[key] = value.detach().to("cpu", torch.float32)
