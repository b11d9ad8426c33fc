"""Set-up for the GPU lane (tests/gpu): every test here is marked ``gpu`` and skipped without CUDA.

Bit-for-bit comparisons on a GPU need kernels that give the same bits on every run: cuBLAS does so
with a fixed workspace per stream (``CUBLAS_WORKSPACE_CONFIG``, read when cuBLAS starts, so it is
set here at collection, before any test runs a matmul), and ``use_deterministic_algorithms`` picks
the deterministic kernel wherever torch has one (``warn_only``: an op without one warns rather than
raises; the plain-vs-plain control test in test_cuda_runtime.py then shows whether it mattered).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(autouse=True)
def _deterministic_cuda():
    if not torch.cuda.is_available():
        yield
        return
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.cuda.synchronize()
