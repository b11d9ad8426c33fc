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
# Processes the tests start (``ooc train``, spawned ranks) run on one intra-op thread too (NOTE [one
# intra-op thread in tests]); a test that sets OMP_NUM_THREADS itself keeps its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# CPU backends check the CUDA stream-order rules (NOTE [stream-order checker] in ooc.backend.order).
os.environ.setdefault("OOC_CHECK_ORDER", "1")


def _fix_interpreter_index() -> None:
    """NOTE [Triton 3.6 interpreter and NumPy 2.4]
    The interpreter holds a scalar kernel argument (``M`` in ``lowbit_linear._grad_weight_kernel``)
    as a 1-element 1-D array, and Triton 3.6 turns it into a loop bound (``range(0, M, BM)``) with
    ``int(array)``, which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"). Triton 3.7 squeezes the array first (triton-lang/triton#9172; 3.7.1 checked); this does
    the same for Triton < 3.7 (torch 2.11's pin, 3.6.0, on the GPU image), in the interpreter only:
    compiled kernels are untouched, and the kernel keeps its ``for`` loop (a ``while`` would not be
    software-pipelined on a GPU).
    """
    import triton
    from triton.runtime import interpreter

    if tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 7):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_squeezed(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_tensor_squeezed


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_index()


# The CPU lanes: tests that need Triton's interpreter (CPU tensors through @triton.jit kernels) or
# two gloo ranks on the CPU. On a GPU host Triton compiles for the device instead and `ooc train`
# picks NCCL, so there they run in a subprocess with CUDA hidden (tests/gpu/test_cpu_lanes_on_gpu.py).
CPU_LANES = ("tests/kernels/test_quant.py", "tests/kernels/test_lowbit_linear.py", "tests/kernels/test_pack.py",
             "tests/ooc/test_distributed.py", "tests/ooc/test_distributed_variants_a.py",
             "tests/ooc/test_distributed_variants_b.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        cpu_lane = pytest.mark.skip(reason="CPU lane: on a GPU host it runs with CUDA hidden in tests/gpu/test_cpu_lanes_on_gpu.py")
        for item in items:
            if "gpu" not in item.keywords and item.nodeid.split("::")[0] in CPU_LANES:
                item.add_marker(cpu_lane)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _one_intra_op_thread_for_fixtures():
    # Module- and session-scoped fixtures run before the per-test fixture below: one that computes a
    # reference (test_partition_run's eager step) did so on torch's default threads where torch was
    # imported before this file set OMP_NUM_THREADS (a plain ``pytest FILE``; xdist's workers import
    # this file first), and the test, on one thread, then differed from it in the last bits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    # NOTE [one intra-op thread in tests]: the tests' tensors are small, and on CI's two cores torch's
    # second intra-op thread costs more than it gives (test_memory's 768 wrapped steps: 62 ms a step
    # with two threads, 22 ms with one) and competes with ooc's own host threads and spawned ranks.
    # So each test runs on one, as ``torchrun`` (OMP_NUM_THREADS=1) runs a rank, and gets back the
    # count it found: a test that changes it must not change the numerics of the tests after it
    # (reductions on CPU can split work by thread count).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    # Imported here, not at the top: ooc must load after TRITON_INTERPRET is set above.
    from ooc.backend import order

    order.reset()  # the next test's thread starts unwatched (the checker's mode costs per op)
