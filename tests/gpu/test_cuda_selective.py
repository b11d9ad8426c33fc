"""Op-level (selective) plans on CUDA: a recomputed block that caches some of its ops' outputs
trains bit for bit like plain PyTorch on the same GPU, on CudaBackend's real streams and under its
chaos mode, and the tracker holds what the planner's memory rule says.

The CPU lane checks the same on the CPU backend (tests/ooc/test_selective.py); what only a GPU shows
is the CUDA op sequence (fused attention kernels, ``native_dropout`` drawing from the CUDA
generator), caching an op's output while the copy streams run late, and the cache's bytes under the
caching allocator. The profile is measured on this GPU, so its op indices are the CUDA ones.
"""

from __future__ import annotations

import random

import pytest
import torch

import ooc
from ooc.api import plan_for_profile
from ooc.models import GPT
from ooc.scheduler.hardware import preset
from tests.gpu.test_cuda_runtime import NANO, cuda_backend
from tests.helpers import (
    check_selective_step_memory,
    gpt_batch,
    gpt_loss,
    random_selective_plan,
    stable_seed,
    train_side_by_side,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_gpt_profile() -> ooc.scheduler.Profile:
    """The nano GPT's op-level profile, measured on this GPU."""
    torch.manual_seed(0)
    batch = tuple(t.cuda() for t in gpt_batch())
    return ooc.profile(GPT(NANO).cuda(), batch, ops=True, codec_errors=False, min_swap_bytes=1024)


def _batches(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(t.cuda() for t in gpt_batch(seed=s)) for s in range(n)]


def test_the_cuda_profile_has_cacheable_ops(cuda_gpt_profile) -> None:
    assert all(any(op.cacheable for op in block.ops) for block in cuda_gpt_profile.blocks)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("chaos", [False, True])
def test_random_cached_subsets_equal_plain_on_cuda(seed: int, chaos: bool, cuda_gpt_profile) -> None:
    plan = random_selective_plan(cuda_gpt_profile, random.Random(stable_seed("cuda-selective", seed)), "CCcRKS")
    backend = cuda_backend(chaos_seed=seed if chaos else None)
    results = train_side_by_side(lambda: GPT(NANO).cuda(), gpt_loss, _batches(),
                                 lambda m: ooc.wrap(m, plan, backend=backend, check_recompute=seed % 2 == 0))
    assert results == [(True, True, True)] * 2, plan


@pytest.mark.parametrize("seed", range(3))
def test_tracker_counts_the_cache_as_the_planner_models_it_on_cuda(seed: int, cuda_gpt_profile) -> None:
    torch.manual_seed(0)
    model = GPT(NANO).cuda()
    plan = random_selective_plan(cuda_gpt_profile, random.Random(stable_seed("cuda-memory", seed)), "CCRK")
    check_selective_step_memory(model, cuda_gpt_profile, plan, _batches(1)[0], cuda_backend())


def test_the_op_level_planner_on_a_cuda_profile_fits_and_equals_plain(cuda_gpt_profile) -> None:
    keep_all = sum(b.saved_bytes for b in cuda_gpt_profile.blocks)
    plan = plan_for_profile(cuda_gpt_profile, keep_all * 2 // 5, hardware=preset("h100-sxm"), planner="op-level")
    results = train_side_by_side(lambda: GPT(NANO).cuda(), gpt_loss, _batches(),
                                 lambda m: ooc.wrap(m, plan, backend=cuda_backend(chaos_seed=7)))
    assert results == [(True, True, True)] * 2, plan
