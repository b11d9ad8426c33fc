"""Races between the host, the copy streams and ooc's threads that only a GPU shows, each a test that
failed before its fix: the GPU runs behind the host (CudaBackend's chaos mode spins the copy streams
late on purpose), and every host thread starts on the default stream the training thread's kernels
are queued on.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ooc
from ooc.models import GPT
from tests.gpu.test_cuda_runtime import NANO, cuda_backend
from tests.helpers import gpt_batch

pytestmark = pytest.mark.gpu


def test_weights_written_after_a_streamed_forward_do_not_reach_it() -> None:
    """NOTE [the host copy is released last] in ooc.streaming: a block's release pointed ``p.data`` back
    at the pinned host copy while the block's stream-in copy (spun late) could still be reading it;
    an in-place write after the forward then ran on the host at once and the forward read half-new
    weights."""
    torch.manual_seed(0)
    plain = GPT(NANO).cuda().eval()
    model = copy.deepcopy(plain)
    x, y = (t.cuda() for t in gpt_batch())
    with torch.no_grad():
        expected = plain(x, y)[0]
    backend = cuda_backend(chaos_seed=5, max_sleep_cycles=20_000_000)
    ooc.wrap(model, ooc.Plan.of(["keep"] * 4).streaming([0, 1, 2, 3]), backend=backend)
    try:
        with torch.no_grad():
            logits = model(x, y)[0]
            for p in model.blocks.parameters():
                p.mul_(0.0)  # on the host copy (p.data between uses), at once
        assert torch.equal(logits, expected)
    finally:
        ooc.unwrap(model)

