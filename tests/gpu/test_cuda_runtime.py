"""The runtime on CUDA: wrapped training equals plain PyTorch on the same GPU bit for bit, for keep,
swap, recompute and streamed plans, every prefetch depth, on CudaBackend's real streams and under
its chaos mode (copy streams spun late, device destinations poisoned with NaN first).

What is compared: both sides run the same CUDA kernels in the same order on the compute stream
(ooc's copies only move bytes), so losses, gradients, buffers and weights must be equal bit for
bit. The first test is the control: two plain runs must agree, else the GPU's kernels are not
deterministic here and every other failure in this file means nothing.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import ooc
from ooc.models import GPT, ResNet
from ooc.models.gpt import GPTConfig
from tests.helpers import ce_loss, gpt_batch, gpt_loss, train_side_by_side

pytestmark = pytest.mark.gpu

NANO = GPTConfig(vocab_size=65, block_size=32, n_layer=4, n_head=2, n_embd=32, dropout=0.1)
CHOICES = {"K": ooc.BlockPlan("keep"), "S": ooc.BlockPlan("swap"), "R": ooc.BlockPlan("recompute")}
ALL_81 = ["".join(p) for p in itertools.product("KSR", repeat=4)]
CODES = ["KKKK", "SSSS", "RRRR", "rrrr", "SRSR", "rSKR"]
SAME = [(True, True, True)] * 3


def plan_of(code: str, **kw) -> ooc.Plan:
    """One letter per block: K keep, S swap, R recompute, r recompute with its input swapped."""
    blocks = [ooc.BlockPlan("recompute", swap_input=True) if c == "r" else CHOICES[c] for c in code]
    kw.setdefault("min_swap_bytes", 1024)
    return ooc.Plan(blocks=tuple(blocks), name=code, **kw)


def cuda_backend(chaos_seed: int | None = None, max_sleep_cycles: int = 1_000_000):
    from ooc.backend.cuda import CudaBackend, CudaChaosConfig

    chaos = None if chaos_seed is None else CudaChaosConfig(seed=chaos_seed, max_sleep_cycles=max_sleep_cycles)
    return CudaBackend(chaos=chaos)


def _gpt() -> GPT:
    return GPT(NANO).cuda()


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(t.cuda() for t in gpt_batch(seed=s)) for s in range(n)]


def test_plain_training_on_this_gpu_is_deterministic() -> None:
    assert train_side_by_side(_gpt, gpt_loss, _batches(), lambda m: m) == SAME


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_gpt_on_cuda_streams_every_prefetch_depth(code: str, prefetch: int) -> None:
    backend = cuda_backend()
    results = train_side_by_side(_gpt, gpt_loss, _batches(), lambda m: ooc.wrap(m, plan_of(code, prefetch=prefetch), backend=backend))
    assert results == SAME


@pytest.mark.parametrize("code", ALL_81)
def test_gpt_every_policy_assignment_under_cuda_chaos(code: str) -> None:
    backend = cuda_backend(chaos_seed=sum(map(ord, code)))
    results = train_side_by_side(_gpt, gpt_loss, _batches(), lambda m: ooc.wrap(m, plan_of(code), backend=backend))
    assert results == SAME


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("prefetch", [0, 3])
def test_prefetch_depths_under_cuda_chaos(code: str, prefetch: int) -> None:
    backend = cuda_backend(chaos_seed=prefetch)
    results = train_side_by_side(_gpt, gpt_loss, _batches(), lambda m: ooc.wrap(m, plan_of(code, prefetch=prefetch), backend=backend))
    assert results == SAME


def _cnn_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, 16, 16, generator=g).cuda(), torch.randint(0, 10, (4,), generator=g).cuda()) for _ in range(3)]


@pytest.mark.parametrize("code", ["KKKKKK", "SSSSSS", "RRRRRR", "rrrrrr", "RSKrSR"])
def test_cnn_with_batchnorm_under_cuda_chaos(code: str) -> None:
    backend = cuda_backend(chaos_seed=3)
    results = train_side_by_side(lambda: ResNet(widths=(8, 16, 32), depth_per_stage=2).cuda(), ce_loss, _cnn_batches(),
                                 lambda m: ooc.wrap(m, plan_of(code), backend=backend))
    assert results == SAME


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_compressed_swap_under_chaos_gives_the_same_bits_as_without(codec: str) -> None:
    """The quantize kernel runs on the compute stream before the copy out: quantization is deterministic,
    so a chaos run that differs from a calm one has a missing wait."""
    if codec == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 e4m3 needs sm_89 or newer")
    s = ooc.BlockPlan("swap", codec=codec)
    r = ooc.BlockPlan("recompute", swap_input=True, codec=codec)
    plan = ooc.Plan.of([r, s, "keep", s], min_swap_bytes=1024, prefetch=1)
    grads = []
    for backend in (cuda_backend(), cuda_backend(chaos_seed=2)):
        torch.manual_seed(0)
        model = _gpt()
        ooc.wrap(model, plan, backend=backend)
        for step, batch in enumerate(_batches(2)):
            torch.manual_seed(step)
            model(*batch)[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        ooc.unwrap(model)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_missing_wait_is_caught_by_cuda_chaos() -> None:
    """The chaos tests can fail: a backend whose compute stream skips the wait on the H2D copy reads
    poisoned (NaN) or half-copied activations."""
    from ooc.backend.cuda import CudaBackend, CudaChaosConfig

    class ForgetfulBackend(CudaBackend):
        def wait_compute(self, event) -> None:  # the bug: compute does not wait for the copy
            return None

    backend = ForgetfulBackend(chaos=CudaChaosConfig(seed=0, max_sleep_cycles=20_000_000))
    results = train_side_by_side(_gpt, gpt_loss, _batches(1), lambda m: ooc.wrap(m, plan_of("SSSS"), backend=backend))
    assert results[0][1] is False


STREAM_POLICIES = {"keep": ["keep"] * 4, "mixed": ["swap", "recompute", "keep", "swap"], "recompute": ["recompute"] * 4}


@pytest.mark.parametrize("policies", STREAM_POLICIES, ids=list(STREAM_POLICIES))
@pytest.mark.parametrize("streamed", [(0, 1, 2, 3), (1, 2), (0, 3)], ids=["all", "middle", "ends"])
@pytest.mark.parametrize("chaos", [False, True], ids=["calm", "chaos"])
def test_weight_streaming_on_cuda(policies: str, streamed: tuple[int, ...], chaos: bool) -> None:
    """Streamed parameters live in pinned host memory between uses, and so do their gradients after
    the backward: losses and gradients are compared on the host, bit for bit, for three steps of
    HostAdamW (the same fused CPU AdamW kernel on both sides; the plain side's masters are host
    copies of its CUDA weights, the streamed side's are the pinned parameters themselves)."""
    from ooc.optim import HostAdamW

    torch.manual_seed(0)
    plain = _gpt()
    model = GPT(NANO).cuda()
    model.load_state_dict(plain.state_dict())
    backend = cuda_backend(chaos_seed=7 if chaos else None)
    ooc.wrap(model, ooc.Plan.of(STREAM_POLICIES[policies], min_swap_bytes=4096).streaming(streamed), backend=backend)
    opts = [HostAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, backend=backend) for m in (plain, model)]
    try:
        for step, batch in enumerate(_batches()):
            losses, grads = [], []
            for m, opt in zip((plain, model), opts):
                torch.manual_seed(step)
                loss = gpt_loss(m, batch)
                loss.backward()
                losses.append(loss.item())
                grads.append([p.grad.cpu() for p in m.parameters()])
                opt.step()
                opt.zero_grad()
            assert losses[0] == losses[1], step
            assert all(torch.equal(a, b) for a, b in zip(*grads)), step
        assert all(torch.equal(p.detach().cpu(), q.detach().cpu()) for p, q in zip(plain.parameters(), model.parameters()))
    finally:
        for opt in opts:
            opt.close()
        ooc.unwrap(model)
