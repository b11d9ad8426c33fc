"""The zoo's set-up: one torch thread (CPU reductions then split the same way in every run), and
the torchvision stub when torchvision is missing (timm imports it; the zoo never uses it)."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    if importlib.util.find_spec("torchvision") is None:
        from tests.zoo import torchvision_stub

        torchvision_stub.install()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
