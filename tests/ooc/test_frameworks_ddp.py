"""A model wrapped in torch's DistributedDataParallel (as accelerate and transformers.Trainer wrap it on
several processes) under a pipelined HostAdamW."""

from __future__ import annotations

import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from ooc.models import GPT
from ooc.optim import HostAdamW
from ooc.optim.pipeline import PipelineError
from tests.helpers import NANO, gpt_batch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_step_under_ddp(rank: int, world: int, port: int, out: mp.Queue) -> None:
    """One step of each rank's micro-batch; puts (rank, what ``step()`` said)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = GPT(NANO)
        opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
        ddp = DistributedDataParallel(model)
        torch.manual_seed(rank)
        ddp(*gpt_batch(seed=rank))[1].backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the step reset's report of the updates it keeps
            try:
                opt.step()
                out.put((rank, "stepped"))
            except PipelineError as exc:
                out.put((rank, str(exc)))
            opt.close()
    finally:
        dist.destroy_process_group()


def test_gradients_averaged_by_ddp_after_the_pipelined_launch_name_the_cause() -> None:
    """DistributedDataParallel averages the gradients across ranks at the end of the backward, after the
    pipelined updates read each rank's own. ``step()`` refused the step, as it should, but named
    clipping as the likely cause; it now names DDP and the way to train data-parallel with HostAdamW."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = mp.start_processes(_one_step_under_ddp, args=(2, _free_port(), out), nprocs=2, join=False,
                                   start_method="spawn")
    said = dict(out.get(timeout=120) for _ in range(2))
    procs.join(timeout=120)
    for rank in range(2):
        assert "DistributedDataParallel" in said[rank] and "data_parallel=" in said[rank], said[rank]
