"""HostAdamW on CUDA (pageable masters, pinned transfer buffers from the host arena, gradient copies
on the D2H stream, new weights back on the H2D stream, CUDA events between them) against
torch.optim.AdamW.

What is compared, bit for bit: the reference runs the same model copy on the same GPU, copies each
gradient to the host itself (``p.grad.cpu()``), steps ``torch.optim.AdamW(fused=True)`` on fp32
host masters (torch's fused *CPU* kernel, the one HostAdamW runs) and copies the masters back.
torch's fused *CUDA* AdamW rounds differently; it enters only where HostAdamW itself leaves small
parameters on the device (``device_params_below``), and there the reference steps the same CUDA
kernel. Against torch's default CUDA AdamW the weights are held to a stated tolerance instead.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ooc
from ooc.models import GPT
from tests.helpers import gpt_batch

pytestmark = pytest.mark.gpu

STEPS = 4
LR, WD = 1e-2, 0.1
MIXED = ["swap", "recompute", "keep", "swap"]


def _model(dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT("nano").cuda().to(dtype)


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t.cuda() for t in gpt_batch(seed=step * 10 + micro))


def _backward(model: GPT, step: int, micro: int) -> float:
    torch.manual_seed(step * 10 + micro)  # the same dropout masks on both sides
    loss = model(*_batch(step, micro))[1]
    loss.backward()
    return loss.item()


def _train(model: GPT, opt: torch.optim.Optimizer, *, accumulate: int = 1) -> list[float]:
    losses = []
    for step in range(STEPS):
        for micro in range(accumulate):
            losses.append(_backward(model, step, micro))
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return losses


def _reference(model: GPT, *, accumulate: int = 1, clip: float | None = None, device_below: int = 0,
               delayed: bool = False) -> list[float]:
    """AdamW the host way, written out: fp32 host masters, torch's fused CPU kernel."""
    params = list(model.parameters())
    small = [p for p in params if p.numel() < device_below]
    large = [p for p in params if p.numel() >= device_below]
    masters = [p.detach().float().cpu().clone() for p in large]
    host_opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, fused=True)
    device_opt = torch.optim.AdamW(small, lr=LR, weight_decay=WD, fused=True) if small else None
    losses = []
    for step in range(STEPS):
        for micro in range(accumulate):
            losses.append(_backward(model, step, micro))
        for m, p in zip(masters, large):
            m.grad = p.grad.float().cpu()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        with torch.no_grad():
            if delayed:  # the device takes the previous update; this step's lands one step later
                for p, m in zip(large, masters):
                    p.copy_(m)
            host_opt.step()
            if not delayed:
                for p, m in zip(large, masters):
                    p.copy_(m)
        if device_opt is not None:
            device_opt.step()
        model.zero_grad(set_to_none=True)
    if delayed:  # close() puts the last update in (NOTE [the last delayed update at the end] in ooc.optim.pipeline)
        with torch.no_grad():
            for p, m in zip(large, masters):
                p.copy_(m)
    return losses


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


VARIANTS = {  # name: (HostAdamW options, reference options)
    "step": (dict(), dict()),
    "pipelined": (dict(pipeline=True), dict()),
    "accumulate": (dict(pipeline=True, accumulate=2), dict(accumulate=2)),
    "clip": (dict(pipeline=True, max_grad_norm=0.05), dict(clip=0.05)),
    "small-on-device": (dict(pipeline=True, device_params_below=1000), dict(device_below=1000)),
    "delayed": (dict(pipeline=True, delayed_update=True), dict(delayed=True)),
}


@pytest.mark.parametrize("wrap", [None, "calm", "chaos"], ids=["unwrapped", "wrapped", "wrapped-chaos"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_host_adamw_on_cuda_equals_the_host_reference(variant: str, wrap: str | None) -> None:
    from ooc.backend.cuda import CudaBackend, CudaChaosConfig
    from ooc.optim import HostAdamW

    options, ref_options = VARIANTS[variant]
    options = dict(options)
    plain = _model()
    model = copy.deepcopy(plain)
    backend = CudaBackend(chaos=CudaChaosConfig(seed=4) if wrap == "chaos" else None)
    if wrap is not None:
        ooc.wrap(model, ooc.Plan.of(MIXED, min_swap_bytes=4096), backend=backend)
    if options.pop("pipeline", False):
        options["model"] = model
    opt = HostAdamW(model.parameters(), lr=LR, weight_decay=WD, backend=backend, **options)
    try:
        losses = _train(model, opt, accumulate=ref_options.get("accumulate", 1))
    finally:
        opt.close()
        if wrap is not None:
            ooc.unwrap(model)
    assert losses == _reference(plain, **ref_options)
    assert _same(model, plain)


@pytest.mark.parametrize("delayed", [False, True], ids=["pipelined", "delayed"])
def test_streamed_weights_with_host_adamw_on_cuda_equal_the_host_reference(delayed: bool) -> None:
    """A streamed parameter's new weights go from the staging buffer into its pinned host copy, a
    copy between host tensors that torch makes on the calling thread at once: with delayed_update
    it came from the grad hook while the block's stream-in copy for its backward could still be
    queued (chaos spins keep it queued), and the backward read the new weights."""
    from ooc.backend.cuda import CudaBackend, CudaChaosConfig
    from ooc.optim import HostAdamW

    plain = _model()
    model = copy.deepcopy(plain)
    backend = CudaBackend(chaos=CudaChaosConfig(seed=4))
    ooc.wrap(model, ooc.Plan.of(MIXED, min_swap_bytes=4096).streaming(range(len(MIXED))), backend=backend)
    opt = HostAdamW(model.parameters(), lr=LR, weight_decay=WD, backend=backend, model=model, delayed_update=delayed)
    try:
        losses = _train(model, opt)
    finally:
        opt.close()
        ooc.unwrap(model)
    assert losses == _reference(plain, delayed=delayed)
    assert _same(model, plain)


@pytest.mark.parametrize("how", ["synchronize", "state_dict"])
@pytest.mark.parametrize("delayed", [False, True], ids=["pipelined", "delayed"])
def test_training_on_a_side_stream_waits_for_copies_in_a_default_stream_sync_waited_for(delayed: bool, how: str) -> None:
    """NOTE [a gate waits on every stream] in ooc.optim.pipeline: the loop trains under
    ``with torch.cuda.stream(side)`` and calls ``opt.synchronize()`` or ``model.state_dict()`` outside
    it, on the default stream (as ``ckpt.save()`` there does). The gate made the default stream wait for
    the last buckets' copies in and forgot them, so the next forward on ``side`` read the weights
    while the chaos copy stream was still writing them (its destination poisoned to NaN first)."""
    from ooc.backend.cuda import CudaBackend, CudaChaosConfig
    from ooc.optim import HostAdamW

    plain = _model()
    model = copy.deepcopy(plain)
    # Up to ~12 ms per spin, twice per copy: the copies in are in flight when synchronize() returns.
    backend = CudaBackend(chaos=CudaChaosConfig(seed=5, max_sleep_cycles=20_000_000))
    opt = HostAdamW(model.parameters(), lr=LR, weight_decay=WD, backend=backend, model=model, delayed_update=delayed)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the model was made on the default stream
    losses = []
    try:
        for step in range(STEPS):
            with torch.cuda.stream(side):
                losses.append(_backward(model, step, 0))
                opt.step()
                opt.zero_grad()
            if how == "synchronize":  # on the default stream, as ckpt.save() there calls it
                opt.synchronize()
            else:
                model.state_dict()
        with torch.cuda.stream(side):
            opt.synchronize()
        torch.cuda.current_stream().wait_stream(side)
    finally:
        opt.close()
    assert losses == _reference(plain, delayed=delayed)
    assert _same(model, plain)


@pytest.mark.parametrize("delayed", [False, True], ids=["pipelined", "delayed"])
def test_a_clip_after_the_backward_waits_for_the_gradient_copies(delayed: bool) -> None:
    """NOTE [gradients written after the backward]: ``clip_grad_norm_`` right after the backward ran on
    the compute stream while the D2H copies of the last buckets' gradients were still queued (chaos
    spins keep them so), and the update took clipped values for some and not others. The compute
    after the backward now waits for those copies: the update takes the gradients as the backward
    left them, and ``step()`` refuses the change (NOTE [gradients read in the backward])."""
    from ooc.backend.cuda import CudaBackend, CudaChaosConfig
    from ooc.optim import HostAdamW
    from ooc.optim.pipeline import PipelineError

    plain = _model()
    model = copy.deepcopy(plain)
    # Up to ~12 ms per spin, twice per copy: the copies are still queued when the backward ends.
    backend = CudaBackend(chaos=CudaChaosConfig(seed=4, max_sleep_cycles=20_000_000))
    opt = HostAdamW(model.parameters(), lr=LR, weight_decay=WD, backend=backend, model=model, delayed_update=delayed)
    try:
        _backward(model, 0, 0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        with pytest.raises(PipelineError, match="changed between the backward and step"):
            opt.step()
        opt.synchronize()
        masters = [opt.state[p]["master"].clone() for p in model.parameters()]
    finally:
        opt.close()
    expected = [p.detach().float().cpu().clone() for p in plain.parameters()]
    _backward(plain, 0, 0)
    for m, p in zip(expected, plain.parameters()):
        m.grad = p.grad.float().cpu()
    torch.optim.AdamW(expected, lr=LR, weight_decay=WD, fused=True).step()
    assert all(torch.equal(m, e) for m, e in zip(masters, expected))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["step", "pipelined"])
def test_low_precision_parameters_keep_an_fp32_master_on_the_host(dtype: torch.dtype, pipelined: bool) -> None:
    """The device weights are the host fp32 masters rounded to ``dtype`` after every step."""
    from ooc.optim import HostAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 32)).cuda().to(dtype)
    masters = [p.detach().float().cpu().requires_grad_() for p in model.parameters()]
    opt = HostAdamW(model.parameters(), lr=LR, model=model, pipeline=pipelined)
    ref_opt = torch.optim.AdamW(masters, lr=LR, fused=True)
    g = torch.Generator().manual_seed(0)
    try:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 64, generator=g).cuda().to(dtype)).float().square().sum().backward()
            for m, p in zip(masters, model.parameters()):
                m.grad = p.grad.float().cpu()
            opt.step()
            ref_opt.step()
        opt.synchronize()
    finally:
        opt.close()
    assert all(torch.equal(p.detach().cpu(), m.detach().to(dtype)) for p, m in zip(model.parameters(), masters))


def test_close_to_torch_default_cuda_adamw() -> None:
    """torch's default CUDA AdamW (foreach) rounds differently from the fused CPU kernel: after 4
    steps of lr 1e-3 on the nano GPT the weights agree to 1e-5 absolute (the CPU test's bound for
    the CPU foreach kernel, where 5e-7 was observed; not yet observed on a GPU)."""
    from ooc.optim import HostAdamW

    plain = _model()
    model = copy.deepcopy(plain)
    opt = HostAdamW(model.parameters(), lr=1e-3, weight_decay=WD, model=model)
    try:
        _train(model, opt)
    finally:
        opt.close()
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=WD)
    for step in range(STEPS):
        _backward(plain, step, 0)
        ref.step()
        ref.zero_grad()
    assert max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), plain.parameters())) < 1e-5
