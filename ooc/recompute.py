"""RECOMPUTE: run a block's forward without saving its activations, and re-run it in the backward.

Unlike ``torch.utils.checkpoint``, the one tensor kept (the input) goes through the block's own pack
hook, so it is counted, and swapped when the plan says ``swap_input``. The re-run happens under the
RNG and autocast state of the first run (dropout masks repeat bit for bit), and restores the block's
buffers afterwards, so BatchNorm running statistics are updated once per step, as without ooc.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ooc import nvtx


class RngState:
    """The CPU generator and, for a CUDA block, that device's generator."""

    __slots__ = ("cpu", "cuda", "device")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        outer = RngState(self.device)
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        try:
            yield
        finally:
            torch.set_rng_state(outer.cpu)
            if outer.cuda is not None:
                torch.cuda.set_rng_state(outer.cuda, self.device)


class RecomputeCall:
    """One recomputed call of a block: its arguments' structure and what the re-run needs."""

    def __init__(
        self,
        forward: Callable[..., Any],
        module: torch.nn.Module,
        leaves: list[Any],
        spec: Any,
        device: torch.device,
        recompute_hooks: Callable[[], contextlib.AbstractContextManager],
        range_name: str,
        timer: Callable[[str], contextlib.AbstractContextManager],
    ) -> None:
        self.forward = forward
        self.module = module
        self.leaves = leaves
        self.spec = spec
        self.tensor_slots = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        self.device = device
        self.recompute_hooks = recompute_hooks
        self.range_name = range_name
        self.timer = timer
        self.rng: RngState | None = None
        self.autocast: tuple[bool, torch.dtype] | None = None
        self.out_leaves: list[Any] = []
        self.out_spec: Any = None
        self.out_slots: list[int] = []

    def _call(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.leaves)
        for slot, tensor in zip(self.tensor_slots, tensors):
            leaves[slot] = tensor
        args, kwargs = tree_unflatten(leaves, self.spec)
        return self.forward(*args, **kwargs)

    def first_run(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        self.rng = RngState(self.device)
        kind = self.device.type
        self.autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        with self.timer("forward"):
            out = self._call(tensors)
        # Keep the structure, not the tensors: the inputs are held (or swapped) by save_for_backward only.
        self.leaves = [None if isinstance(v, torch.Tensor) else v for v in self.leaves]
        self.out_leaves, self.out_spec = tree_flatten(out)
        self.out_slots = [k for k, v in enumerate(self.out_leaves) if isinstance(v, torch.Tensor)]
        return tuple(self.out_leaves[k] for k in self.out_slots)

    def rebuild_output(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.out_leaves)
        for slot, tensor in zip(self.out_slots, tensors):
            leaves[slot] = tensor
        self.out_leaves = []  # the outputs live on in the caller; do not pin them here
        return tree_unflatten(leaves, self.out_spec)

    def rerun_and_backward(
        self, inputs: tuple[torch.Tensor, ...], requires_grad: tuple[bool, ...], grads: tuple[torch.Tensor | None, ...]
    ) -> tuple[torch.Tensor | None, ...]:
        detached = tuple(t.detach().requires_grad_(rg) for t, rg in zip(inputs, requires_grad))
        buffers = [b.detach().clone() for b in self.module.buffers()]
        enabled, dtype = self.autocast
        with nvtx.range(self.range_name), self.timer("recompute"):
            with self.rng.restored(), torch.enable_grad(), torch.autocast(self.device.type, dtype, enabled), self.recompute_hooks():
                out = self._call(detached)
        with torch.no_grad():
            # The first run already updated the buffers (BatchNorm statistics) for this step.
            for buffer, saved in zip(self.module.buffers(), buffers):
                buffer.copy_(saved)
        out_leaves, _ = tree_flatten(out)
        outputs, out_grads = [], []
        for slot, grad in zip(self.out_slots, grads):
            tensor = out_leaves[slot]
            if grad is not None and isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                outputs.append(tensor)
                out_grads.append(grad)
        with self.timer("backward"):
            if outputs:
                torch.autograd.backward(outputs, out_grads)
        return tuple(d.grad if rg else None for d, rg in zip(detached, requires_grad))


class RecomputeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: RecomputeCall, anchor: torch.Tensor, *tensors: torch.Tensor):  # noqa: ANN205
        ctx.call = call
        ctx.input_requires_grad = tuple(t.requires_grad for t in tensors)
        outputs = call.first_run(tensors)
        # The only tensors this block keeps; they go through the block's pack hook (kept or swapped).
        ctx.save_for_backward(*tensors)
        ctx.mark_non_differentiable(*[t for t in outputs if not (t.is_floating_point() or t.is_complex())])
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # noqa: ANN205
        inputs = ctx.saved_tensors
        input_grads = ctx.call.rerun_and_backward(inputs, ctx.input_requires_grad, grads)
        return (None, None, *input_grads)


def run_recomputed(
    forward: Callable[..., Any],
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    anchor: torch.Tensor,
    device: torch.device,
    recompute_hooks: Callable[[], contextlib.AbstractContextManager],
    range_name: str,
    timer: Callable[[str], contextlib.AbstractContextManager],
) -> Any:
    """Run ``forward(*args, **kwargs)`` keeping only its tensor arguments for the backward.

    ``anchor`` is a leaf that requires grad, so the outputs require grad even when no input does
    (the first block of a chain often takes raw data): the block's parameters still get gradients.
    """
    leaves, spec = tree_flatten((args, kwargs))
    call = RecomputeCall(forward, module, leaves, spec, device, recompute_hooks, range_name, timer)
    tensors = tuple(leaves[k] for k in call.tensor_slots)
    outputs = RecomputeFunction.apply(call, anchor, *tensors)
    return call.rebuild_output(outputs)
