"""Races between the host, the copy streams and ooc's threads that only a GPU shows, each a test that
failed before its fix: the GPU runs behind the host (CudaBackend's chaos mode spins the copy streams
late on purpose), and every host thread starts on the default stream the training thread's kernels
are queued on.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import ooc
from ooc.models import GPT
from tests.gpu.test_cuda_runtime import NANO, cuda_backend
from tests.helpers import gpt_batch, gpt_loss

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


def test_the_host_optimizers_threads_queue_on_streams_of_their_own() -> None:
    """NOTE [a stream per ooc thread] in ooc.backend.cuda: the exchange thread queued its work (NCCL
    collectives: a deadlock across ranks that interleave it differently with the training thread's)
    on the default stream, the training thread's. Here an EXCHANGE listener, on that thread, spins
    its current stream for seconds: the training thread's stream must not wait for it."""
    from ooc.optim import HostAdamW
    from ooc.optim.stages import Stage

    torch.manual_seed(0)
    model = GPT(NANO).cuda()
    backend = cuda_backend()
    opt = HostAdamW(model.parameters(), lr=1e-3, model=model, backend=backend)
    queued, spun = threading.Event(), []

    def spin_once(_bucket: int, stage: Stage) -> None:
        if stage is Stage.EXCHANGE and not spun:
            torch.cuda._sleep(4_000_000_000)  # seconds, on this thread's current stream
            spun.append(torch.cuda.Event())
            spun[0].record()
            queued.set()

    opt.stage_listeners.append(spin_once)
    try:
        gpt_loss(model, tuple(t.cuda() for t in gpt_batch())).backward()
        assert queued.wait(30)
        mine = torch.cuda.Event()
        mine.record()  # on the training thread's stream, after the spin was queued
        mine.synchronize()
        assert not spun[0].query(), "the training thread's stream waited for the exchange thread's spin"
        opt.step()
        opt.synchronize()
    finally:
        opt.close()


def _forward_between_a_backward_and_its_rollback(sync: bool) -> torch.Tensor:
    """The logits of a forward run between a backward and ``zero_grad()`` with ``rollback`` (the
    forward reads the step's new weights; the reset copies the old ones back in), the compute stream
    held back so that the forward's kernels run late; ``sync``: wait for them before the reset."""
    from ooc.optim import HostAdamW, UncommittedStepWarning

    torch.manual_seed(0)
    model = GPT(NANO).cuda().eval()
    backend = cuda_backend()
    ooc.wrap(model, ooc.Plan.of(["keep"] * 4), backend=backend)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, backend=backend, rollback=True)
    try:
        batch = tuple(t.cuda() for t in gpt_batch())
        gpt_loss(model, batch).backward()
        torch.cuda._sleep(1_000_000_000)  # the compute stream runs the next forward late
        with pytest.warns(UncommittedStepWarning):
            logits = model(*batch)[0]
        if sync:
            torch.cuda.synchronize()
        opt.zero_grad()  # undoes the step: the old weights go back into the parameters
        opt.synchronize()
        return logits.cpu()
    finally:
        opt.close()
        ooc.unwrap(model)


def test_a_rollback_copies_the_old_weights_in_after_the_forwards_that_read_the_new_ones() -> None:
    """The reset's copies into the parameters waited on no compute event (race (g) in
    tests/ooc/test_stream_order.py): they overwrote the new weights under the forward's late kernels."""
    assert torch.equal(_forward_between_a_backward_and_its_rollback(sync=False),
                       _forward_between_a_backward_and_its_rollback(sync=True))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_a_host_optimizer_without_a_model_copies_on_its_parameters_gpu() -> None:
    """HostAdamW(params on cuda:1) without a model made its backend on cuda:0: the copies' events were
    recorded on cuda:0's streams while the copies ran on cuda:1's, and the host read gradients before
    they landed (tests/ooc/test_bind_thread.py checks the device chosen on any machine)."""
    from ooc.optim import HostAdamW

    g = torch.Generator().manual_seed(0)
    start = torch.randn(1 << 20, generator=g)
    w = start.to("cuda:1").requires_grad_()
    ref = start.clone().requires_grad_()
    opt = HostAdamW([w], lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, fused=True)
    try:
        assert opt.backend.device == torch.device("cuda", 1)
        for _ in range(3):
            grad = torch.randn(1 << 20, generator=g)
            torch.cuda._sleep(50_000_000)  # on the current device, cuda:0: nothing of cuda:1's waits for it
            with torch.cuda.device(1):
                torch.cuda._sleep(50_000_000)  # cuda:1's stream runs the gradient's copy late
                w.grad = grad.to("cuda:1", non_blocking=True)
            ref.grad = grad
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        opt.synchronize()
        assert torch.equal(w.detach().cpu(), ref.detach())
    finally:
        opt.close()
