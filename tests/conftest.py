"""Test set-up: Triton runs in its interpreter when no GPU is present.

TRITON_INTERPRET must be set before any ``@triton.jit`` kernel is decorated, so it is set here, at
collection time, before a test imports ``ooc.kernels``.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# CPU backends check the CUDA stream-order rules (NOTE [stream-order checker] in ooc.backend.order).
os.environ.setdefault("OOC_CHECK_ORDER", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Reductions on CPU can split work by thread count; keep one setting for a whole test.
    yield
    from ooc.backend.order import unwatch_thread

    unwatch_thread()  # the next test's thread starts unwatched (the checker's mode costs per op)
