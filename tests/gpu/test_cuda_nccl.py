"""Every DataParallel option over NCCL, one rank in this process (a world_size=1 process group on
a FileStore). With one rank the gradient sum is the gradient itself and the mean divides by 1, so
HostAdamW with ``data_parallel`` must train exactly as HostAdamW without it: losses and weights are
compared bit for bit. What this shows on a GPU that gloo on a CPU cannot: NCCL collectives on CUDA
gradients ordered against the backward's streams (``reduce_on="device"``), the gloo side groups
beside an NCCL default group (``reduce_on="host"``), and the start-up checks over NCCL.
"""

from __future__ import annotations

import copy
import datetime

import pytest
import torch

import ooc
from ooc.models import GPT
from tests.helpers import gpt_batch

pytestmark = pytest.mark.gpu

STEPS = 3
OPTIONS = {  # HostAdamW options besides data_parallel
    "pipelined": dict(pipeline=True),
    "step": dict(),
    "clip": dict(pipeline=True, max_grad_norm=0.05),
    "accumulate": dict(pipeline=True, accumulate=2),
    "delayed": dict(pipeline=True, delayed_update=True),
    "small-on-device": dict(pipeline=True, device_params_below=1000),
}


@pytest.fixture()
def nccl_world(tmp_path):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60),
                            device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _train(model: GPT, opt: torch.optim.Optimizer, accumulate: int) -> list[float]:
    losses = []
    for step in range(STEPS):
        for micro in range(accumulate):
            torch.manual_seed(step * 10 + micro)
            loss = model(*(t.cuda() for t in gpt_batch(seed=step * 10 + micro)))[1]
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return losses


def _run(model: GPT, options: dict, data_parallel, wrapped: bool) -> list[float]:  # noqa: ANN001
    from ooc.optim import HostAdamW

    options = dict(options)
    if wrapped:
        ooc.wrap(model, ooc.Plan.of(["swap", "recompute", "keep", "swap"], min_swap_bytes=4096), backend="cuda")
    if options.pop("pipeline", False):
        options["model"] = model
    opt = HostAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, data_parallel=data_parallel, **options)
    try:
        return _train(model, opt, options.get("accumulate", 1))
    finally:
        opt.close()
        if wrapped:
            ooc.unwrap(model)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("reduce_on", ["auto", "device", "host"])
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_one_rank_nccl_equals_no_data_parallel(nccl_world, shard: bool, reduce_on: str, option: str) -> None:
    from ooc.distributed import DataParallel

    torch.manual_seed(0)
    plain = GPT("nano").cuda()
    model = copy.deepcopy(plain)
    expected = _run(plain, OPTIONS[option], None, wrapped=True)
    got = _run(model, OPTIONS[option], DataParallel(shard=shard, reduce_on=reduce_on), wrapped=True)
    assert got == expected
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


@pytest.mark.parametrize("check", [True, False])
def test_check_and_timeout_options(nccl_world, check: bool) -> None:
    from ooc.distributed import DataParallel

    torch.manual_seed(0)
    plain = GPT("nano").cuda()
    model = copy.deepcopy(plain)
    expected = _run(plain, OPTIONS["pipelined"], None, wrapped=False)
    assert _run(model, OPTIONS["pipelined"], DataParallel(check=check, timeout_s=30.0), wrapped=False) == expected
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


def test_auto_reduces_on_the_device_under_nccl(nccl_world) -> None:
    from ooc.distributed import DataParallel

    assert DataParallel().resolved_reduce_on() == "device"
