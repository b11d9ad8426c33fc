"""A captured step run under a placement on K virtual CPU devices (ooc.partition_run): the loss and
every gradient bit for bit those of eager PyTorch, whatever the placement; each device's measured
peak (real storages) equal to the simulator's prediction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ooc.backend.cpu import ChaosConfig
from ooc.backend.order import StreamOrderError
from ooc.models.gpt import GPT, GPTConfig
from ooc.partition_capture import capture_step
from ooc.partition_run import CpuLinks, CudaLinks, _bytes, run_placed
from ooc.scheduler.errors import PlanError
from ooc.scheduler.partition import Devices, Placement, run_methods

CFG = GPTConfig(vocab_size=65, block_size=32, n_layer=1, n_head=2, n_embd=16, dropout=0.0)


@pytest.fixture(scope="module")
def gpt_step():
    torch.manual_seed(0)
    model = GPT(CFG)
    x = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)
    step = capture_step(model, (x, y), repeats=1)
    loss = model(x, y)[1]
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return step, (loss.detach(), *grads)


def _check(run, eager) -> None:
    assert len(run.outputs) == len(eager)
    for got, want in zip(run.outputs, eager):
        assert torch.equal(got, want)
    np.testing.assert_array_equal(run.peak_bytes, run.simulation.peak_bytes)


def test_every_method_bit_identical_with_predicted_peaks(gpt_step) -> None:
    step, eager = gpt_step
    devices = Devices.uniform(3, int(step.graph.total_bytes()))
    copies = 0
    for outcome in run_methods(step.graph, devices):
        run = run_placed(step, outcome.placement, devices)
        _check(run, eager)
        copies += run.copies
    assert copies > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_a_random_placement_is_bit_identical_too(gpt_step, seed: int) -> None:
    step, eager = gpt_step
    device = np.random.default_rng(seed).integers(0, 4, step.graph.n)
    devices = Devices.uniform(4, int(step.graph.total_bytes()))
    run = run_placed(step, Placement.of("random", device, 4, step.graph.n), devices)
    assert run.copies > 100
    _check(run, eager)


def test_a_placement_of_another_graph_is_refused(gpt_step) -> None:
    step, _ = gpt_step
    with pytest.raises(PlanError, match="capture and place it again"):
        run_placed(step, Placement.of("short", np.zeros(3, dtype=np.int64), 2, 3), Devices.uniform(2, 10))


# --- the copies between devices (NOTE [copies between devices] in ooc.partition_run) ---------------


def _random_run(step, links, seed: int = 0, k: int = 3):
    device = np.random.default_rng(seed).integers(0, k, step.graph.n)
    return run_placed(step, Placement.of("random", device, k, step.graph.n),
                      Devices.uniform(k, int(step.graph.total_bytes())), links=links)


def test_copies_under_chaos_and_the_order_checker_are_bit_identical(gpt_step) -> None:
    """Every copy delayed at random and its destination poisoned first: a consumer that read it
    before its event would see NaN; the checker would raise on any unordered access."""
    step, eager = gpt_step
    links = CpuLinks(3, check_order=True, chaos=ChaosConfig(seed=3, max_delay_s=2e-4))
    try:
        run = _random_run(step, links)
    finally:
        links.close()
    assert run.copies > 50
    _check(run, eager)


class _CopyBeforeTheProducer(CpuLinks):
    def copy(self, dst, src, d, after):   # drops the producer's event (step 2)
        return self.backends[d].copy_h2d(_bytes(dst), _bytes(src), ())


class _ConsumerDoesNotWait(CpuLinks):
    def wait(self, d, event) -> None:   # skips step 4
        pass


@pytest.mark.parametrize("broken", [_CopyBeforeTheProducer, _ConsumerDoesNotWait], ids=["no-producer-event", "no-wait"])
def test_a_missing_sync_fails_on_the_cpu(gpt_step, broken) -> None:
    step, _ = gpt_step
    links = broken(3, check_order=True)
    try:
        with pytest.raises(StreamOrderError):
            _random_run(step, links)
    finally:
        links.close()


def test_links_must_join_as_many_devices_as_the_placement(gpt_step) -> None:
    step, _ = gpt_step
    links = CpuLinks(2, check_order=True)
    try:
        with pytest.raises(PlanError, match="links join 2"):
            _random_run(step, links, k=3)
    finally:
        links.close()


def test_cuda_links_need_the_gpus_they_name() -> None:
    with pytest.raises(PlanError, match="GPUs"):
        CudaLinks(2, gpus=[0, 99])


@pytest.mark.gpu
def test_on_gpus_bit_identical_with_predicted_peaks() -> None:
    """cuda:0..K-1 (two devices on one GPU where there is only one, each with its own copy stream):
    an MLP step placed at random equals eager PyTorch on the same GPU bit for bit."""
    import torch.nn as nn

    torch.manual_seed(0)
    gpus = [0, 1] if torch.cuda.device_count() >= 2 else [0, 0]
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    x, y = torch.randn(32, 64), torch.randn(32, 8)

    def loss_fn(out):
        return ((out - y.to(out.device)) ** 2).mean()

    step = capture_step(model, x, loss_fn, repeats=1)
    model = model.to("cuda:0")
    loss = loss_fn(model(x.to("cuda:0")))
    eager = (loss.detach(), *torch.autograd.grad(loss, list(model.parameters())))
    device = np.random.default_rng(0).integers(0, 2, step.graph.n)
    run = run_placed(step, Placement.of("random", device, 2, step.graph.n),
                     Devices.uniform(2, int(step.graph.total_bytes())), links=CudaLinks(2, gpus=gpus))
    assert run.copies > 5
    for got, want in zip(run.outputs, eager, strict=True):
        assert torch.equal(got.to("cuda:0"), want)
    np.testing.assert_array_equal(run.peak_bytes, run.simulation.peak_bytes)


def _eager_and_step(model, x):
    step = capture_step(model, x, repeats=1)
    loss = model(x).mean()
    return step, (loss.detach(), *torch.autograd.grad(loss, list(model.parameters())))


def test_a_strided_view_reaches_its_consumer_with_its_strides() -> None:
    """A slice that crossed devices arrived contiguous: the mean over it summed in another order
    than eager's over the strided view (1 ulp off)."""
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    sliced = nn.Sequential(model, _Slice())
    x = torch.randn(2, 8)
    step, eager = _eager_and_step(sliced, x)
    device = (np.arange(step.graph.n) >= step.graph.index["mean"]).astype(np.int64)
    devices = Devices.uniform(2, int(step.graph.total_bytes()))
    run = run_placed(step, Placement.of("the mean apart", device, 2, step.graph.n), devices)
    _check(run, eager)


class _Slice(torch.nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, :2]


@pytest.mark.parametrize("seed", [0, 1])
def test_tensors_with_dims_of_one_cross_devices(seed: int) -> None:
    """A batch of one: a (1, 1) tensor with a stride other than 1 (``expand``'s 0) could not be
    viewed as bytes to be copied."""
    import torch.nn as nn

    torch.manual_seed(0)
    step, eager = _eager_and_step(nn.Linear(1, 1), torch.randn(1, 1))
    _check(_random_run(step, None, seed=seed, k=2), eager)
