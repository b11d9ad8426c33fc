"""The zoo's set-up: the torchvision stub when torchvision is missing (timm imports it; the zoo never
uses it). Its tests run on one torch thread, as every test does (NOTE [one intra-op thread in tests])."""

from __future__ import annotations

import importlib.util

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if importlib.util.find_spec("torchvision") is None:
        from tests.zoo import torchvision_stub

        torchvision_stub.install()

