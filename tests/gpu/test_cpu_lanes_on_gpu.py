"""On a GPU host, the CPU lanes run where they are meant to run: in a process with CUDA hidden.

tests/conftest.py skips these files (``CPU_LANES``) in a process that sees a GPU: there Triton
compiles for the device (the interpreter lane's CPU tensors cannot go through it), and ``ooc train``
picks NCCL for its two ranks on one GPU. Here they run as on a GPU-less machine, in a pytest
subprocess with ``CUDA_VISIBLE_DEVICES=""`` (so tests/conftest.py sets ``TRITON_INTERPRET=1``
itself, before any kernel is decorated). The kernels' GPU equivalents are the ``gpu``-marked tests
in tests/kernels (compiled Triton against the torch reference) and test_cuda_sanitizer.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CPU_LANES

ROOT = Path(__file__).resolve().parents[2]


def _run_hidden(files: list[str], timeout: float) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", *files],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout, tail


@pytest.mark.gpu
def test_interpreter_lane_with_cuda_hidden() -> None:
    _run_hidden([f for f in CPU_LANES if f.startswith("tests/kernels/")], timeout=600)


@pytest.mark.gpu
@pytest.mark.slow
def test_gloo_data_parallel_with_cuda_hidden() -> None:
    _run_hidden([f for f in CPU_LANES if not f.startswith("tests/kernels/")], timeout=1200)
