"""Run a chain cut into stages, each stage out of core under its own plan, on K virtual devices
(NOTE [how the two plans compose] in ``ooc.scheduler.partition.stages``).

Each stage's sub-chain is wrapped by ooc's runtime under its stage's plan, with a backend of its
own (its own memory tracker and copy engines): a virtual device. One step runs the stages in turn:
at each cut the activation is copied to the next device (a detached clone that requires grad),
the loss is taken on the last stage, and the backward runs the stages in reverse, each cut's
gradient copied back as the earlier stage's output gradient. The stages' own activation peaks are
measured by their runtimes, as ``ooc.memory_report`` counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from ooc.api import wrap
from ooc.runtime import memory_report, unwrap
from ooc.scheduler.errors import PlanError
from ooc.scheduler.partition.stages import StagedPlan


@dataclass(frozen=True)
class StagedRun:
    """``loss``: the step's loss; ``activation_peaks``: ``(K,)`` measured peak of saved activations
    per device (0 for an empty stage), to hold against each stage's ``activation_peak``."""

    loss: torch.Tensor
    activation_peaks: tuple[int, ...]


def run_staged(blocks: Sequence[nn.Module], staged: StagedPlan, x: torch.Tensor,
               loss_fn: Callable[[torch.Tensor], torch.Tensor], *, backend: str = "cpu") -> StagedRun:
    """One training step of the chain ``blocks`` (each maps a ``(B, ...)`` tensor to the next
    block's input) on ``x``, stage ``d`` of ``staged`` on virtual device ``d``; the parameters'
    ``.grad`` accumulate as in ``loss_fn(chain(x)).backward()``."""
    if staged.stages[-1].stop != len(blocks):
        raise PlanError(f"the staged plan covers {staged.stages[-1].stop} blocks and the chain has {len(blocks)}; "
                        "plan the stages for this chain")
    parts: list[tuple[int, nn.Sequential]] = []
    for s in staged.stages:
        if s.first == s.stop:
            continue
        if s.plan is None:
            raise PlanError(f"stage {s.device} (blocks {s.first}:{s.stop}) has no plan that fits its device; "
                            "pick stages that fit (stage_chain) or larger devices")
        sub = nn.Sequential(*blocks[s.first:s.stop])
        parts.append((s.device, wrap(sub, s.plan, blocks=list(sub), backend=backend)))
    try:
        inputs, outputs = [], []
        h = x
        for i, (_, sub) in enumerate(parts):
            # The copy a cut makes: the next device's own tensor, a leaf of its part of the graph.
            h = h if i == 0 else h.detach().clone().requires_grad_(True)
            inputs.append(h)
            h = sub(h)
            outputs.append(h)
        loss = loss_fn(h)
        loss.backward()
        for i in range(len(parts) - 2, -1, -1):
            # The gradient copied back over the cut drives the earlier device's backward.
            outputs[i].backward(inputs[i + 1].grad.clone())
        peaks = [0] * len(staged.stages)
        for d, sub in parts:
            peaks[d] = memory_report(sub).peak_bytes
        return StagedRun(loss.detach(), tuple(peaks))
    finally:
        for _, sub in parts:
            unwrap(sub)
