"""Measuring a backend's copy engines and host: the figures a :class:`Hardware` holds."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from ooc.backend import Backend, resolve_backend
from ooc.scheduler.hardware import Hardware, preset


def median_seconds(fn, reps: int, *, warmup: int = 1) -> float:  # noqa: ANN001
    """Median wall time of ``fn()`` over ``reps`` calls after ``warmup`` (first-touch page faults, allocator)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cuda_event_seconds(fn, reps: int) -> float:  # noqa: ANN001
    """Median seconds of ``fn`` on the current CUDA stream, timed by CUDA events, after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()  # the host reads the elapsed time next
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _device_memory(backend: Backend) -> int:
    if backend.device.type == "cuda":
        return torch.cuda.get_device_properties(backend.device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _slowdown_beside(backend: Backend, background: Callable[[], None], reps: int) -> float:
    """How much longer a compute loop takes while another thread runs ``background`` over and over."""
    a = torch.randn(384, 384, device=backend.device)

    def compute() -> None:
        for _ in range(20):
            a @ a
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)

    alone = median_seconds(compute, reps)
    stop = threading.Event()

    def forever() -> None:
        backend.bind_thread()  # this thread's current device is the backend's (a new thread starts on cuda:0)
        while not stop.is_set():
            background()

    worker = threading.Thread(target=forever, daemon=True)
    worker.start()
    try:
        busy = median_seconds(compute, reps)
    finally:
        stop.set()
        worker.join()
    return max(0.0, busy / alone - 1.0)


def _compute_slowdown(backend: Backend, host: torch.Tensor, device: torch.Tensor, reps: int) -> float:
    """How much longer a compute loop takes while the copy engines move bytes."""
    return _slowdown_beside(backend, lambda: backend.copy_d2h(host, device, ()).synchronize(), reps)


def host_contention(backend: Backend, reps: int = 5, *, params: int = 4 * 2**20) -> float:
    """How much longer a compute loop takes while a host thread runs AdamW (fused, ``params``
    fp32 parameters, over and over): the ``host_contention`` of a :class:`Hardware`. Near 0 on a
    GPU (the loop runs on the device); on the CPU backend the two share cores and memory bandwidth."""
    weights = torch.zeros(params)
    weights.grad = torch.ones_like(weights)
    opt = torch.optim.AdamW([weights], lr=1e-3, fused=True)
    return _slowdown_beside(backend, opt.step, reps)


def _copy_issue_seconds(backend: Backend, reps: int) -> float:
    """Compute time lost per copy issued and waited for, beside a loop of small ops (the shape of a
    model's forward): launch and event costs, and on the CPU backend the hand-off to its thread."""
    x = torch.randn(1 << 14, device=backend.device)
    src = backend.device_buffer(1 << 14)
    dst = backend.host_buffer(1 << 14)
    ops = 200

    def small_ops(copy: bool) -> None:
        pending = None
        for _ in range(ops):
            x.mul_(1.0).add_(0.0)
            if copy:
                if pending is not None:
                    backend.wait_compute(pending)
                pending = backend.copy_d2h(dst, src, (backend.record_compute(),))
        if pending is not None:
            backend.wait_compute(pending)
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)

    alone = median_seconds(lambda: small_ops(False), reps)
    with_copies = median_seconds(lambda: small_ops(True), reps)
    return max(0.0, (with_copies - alone) / ops)


def _tiny_gpt(device: torch.device) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """``GPT("tiny")`` on ``device``, seeded, and a 16 x 64 batch of (tokens, next tokens): the model
    the per-op figures are measured on."""
    from ooc.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT("tiny").to(device)
    tokens = torch.randint(0, model.config.vocab_size, (16, 64), generator=torch.Generator().manual_seed(0)).to(device)
    return model, (tokens, torch.roll(tokens, -1, dims=1))


def intercept_plans(profile):  # noqa: ANN001, ANN201
    """What ``op_intercept_s`` is measured with, on ``profile`` (op-level): every block recomputed
    plainly; every block recomputed caching its cheapest replayed op (the dispatch modes run, and
    almost nothing is skipped); and the seconds caching those ops skips, as the cost model prices it.
    Returns ``(plain, selective, skipped_s)``."""
    from dataclasses import replace as with_fields

    from ooc.scheduler.oplevel import rerun_saved_s
    from ooc.scheduler.plan import BlockPlan, Plan, Policy

    cheapest = [min((k for k, op in enumerate(b.ops) if op.cacheable and op.replayed), key=lambda k: b.ops[k].forward_s)
                for b in profile.blocks]
    plain = Plan.uniform("recompute", len(profile))
    selective = with_fields(plain, blocks=tuple(BlockPlan(Policy.RECOMPUTE, cached_ops=(k,)) for k in cheapest))
    return plain, selective, sum(rerun_saved_s(b.ops, (k,)) for b, k in zip(profile.blocks, cheapest))


def _op_intercept_seconds(backend: Backend, reps: int) -> float:
    """``Hardware.op_intercept_s``: what a selectively recomputed block costs per op beyond its ops,
    its forward and its re-run together (ooc's dispatch modes, the cache's bookkeeping), measured
    as the runtime runs it: training steps of a small GPT (``GPT("tiny")``, 16 x 64 tokens) with
    every block recomputed, against the same with each block caching its cheapest op, per op of
    the blocks, less what caching that op skips. The ops of a model's own blocks may cost more or
    less; a toy chain of tiny ops measured a third of a transformer block's figure. On a GPU the
    tiny model's kernels are shorter than their issue, so its steps are host time and the figure is
    the host's (NOTE [host time under the kernels] in ``ooc.scheduler.hardware``)."""
    import ooc

    device = backend.device
    model, batch = _tiny_gpt(device)
    profile = ooc.profile(model, batch, ops=True, codec_errors=False, reps=1, backend=backend)
    plain, selective, skipped = intercept_plans(profile)
    steps = {}
    for name, plan in (("plain", plain), ("selective", selective)):
        wrapped = ooc.wrap(_tiny_gpt(device)[0], plan, backend=backend)

        def one_step(m=wrapped) -> None:
            m(*batch)[1].backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the host times whole steps: wait for their kernels

        steps[name] = median_seconds(one_step, max(reps, 3))
        ooc.unwrap(wrapped)
    ops = sum(len(b.ops) for b in profile.blocks)
    return max(0.0, (steps["selective"] - steps["plain"] + skipped) / ops)


def _op_issue_seconds(backend: Backend, reps: int) -> float:
    """``Hardware.op_issue_s``: host time plain PyTorch takes per op of a training forward, on a GPU
    (0 on the CPU backend, where the host's time is the compute): the tiny GPT's forward, 16 x 64
    tokens, whose kernels are shorter than their issue, timed to its last kernel over the ops it
    dispatches."""
    if backend.device.type != "cuda":
        return 0.0
    from ooc.op_profile import OpCounter

    device = backend.device
    model, batch = _tiny_gpt(device)

    def forward() -> None:
        model(*batch)
        torch.cuda.synchronize(device)  # the host times the forward to its last kernel

    with OpCounter() as counter:
        model(*batch)
    return median_seconds(forward, max(reps, 3)) / max(counter.count, 1)


def calibration_device(spec: str) -> str:
    """Where ``ooc calibrate --backend spec`` measures: ``"auto"`` is the GPU when there is one
    (a GPU host is calibrated for its GPU, not its CPU); ``"cuda"`` the GPU; anything else the CPU."""
    if spec == "cuda" or (spec == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def calibrate(backend: str | Backend = "auto", *, nbytes: int = 64 * 2**20, reps: int = 5) -> Hardware:
    """Measure copy bandwidths (each direction alone and both at once), copy latency, device-to-device
    bandwidth, the host AdamW rate, the compute slowdown under copies, the compute cost of issuing
    one, and the contention between compute and a host update thread, on ``backend``.

    Returns a :class:`Hardware` named ``measured-<backend>``; figures not measured here (dense
    FLOP/s) come from the nearest preset.
    """
    if isinstance(backend, str):
        backend = resolve_backend(backend, torch.nn.Linear(1, 1, device=calibration_device(backend)))
    host = backend.host_buffer(nbytes)
    host2 = backend.host_buffer(nbytes)
    device = backend.device_buffer(nbytes)
    device2 = backend.device_buffer(nbytes)
    tiny_h, tiny_d = backend.host_buffer(4), backend.device_buffer(4)
    host.fill_(1)
    device.fill_(2)
    # Every copy below touches buffers allocated and filled on the compute stream: it must start
    # after that work (the copies' own order is their stream's; each is synchronized before the next).
    ready = (backend.record_compute(),)

    h2d_s = median_seconds(lambda: backend.copy_h2d(device, host, ready).synchronize(), reps)
    d2h_s = median_seconds(lambda: backend.copy_d2h(host, device, ready).synchronize(), reps)

    def both() -> None:
        a = backend.copy_h2d(device2, host2, ready)
        b = backend.copy_d2h(host, device, ready)
        a.synchronize()
        b.synchronize()

    duplex_s = median_seconds(both, reps)
    latency_s = median_seconds(lambda: backend.copy_h2d(tiny_d, tiny_h, ready).synchronize(), reps * 4)

    def d2d() -> None:
        device2.copy_(device)
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)

    d2d_s = median_seconds(d2d, reps)
    params = torch.zeros(nbytes // 4 // 4)
    params.grad = torch.ones_like(params)
    opt = torch.optim.AdamW([params], lr=1e-3, fused=True)
    opt_s = median_seconds(opt.step, reps)
    slowdown = _compute_slowdown(backend, host, device, reps)

    base = preset("cpu" if backend.device.type == "cpu" else "h100-sxm")
    h2d, d2h = nbytes / h2d_s, nbytes / d2h_s
    return replace(
        base,
        name=f"measured-{backend.name}",
        device_memory=_device_memory(backend),
        h2d=h2d,
        d2h=d2h,
        h2d_duplex=min(h2d, nbytes / duplex_s),
        d2h_duplex=min(d2h, nbytes / duplex_s),
        d2d=2 * nbytes / d2d_s,
        host_optimizer=params.numel() * 4 / opt_s,
        copy_latency_s=latency_s,
        compute_slowdown=slowdown,
        copy_issue_s=_copy_issue_seconds(backend, reps),
        op_intercept_s=_op_intercept_seconds(backend, reps),
        op_issue_s=_op_issue_seconds(backend, reps),
        host_runs_ahead=backend.device.type == "cuda",
        host_contention=host_contention(backend, reps),
        source=f"calibrated on {backend!r} with {nbytes} byte copies, median of {reps}",
    )
