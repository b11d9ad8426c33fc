"""Checkpoints of device state on CUDA (NOTE [device state copied asynchronously] in ooc.checkpoint):
``save`` copies what no bucket holds from the device without waiting, and the version holds the
values at ``save`` even when the training goes on changing them at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from ooc.checkpoint import MODEL_FILE, Checkpointer

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_buffers_are_saved_as_they_were_at_save(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64)).cuda()
    with torch.no_grad():
        model[1].running_mean.copy_(torch.arange(64.0, device="cuda"))
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            big = torch.tanh(big @ big)  # queue work ahead, so the copy is still in flight when save returns
        model[1].running_mean.add_(big[0, :64] * 0)  # the saved value depends on the queued work
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    ckpt = Checkpointer(tmp_path, model)
    ckpt.save(1)
    with torch.no_grad():
        model[1].running_mean.add_(1.0)  # queued after save()'s copy on the same stream
        model[0].weight.mul_(2.0)
    ckpt.wait()
    fresh = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64)).cuda()
    Checkpointer(tmp_path, fresh).restore(1)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value.cpu(), expected[name]), name
    ckpt.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_buffer_dropped_after_save_is_saved_as_it_was(tmp_path: Path) -> None:
    """NOTE [device state copied asynchronously]: ``save`` on a side stream copies a buffer the model
    allocated on the default stream, and returns before the copy runs (the side stream is held back
    by a spin). The buffer reassigned right after frees its block, which the caching allocator hands
    to the next allocations on the default stream at once unless the copy's stream is recorded on it:
    the version then held what those allocations wrote."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64)).cuda()
    with torch.no_grad():
        model[1].running_mean.copy_(torch.arange(64.0, device="cuda"))
    expected = model[1].running_mean.cpu().clone()
    ckpt = Checkpointer(tmp_path, model)
    ckpt.save(0)  # warms the pinned allocator: save(1)'s copies need no new page-locked memory
    ckpt.wait()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # about a second: save(1)'s copies are queued behind it
        ckpt.save(1)
    model[1].running_mean = torch.zeros(64, device="cuda")  # the saved buffer's last reference goes
    junk = [torch.full((64,), -1.0, device="cuda") for _ in range(256)]  # one of them gets its block
    ckpt.wait()
    ckpt.close()
    del junk
    saved = safetensors.torch.load_file(tmp_path / "step-000000001" / MODEL_FILE)
    assert torch.equal(saved["1.running_mean"], expected)


def test_the_writer_sleeps_while_it_waits_for_the_device_copies(tmp_path: Path) -> None:
    """The writer waits for save()'s device copies on a CUDA event; a default one spin-waits, so the
    writer thread burnt a CPU core (the host optimizer's) for as long as the GPU ran behind the host."""
    import time

    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64)).cuda()
    ckpt = Checkpointer(tmp_path, model)
    ckpt.save(1)  # warms the pinned allocator: save(2)'s copies need no new page-locked memory
    ckpt.wait()
    torch.cuda._sleep(2_000_000_000)  # about a second: save(2)'s copies are queued behind it
    ckpt.save(2)
    wall, cpu = time.perf_counter(), time.process_time()
    ckpt.wait()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    ckpt.close()
    assert wall > 0.3, "save() waited for the device itself: nothing left to measure"
    assert cpu < 0.5 * wall, f"{cpu:.2f} s of CPU in {wall:.2f} s of waiting"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_lazy_version_of_training_on_a_side_stream_holds_the_last_update(tmp_path: Path) -> None:
    """NOTE [live device tensors after the gate]: the writer thread read the live weights on its own
    current stream (the default one), while save()'s synchronize() had made only the training's
    stream wait for the last update's H2D copies into them. The chaos copy stream spins before and
    inside each copy, so those copies are still in flight when save() returns. The GPT's buffers are
    not persistent: no copy of a device buffer orders the writer by chance."""
    from ooc.backend.cuda import CudaBackend, CudaChaosConfig
    from ooc.models import GPT
    from ooc.optim import HostAdamW
    from tests.helpers import gpt_batch

    torch.manual_seed(0)
    model = GPT("nano").cuda()
    backend = CudaBackend(chaos=CudaChaosConfig(seed=3, max_sleep_cycles=20_000_000))  # ~12 ms a spin
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, backend=backend)
    ckpt = Checkpointer(tmp_path, model, opt)
    side = torch.cuda.Stream()
    try:
        assert ckpt.lazy
        with torch.cuda.stream(side):
            for step in range(2):
                model(*(t.cuda() for t in gpt_batch(seed=step)))[1].backward()
                opt.step()
                opt.zero_grad()
            ckpt.save(2)
        ckpt.wait()
        torch.cuda.synchronize()
        masters = {name: opt.state[p]["master"].to(p.dtype) for name, p in model.named_parameters()}
    finally:
        ckpt.close()
        opt.close()
    saved = safetensors.torch.load_file(tmp_path / "step-000000002" / MODEL_FILE)
    for name, master in masters.items():
        assert torch.equal(saved[name], master), name  # fp32: a weight is its master after the update


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("delayed", [False, True], ids=["lazy_off", "delayed_update"])
def test_a_version_saved_off_the_training_stream_holds_the_weights_of_save(tmp_path: Path, delayed: bool) -> None:
    """NOTE [weights read on another stream] in ooc.optim.pipeline: without a lazy snapshot ``save``
    copies the live weights to the host on its caller's stream (the default one here, the training
    runs on a side stream) and returns. The next step's copies in (the update's; with
    ``delayed_update`` the launch's, in the backward) waited only for the side stream, so with the
    default stream held back by a spin they overwrote weights the version had not read yet: it held
    the next update's weights. The pinned buffers are warmed by a first save, so that ``save`` itself
    allocates no page-locked memory (which may wait for the device)."""
    from ooc.models import GPT
    from ooc.optim import HostAdamW
    from tests.helpers import gpt_batch

    torch.manual_seed(0)
    model = GPT("nano").cuda()
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, model=model, delayed_update=delayed)
    ckpt = Checkpointer(tmp_path, model, opt, lazy=False)
    side = torch.cuda.Stream()
    expected: dict[str, torch.Tensor] = {}
    try:
        assert not ckpt.lazy
        for step in range(3):
            with torch.cuda.stream(side):
                model(*(t.cuda() for t in gpt_batch(seed=step)))[1].backward()
                opt.step()
                opt.zero_grad()
            if step == 0:
                ckpt.save(0)
                ckpt.wait()
            elif step == 1:
                opt.synchronize()
                torch.cuda.synchronize()
                expected = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
                torch.cuda._sleep(2_000_000_000)  # about a second: save()'s copies are queued behind it
                ckpt.save(1)
        ckpt.wait()
    finally:
        ckpt.close()
        opt.close()
    saved = safetensors.torch.load_file(tmp_path / "step-000000001" / MODEL_FILE)
    for name, value in expected.items():
        assert torch.equal(saved[name], value), name
