"""Wrapped training equals plain PyTorch bit for bit, for every policy, with dropout and chaos."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn

import ooc
from ooc.backend import ChaosConfig, CpuBackend
from ooc.models import GPT, MLPBlock, MLPChain, ResNet
from tests.helpers import NANO, ce_loss, gpt_batch, gpt_loss, stable_seed, train_side_by_side

CHOICES = {"K": ooc.BlockPlan("keep"), "S": ooc.BlockPlan("swap"), "R": ooc.BlockPlan("recompute")}
ALL_81 = ["".join(p) for p in itertools.product("KSR", repeat=4)]


def plan_of(code: str, **kw) -> ooc.Plan:
    blocks = [ooc.BlockPlan("recompute", swap_input=True) if c == "r" else CHOICES[c] for c in code]
    kw.setdefault("min_swap_bytes", 1024)
    return ooc.Plan(blocks=tuple(blocks), name=code, **kw)


@pytest.mark.parametrize("code", ALL_81)
def test_gpt_every_policy_assignment_is_bit_identical_under_chaos(code: str) -> None:
    batches = [gpt_batch(seed=s) for s in range(3)]
    seed = stable_seed(code)
    backend = CpuBackend(chaos=ChaosConfig(seed=seed, max_delay_s=0.001))
    try:
        results = train_side_by_side(lambda: GPT(NANO), gpt_loss, batches, lambda m: ooc.wrap(m, plan_of(code), backend=backend))
    finally:
        backend.close()
    assert results == [(True, True, True)] * 3, f"chaos seed {seed}"


@pytest.mark.parametrize("code", ["KKKK", "SSSS", "RRRR", "rrrr", "SRSR", "rSKR"])
@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_gpt_plain_cpu_backend_and_prefetch_depths(code: str, prefetch: int) -> None:
    batches = [gpt_batch(seed=s) for s in range(3)]
    results = train_side_by_side(
        lambda: GPT(NANO), gpt_loss, batches, lambda m: ooc.wrap(m, plan_of(code, prefetch=prefetch), backend="cpu")
    )
    assert results == [(True, True, True)] * 3


def _cnn_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(3)]


@pytest.mark.parametrize("code", ["KKKKKK", "SSSSSS", "RRRRRR", "rrrrrr", "RSKrSR"])
def test_cnn_with_batchnorm_is_bit_identical_including_running_stats(code: str) -> None:
    backend = CpuBackend(chaos=ChaosConfig(seed=3))
    try:
        results = train_side_by_side(
            lambda: ResNet(widths=(8, 16, 32), depth_per_stage=2), ce_loss, _cnn_batches(),
            lambda m: ooc.wrap(m, plan_of(code), backend=backend),
        )
    finally:
        backend.close()
    assert results == [(True, True, True)] * 3


def _mlp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(3)]


@pytest.mark.parametrize("code", ["KKKK", "SSSS", "RRRR", "rrrr", "KSRr"])
def test_mlp_chain_is_bit_identical(code: str) -> None:
    backend = CpuBackend(chaos=ChaosConfig(seed=5))
    try:
        results = train_side_by_side(
            lambda: MLPChain(32, 64, 4, 10), ce_loss, _mlp_batches(), lambda m: ooc.wrap(m, plan_of(code), backend=backend)
        )
    finally:
        backend.close()
    assert results == [(True, True, True)] * 3


class _RawChain(nn.Module):
    """The first block sees raw data, which does not require grad."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[MLPBlock(32, 64) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x).sum(dim=1)


@pytest.mark.parametrize("code", ["RRR", "rrr", "SSS"])
def test_first_block_on_raw_input_still_gets_parameter_grads(code: str) -> None:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 32, generator=g), torch.randn(16, generator=g)) for _ in range(3)]

    def loss_fn(model, batch):
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    results = train_side_by_side(_RawChain, loss_fn, batches, lambda m: ooc.wrap(m, plan_of(code), backend="cpu"))
    assert results == [(True, True, True)] * 3


def test_two_forwards_before_one_backward() -> None:
    """Gradient accumulation over two graphs alive at once: each keeps its own swapped tensors."""
    torch.manual_seed(0)
    plain = GPT(NANO)
    wrapped = GPT(NANO)
    wrapped.load_state_dict(plain.state_dict())
    ooc.wrap(wrapped, plan_of("SrSK"), backend="chaos")
    (a, b) = gpt_batch(seed=1), gpt_batch(seed=2)
    for model in (plain, wrapped):
        torch.manual_seed(7)
        loss = gpt_loss(model, a) + gpt_loss(model, b)
        loss.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), wrapped.parameters()))


def test_no_grad_forward_passes_through_untouched() -> None:
    model = GPT(NANO).eval()
    x, _ = gpt_batch()
    expected = model(x)[0]
    ooc.wrap(model, plan_of("SRSr"), backend="cpu")
    with torch.no_grad():
        got = model(x)[0]
    assert torch.equal(expected, got)
    assert ooc.memory_report(model).peak_bytes == 0


def test_unwrap_restores_plain_forward() -> None:
    model = GPT(NANO)
    ooc.wrap(model, plan_of("SSRR"), backend="cpu")
    ooc.unwrap(model)
    assert not ooc.is_wrapped(model)
    assert all("forward" not in block.__dict__ for block in model.blocks)
    ooc.wrap(model, plan_of("KKKK"), backend="cpu")  # can be wrapped again
    ooc.unwrap(model)


def test_a_missing_wait_is_caught_by_chaos() -> None:
    """The equivalence tests can fail: a backend that skips the compute-side wait gives wrong grads."""

    class ForgetfulBackend(CpuBackend):
        def wait_compute(self, event) -> None:  # the bug: do not wait for the copy
            return None

    # Chaos alone must catch it; the order checker raises at once (test_stream_order covers that).
    backend = ForgetfulBackend(chaos=ChaosConfig(seed=0, max_delay_s=0.005), check_order=False)
    try:
        results = train_side_by_side(
            lambda: GPT(NANO), gpt_loss, [gpt_batch(seed=0)], lambda m: ooc.wrap(m, plan_of("SSSS"), backend=backend)
        )
    finally:
        backend.synchronize()
        backend.close()
    assert results[0][1] is False


def test_backends_made_by_wrap_are_closed_by_unwrap() -> None:
    import threading

    before = threading.active_count()
    model = GPT(NANO)
    for _ in range(3):
        ooc.wrap(model, plan_of("SSKR"), backend="cpu")
        model(*gpt_batch())[1].backward()
        ooc.unwrap(model)
    assert threading.active_count() == before
    closed = CpuBackend()
    closed.close()
    ooc.wrap(model, plan_of("SSSS"), backend=closed)
    with pytest.raises(RuntimeError, match="closed"):
        model(*gpt_batch())[1].backward()
    ooc.unwrap(model)
