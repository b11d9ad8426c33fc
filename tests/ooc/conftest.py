"""Op-level profiles shared by the selective-recompute tests (one per test module that asks), and a
record of the forward caches a test's selective blocks made."""

from __future__ import annotations

import pytest
import torch

import ooc
from ooc.models import GPT
from ooc.op_profile import ForwardCache
from tests.helpers import NANO, gpt_batch, image_op_profile, small_resnet


@pytest.fixture(scope="module")
def gpt_profile() -> ooc.scheduler.Profile:
    """The nano GPT's op-level profile."""
    torch.manual_seed(0)
    return ooc.profile(GPT(NANO), gpt_batch(), ops=True, codec_errors=False, min_swap_bytes=1024)


@pytest.fixture(scope="module")
def cnn_profile() -> ooc.scheduler.Profile:
    """:func:`tests.helpers.small_resnet`'s op-level profile."""
    return image_op_profile(small_resnet())


@pytest.fixture
def caches(monkeypatch) -> list[ForwardCache]:  # noqa: ANN001
    """Every ForwardCache that finishes a forward while the test runs, in order."""
    seen: list[ForwardCache] = []
    finish = ForwardCache.finish

    def recorded(self: ForwardCache, out) -> None:  # noqa: ANN001
        finish(self, out)
        seen.append(self)

    monkeypatch.setattr(ForwardCache, "finish", recorded)
    return seen
