"""Measuring a model's blocks: the profile the planner and the simulator consume.

The model runs ``reps`` steps with every block recomputed, so profiling needs no more device memory
than the leanest plan: each block's activations exist only while that block's backward runs. The
byte counts come from the runtime's own tracker, so they follow exactly the accounting the runtime
applies when it later executes a plan (see NOTE [accounting by storage] in ``ooc.saved``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from ooc.backend import Backend, resolve_backend
from ooc.blocks import find_blocks
from ooc.errors import WrapError
from ooc.runtime import _check_trainable, _Timer, install, unwrap
from ooc.scheduler.plan import Plan, Policy
from ooc.scheduler.profile import BlockProfile, Profile, machine_header


def default_loss(output: Any) -> torch.Tensor:
    """The first floating scalar in the output (e.g. ``(logits, loss)``), else the mean of the first
    floating tensor."""
    floats = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise WrapError("the model's output has no floating tensor to differentiate; pass loss_fn=...")
    scalars = [t for t in floats if t.numel() == 1]
    return scalars[0].sum() if scalars else floats[0].float().mean()


def call_model(model: nn.Module, sample: Any) -> Any:
    """``model(sample)``, ``model(*sample)`` for a tuple/list, ``model(**sample)`` for a dict."""
    if isinstance(sample, dict):
        return model(**sample)
    if isinstance(sample, (tuple, list)):
        return model(*sample)
    return model(sample)


class _ModelState:
    """Gradients, buffers and RNG state, so profiling leaves the model as it found it."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.grads = [(p, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
        self.buffers = [(b, b.clone()) for b in model.buffers()]
        self.cpu_rng = torch.get_rng_state()
        self.device = device
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        with torch.no_grad():
            for p, grad in self.grads:
                p.grad = grad
            for b, saved in self.buffers:
                b.copy_(saved)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)


def _bytes(tensors: Any) -> int:
    return sum(t.untyped_storage().nbytes() for t in tree_leaves(tensors) if isinstance(t, torch.Tensor))


def profile(
    model: nn.Module,
    sample: Any,
    *,
    blocks: object = None,
    reps: int = 3,
    loss_fn: Callable[[Any], torch.Tensor] = default_loss,
    backend: str | Backend = "auto",
    min_swap_bytes: int = 4096,
    name: str | None = None,
) -> Profile:
    """Measure per-block forward/backward time (median of ``reps``) and saved/input/output/param bytes.

    ``sample`` is one batch as the model takes it (a tensor, a tuple of args, or a dict of kwargs).
    The model's gradients, buffers and RNG state are restored afterwards.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    _check_trainable(model)
    chain = find_blocks(model, blocks)
    backend_obj = resolve_backend(backend, model)
    plan = Plan.uniform(Policy.RECOMPUTE, len(chain), min_swap_bytes=min_swap_bytes)
    state = _ModelState(model, backend_obj.device)
    outputs = [0] * len(chain)
    handles = [
        m.register_forward_hook(lambda _m, _a, out, i=i: outputs.__setitem__(i, _bytes(out)))
        for i, m in enumerate(chain.modules)
    ]
    runtime = install(model, chain, plan, backend_obj)
    timer = runtime.timer = _Timer(backend_obj, len(chain))
    totals: list[float] = []
    try:
        for rep in range(reps + 1):  # the first run warms up allocators and kernels
            runtime.tracker.log = log = []
            if rep == 1:
                for series in timer.seconds.values():
                    for s in series:
                        s.clear()
            start = time.perf_counter()
            loss = loss_fn(call_model(model, sample))
            loss.backward()
            if backend_obj.device.type == "cuda":
                torch.cuda.synchronize(backend_obj.device)
            totals.append(time.perf_counter() - start)
            del loss
    finally:
        runtime.tracker.log = None
        unwrap(model)
        for h in handles:
            h.remove()
        state.restore()

    def sums(what: str) -> tuple[list[int], list[int]]:
        total, large = [0] * len(chain), [0] * len(chain)
        for kind, block, nbytes in log:
            if kind == what:
                total[block] += nbytes
                if nbytes >= min_swap_bytes:
                    large[block] += nbytes
        return total, large

    saved, swappable = sums("recompute")
    inputs, inputs_swappable = sums("save")
    med = {w: [statistics.median(s) if s else 0.0 for s in series] for w, series in timer.seconds.items()}
    step = statistics.median(totals[1:])
    outside = max(0.0, step - sum(med["forward"]) - sum(med["recompute"]) - sum(med["backward"]))
    block_profiles = []
    for i, module in enumerate(chain.modules):
        params = [p for p in module.parameters()]
        block_profiles.append(
            BlockProfile(
                name=chain.names[i],
                forward_s=med["recompute"][i],
                backward_s=med["backward"][i],
                saved_bytes=saved[i],
                swappable_bytes=swappable[i],
                input_bytes=inputs[i],
                input_swappable_bytes=inputs_swappable[i],
                output_bytes=outputs[i],
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                grad_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
            )
        )
    return Profile(
        blocks=tuple(block_profiles),
        min_swap_bytes=min_swap_bytes,
        outside_forward_s=outside,
        outside_backward_s=0.0,
        model=name or type(model).__name__,
        source="measured",
        machine={**machine_header(), "backend": backend_obj.name, "device": str(backend_obj.device)},
        notes=f"median of {reps} steps after one warm-up; outside_forward_s holds all time outside the chain",
    )
