"""The tracker's counted bytes against the CUDA caching allocator.

The tracker counts the saved activations a plan holds on the device; the allocator sees those
plus everything else (parameter gradients, one block's transient forward/backward tensors, the
logits and the loss, cuBLAS workspaces). So for every plan:

    tracker peak  <=  allocator peak delta  <=  tracker peak + UNTRACKED bound

where the allocator peak delta is ``max_memory_allocated`` during one step minus
``memory_allocated`` before it, and the bound is stated in ``_untracked_bound``. A tracker that
counts bytes the allocator never held fails the left side; one that misses what a plan holds
(a swapped buffer left on the device, a prefetch that lands early) fails the right side.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import ooc
from ooc.models import GPT
from ooc.models.gpt import GPTConfig
from ooc.scheduler import build_schedule

pytestmark = pytest.mark.gpu

MiB = 2**20
# Activations dominate: each block saves ~45 MiB (attention written out: B*H*T*T fp32 matrices).
CFG = GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=4, n_embd=256, dropout=0.1)
BATCH, SEQ = 8, 256
CODES = ["KKKKKK", "SSSSSS", "RRRRRR", "rrrrrr", "KSRrKS", "SSSKKK"]


def _blocks(code: str) -> list[ooc.BlockPlan]:
    table = {"K": "keep", "S": "swap", "R": "recompute"}
    return [ooc.BlockPlan("recompute", swap_input=True) if c == "r" else ooc.BlockPlan(table[c]) for c in code]


@pytest.fixture(scope="module")
def gpt_on_cuda():
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
    batch = (x.cuda(), torch.roll(x, -1, dims=1).cuda())
    from ooc.backend.cuda import CudaBackend

    return model, batch, ooc.profile(model, batch, backend=CudaBackend(), min_swap_bytes=4096)


def _untracked_bound(model: GPT, prof) -> int:  # noqa: ANN001
    """What the allocator may hold that the tracker does not count, at most: the parameter
    gradients, three of the largest block's saved sets (the block running its backward holds its
    own saved tensors, their gradients and a recomputed or prefetched copy), four logits-sized
    tensors (logits, softmax, their gradients), and 64 MiB of cuBLAS workspace and allocator
    rounding."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(b.saved_bytes + b.input_bytes for b in prof.blocks)
    logits = BATCH * SEQ * CFG.vocab_size * 4
    return grads + 3 * largest + 4 * logits + 64 * MiB


def _step(model: GPT, batch, plan: ooc.Plan) -> tuple[int, int, int | None]:  # noqa: ANN001
    """One warm-up step, then one measured: (tracker peak, allocator peak delta, report's cuda max)."""
    from ooc.backend.cuda import CudaBackend

    ooc.wrap(model, plan, backend=CudaBackend())
    try:
        for step in range(2):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if step == 1:
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            torch.manual_seed(step)
            model(*batch)[1].backward()
            torch.cuda.synchronize()
        report = ooc.memory_report(model)
        return report.peak_bytes, torch.cuda.max_memory_allocated() - base, report.cuda_max_allocated
    finally:
        ooc.unwrap(model)
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("code", CODES)
def test_tracker_peak_is_within_the_allocators(gpt_on_cuda, code: str) -> None:
    model, batch, prof = gpt_on_cuda
    tracked, delta, cuda_max = _step(model, batch, ooc.Plan.of(_blocks(code), min_swap_bytes=4096))
    assert cuda_max is not None and cuda_max >= delta
    assert tracked <= delta, f"tracker counts {tracked} B, the allocator's peak rose by only {delta} B"
    assert delta <= tracked + _untracked_bound(model, prof), (
        f"allocator peak delta {delta / MiB:.1f} MiB exceeds tracker {tracked / MiB:.1f} MiB + bound "
        f"{_untracked_bound(model, prof) / MiB:.1f} MiB")


def test_swapping_lowers_the_allocators_peak(gpt_on_cuda) -> None:
    """What the tracker says swapping saves, the allocator saves too (to within one block's set)."""
    model, batch, prof = gpt_on_cuda
    keep_tracked, keep_delta, _ = _step(model, batch, ooc.Plan.of(_blocks("KKKKKK"), min_swap_bytes=4096))
    swap_tracked, swap_delta, _ = _step(model, batch, ooc.Plan.of(_blocks("SSSSSS"), min_swap_bytes=4096))
    largest = max(b.saved_bytes for b in prof.blocks)
    assert keep_delta - swap_delta >= (keep_tracked - swap_tracked) - 2 * largest


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_tracker_equals_the_schedule_on_cuda(gpt_on_cuda, prefetch: int) -> None:
    """The design's accounting test, on CUDA: predicted peak = tracked peak (1% + 1 MiB allowed)."""
    model, batch, prof = gpt_on_cuda
    mismatches = []
    for code in ("".join(p) for p in itertools.product("KSR", repeat=2)):
        plan = ooc.Plan.of(_blocks(code * 3), prefetch=prefetch, min_swap_bytes=4096)
        predicted = build_schedule(plan, prof).peak_bytes
        tracked, _, _ = _step(model, batch, plan)
        if abs(tracked - predicted) > 0.01 * predicted + MiB:
            mismatches.append((code * 3, predicted, tracked))
    assert mismatches == []
