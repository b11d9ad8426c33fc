"""Dynamic loss scaling inside :class:`~ooc.optim.HostAdamW`, for fp16 training.

NOTE [loss scaling in the optimizer]
fp16 gradients underflow without a loss scale, and ``torch.amp.GradScaler`` cannot drive a
pipelined HostAdamW: its ``unscale_`` changes the gradients after the updates that the backward
started have read them (``step()`` refuses that), and data-parallel it unscales and checks each
rank's own gradients before they are averaged, so a rank that met an inf alone skipped ``step()``
while the others ran it (their next exchange then waited for it until ``timeout_s``). So HostAdamW
scales itself, with GradScaler's rule and arithmetic: ``opt.scale(loss)`` multiplies the loss by the
scale; the updates wait for ``step()`` (as with ``max_grad_norm``: the decision needs every
gradient); ``step()`` multiplies the averaged gradients by the scale's reciprocal (computed in
fp64, as GradScaler does; those kept on their device, unclipped, the fused kernel divides by the
scale in fp32 instead, as torch.optim.AdamW(fused=True) under a GradScaler: fp16 ones unscaled in
place lost what lay below fp16's normal range), and if any is inf or NaN, on any rank, it skips
the whole step (no weight, moment or step count changes) and multiplies the scale by
``backoff_factor``; after ``growth_interval`` steps without one it multiplies it by
``growth_factor`` (``torch._amp_update_scale_``).
With ``max_grad_norm`` the unscaled gradients are clipped. The scale and its growth count are part
of ``state_dict()["ooc"]``, so a checkpoint resumes with them.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossScale:
    """How HostAdamW scales the loss (``HostAdamW(..., loss_scale=LossScale())``), with
    ``torch.amp.GradScaler``'s parameters and defaults."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"LossScale.{name} must be a number, got {value!r}")
        if not self.init_scale > 0 or self.init_scale == float("inf"):
            raise ValueError(f"LossScale.init_scale must be a finite number > 0, got {self.init_scale}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"LossScale.growth_factor must be > 1 (the scale grows after good steps), got {self.growth_factor}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"LossScale.backoff_factor must be in (0, 1) (the scale shrinks after an overflow), "
                             f"got {self.backoff_factor}")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) or self.growth_interval < 1:
            raise ValueError(f"LossScale.growth_interval must be an int >= 1 (steps), got {self.growth_interval!r}")


class ScaleState:
    """The running scale (a 1-element fp32 host tensor) and the count of steps since it last
    changed; updated by the update thread at the end of each step (``update``)."""

    def __init__(self, config: LossScale) -> None:
        self.config = config
        self.scale = torch.full((1,), float(config.init_scale), dtype=torch.float32)
        self.growth_tracker = torch.zeros((1,), dtype=torch.int32)

    def inverse(self) -> torch.Tensor:
        """The reciprocal of the scale, computed in fp64 as GradScaler does (a 1-element fp32 tensor)."""
        return self.scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        found = torch.full((1,), float(found_inf), dtype=torch.float32)
        torch._amp_update_scale_(self.scale, self.growth_tracker, found, float(self.config.growth_factor),
                                 float(self.config.backoff_factor), int(self.config.growth_interval))

    def state(self) -> dict[str, float | int]:
        return {"scale": float(self.scale.item()), "growth_tracker": int(self.growth_tracker.item())}

    def load(self, saved: dict[str, float | int]) -> None:
        self.scale.fill_(float(saved["scale"]))
        self.growth_tracker.fill_(int(saved["growth_tracker"]))
