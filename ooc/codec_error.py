"""How far each lossy codec moves each block's gradients: measured on the block's own saved tensors.

NOTE [codec error]
A codec's error on a saved tensor says little about the gradient it gives: BatchNorm over a map with
two values per channel normalises the quantisation error of ``x - mean`` up to the size of the signal,
and a tensor reconstructed to 1% moves the block's gradients by 280% (ResNet-18 at 32x32, layer4,
int8). So the profiler measures the gradients themselves. One step of the model, under the leanest
plan, records each block's inputs and the gradient that reaches its outputs; then, block by block, a
single forward of the block is differentiated twice from the recorded output gradient: once with its
saved tensors as they are, once with each one put through the codec (quantized and dequantized by the
kernels the runtime uses, under the runtime's own rule of which storages it compresses). The error is
the relative L2 distance of the two gradients of the block's inputs and parameters, stacked. Both
differentiations use one forward, so dropout masks and every other random draw are the same; the
model's buffers and RNG state are restored by the profiler.

A RECOMPUTE whose swapped input is compressed moves the gradients another way: the block runs again
from the dequantized input, so every tensor it saves moves (a sharp softmax: int8 moved a block's
gradients by 2.3% as a SWAP and 3.5% so). That error is measured apart, with the block run again
from its inputs put through the codec and the first forward's random draws, and recorded under
``codec_error_name(codec, recompute=True)`` (``int8:recompute``), which gates the RECOMPUTE options.

``CODEC_ERROR_BOUND`` (scheduler) is the largest error the planner accepts for a block; a block above
it is never given that codec.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from ooc.rng import GeneratorStates, RngState, generators_in
from ooc.scheduler.codecs import CODECS, SWAP_GROUP_SIZE, codec_error_name
from ooc.scheduler.plan import Codec

_LOST = 1e9
"""The error recorded when a codec's gradient is not finite: the gradient is lost."""


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A detached host copy: the recorded inputs and gradients of every block would otherwise double
    the device memory of the leanest plan, the one profiling runs under."""
    return tensor.detach().to("cpu", copy=tensor.device.type != "cpu")


class _Capture:
    """Each block's first call of a step: its inputs and the gradients of its outputs, on the host."""

    def __init__(self, modules: list[nn.Module]) -> None:
        n = len(modules)
        self.inputs: list[tuple[tuple, dict] | None] = [None] * n
        self.grads: list[list[torch.Tensor | None]] = [[] for _ in range(n)]
        self.outputs: list[list[bool]] = [[] for _ in range(n)]
        self._handles = []
        for i, module in enumerate(modules):
            self._handles.append(module.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(i)))

    def _pre(self, i: int) -> Callable:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.inputs[i] is None and torch.is_grad_enabled():
                keep = lambda t: _to_host(t).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t  # noqa: E731
                self.inputs[i] = (tree_map(keep, args), tree_map(keep, kwargs))
        return hook

    def _post(self, i: int) -> Callable:
        def hook(_module: nn.Module, _args: tuple, output: Any) -> None:
            if self.outputs[i] or not torch.is_grad_enabled():
                return  # a re-run (recompute) of the block: its outputs are not the ones the loss reads
            leaves, _ = tree_flatten(output)
            tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            self.outputs[i] = [True] * len(tensors)
            self.grads[i] = [None] * len(tensors)
            for k, t in enumerate(tensors):
                t.register_hook(lambda g, k=k: self.grads[i].__setitem__(k, _to_host(g)))
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _restored(tensor: torch.Tensor, codec: Codec, skip_ptrs: frozenset[int], min_swap_bytes: int) -> torch.Tensor:
    """``tensor`` as the runtime gives it back after compressing it with ``codec``: its whole storage
    quantized and dequantized, as one flat run of its dtype (``ooc.saved.CompressedStorage``), and the
    view rebuilt on the result; ``tensor`` itself where the runtime does not compress it.

    NOTE [the storage, not the view]
    The runtime compresses a saved tensor's storage, in groups that start at its first element: a
    slice's groups take in the values beside it, a transposed view's run along the storage. Quantizing
    the view alone (``tensor.contiguous()``) measured other groups: a slice beside columns 1000 times
    larger measured 0.2% under int8 where the run moved the gradients by 7%.
    """
    from ooc.kernels.quant import dequantize, quantize

    if not tensor.is_floating_point():
        return tensor
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if not nbytes or storage.data_ptr() in skip_ptrs or nbytes < min_swap_bytes or not CODECS[codec].compresses(nbytes, tensor.dtype):
        return tensor
    flat = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storage, 0, (nbytes // tensor.element_size(),), (1,))
    q = quantize(flat, codec=CODECS[codec].kernel, group_size=SWAP_GROUP_SIZE, check_finite=False)
    return dequantize(q).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


@contextlib.contextmanager
def _through_codec(active: list[Codec | None], skip_ptrs: frozenset[int], min_swap_bytes: int) -> Iterator[None]:
    """Saved-tensor hooks that, while ``active[0]`` names a codec, unpack each saved tensor as the
    runtime gives it back (``_restored``)."""
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        codec = active[0]
        return tensor if codec is None else _restored(tensor, codec, skip_ptrs, min_swap_bytes)

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        yield


class _Draws:
    """What a block's forward draws from, to draw it again: the generators a runtime re-run replays
    (NOTE [generators a re-run replays] in ``ooc.rng``), so the measured re-run differs from the first
    run by the codec alone, as the runtime's does."""

    def __init__(self, module: nn.Module, inputs: tuple[tuple, dict]) -> None:
        leaves = tree_flatten(inputs)[0]
        device = next((t.device for t in leaves if isinstance(t, torch.Tensor)), torch.device("cpu"))
        self.rng = RngState(device)
        self.generators = GeneratorStates(generators_in(leaves, module.modules()))

    def restore(self) -> None:
        self.rng.restore()
        self.generators.restore()


def _grad_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def _output_pairs(output: Any, grads: list[torch.Tensor | None]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each output that requires grad beside its recorded gradient, where the loss reached it."""
    return [(o, g) for o, g in zip(_grad_leaves(output), grads, strict=False) if g is not None]


def _gradients(pairs: list[tuple[torch.Tensor, torch.Tensor]], wrt: list[torch.Tensor]) -> list[torch.Tensor]:
    got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], retain_graph=True, allow_unused=True)
    return [torch.zeros_like(w) if g is None else g for g, w in zip(got, wrt, strict=True)]


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    diff = sum(float((g.double() - w.double()).pow(2).sum()) for g, w in zip(got, want, strict=True))
    norm = sum(float(w.double().pow(2).sum()) for w in want)
    if norm == 0.0:
        return 0.0 if diff == 0.0 else _LOST
    error = (diff / norm) ** 0.5
    return error if error == error and error < _LOST else _LOST


def block_codec_errors(
    module: nn.Module, inputs: tuple[tuple, dict], grads: list[torch.Tensor | None], codecs: list[Codec],
    *, skip_ptrs: frozenset[int], min_swap_bytes: int, recompute: bool = False,
) -> dict[Codec, float]:
    """The relative L2 error, per codec, of the gradients of ``module``'s floating inputs and
    parameters when its saved tensors go through the codec (NOTE [codec error]). ``inputs``: the
    block's ``(args, kwargs)``; ``grads``: the gradient of each of its outputs that requires grad, in
    ``tree_flatten`` order (``None`` where the loss did not reach it).

    ``recompute``: instead, when its inputs go through the codec and it runs again from them, its
    saved tensors kept (a RECOMPUTE whose swapped input is compressed); the re-run draws the random
    numbers the first forward drew (dropout masks), as the runtime's recomputation does."""
    params = [p for p in module.parameters() if p.requires_grad]
    active: list[Codec | None] = [None]
    draws = _Draws(module, inputs)
    with _through_codec(active, skip_ptrs, min_swap_bytes):
        output = module(*inputs[0], **inputs[1])
    pairs, wrt = _output_pairs(output, grads), _grad_leaves(inputs) + params
    if not pairs or not wrt:
        return dict.fromkeys(codecs, 0.0)
    exact = _gradients(pairs, wrt)
    errors = {}
    for codec in codecs:
        if recompute:
            again = tree_map(lambda t: _restored(t.detach(), codec, skip_ptrs, min_swap_bytes).requires_grad_(t.requires_grad)  # noqa: B023
                             if isinstance(t, torch.Tensor) else t, inputs)
            draws.restore()
            got = _gradients(_output_pairs(module(*again[0], **again[1]), grads), _grad_leaves(again) + params)
        else:
            active[0] = codec
            got = _gradients(pairs, wrt)
        errors[codec] = _relative_error(got, exact)
    return errors


def measure_codec_errors(
    modules: list[nn.Module], capture_step: Callable[[], None], codecs: list[Codec], *,
    skip_ptrs: frozenset[int], min_swap_bytes: int, device: torch.device,
) -> list[dict[str, float]]:
    """Per block, the error of each codec (NOTE [codec error]), by its profile name
    (``ooc.scheduler.codecs.codec_error_name``): under a SWAP and under a RECOMPUTE. ``capture_step`` runs one training
    step of the model (forward and backward) during which the blocks' inputs and output gradients are
    recorded on the host; the blocks are then differentiated one at a time on ``device``."""
    capture = _Capture(modules)
    try:
        capture_step()
    finally:
        capture.remove()
    errors = []
    for i, module in enumerate(modules):
        if capture.inputs[i] is None:
            errors.append(dict.fromkeys((codec_error_name(c, recompute=r) for r in (False, True) for c in codecs), 0.0))
            continue
        back = lambda t: t.to(device).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t  # noqa: E731
        inputs = tree_map(back, capture.inputs[i])
        grads = [None if g is None else g.to(device) for g in capture.grads[i]]
        errors.append({
            codec_error_name(codec, recompute=recompute): error
            for recompute in (False, True)
            for codec, error in block_codec_errors(module, inputs, grads, codecs, skip_ptrs=skip_ptrs,
                                                   min_swap_bytes=min_swap_bytes, recompute=recompute).items()
        })
        capture.inputs[i] = None  # one block's inputs at a time beyond the step's own
    return errors
