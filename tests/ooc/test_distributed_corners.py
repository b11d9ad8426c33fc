"""Data parallel in the corners of a real model: frozen layers, clipping, sharding. Two gloo ranks on
this CPU (the harness of test_distributed_users), against one process that accumulates both ranks'
micro-batches (``accumulate=2``, each loss halved): two ranks halve a sum of two gradients exactly,
so the weights must be equal bit for bit, sharded or not.
"""

from __future__ import annotations

import datetime
import functools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ooc
from ooc.checkpoint import Checkpointer
from ooc.distributed import DataParallel, WorldError
from ooc.optim import HostAdamW
from tests.ooc.test_distributed_users import _differ, _gathered, _on_ranks

WORLD = 2
STEPS = 3


class Deep(nn.Module):
    """Twenty small layers, two of them frozen: enough gradient norms for the global norm's sum to be
    vectorized. (N, 8) -> (N, 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(20))
        for i in (3, 11):
            self.layers[i].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def _clipped(rank: int, *, world: int, shard: bool = False) -> dict[str, torch.Tensor]:
    """Train ``Deep`` with every step clipped (``max_grad_norm``); ``world`` 1: one process on every
    rank's batch."""
    torch.manual_seed(0)
    model = Deep()
    options: dict[str, Any] = ({"data_parallel": DataParallel(shard=shard, timeout_s=60)} if world > 1
                               else {"accumulate": WORLD})
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, max_grad_norm=1e-3, **options)
    for step in range(STEPS):
        for r in [rank] if world > 1 else range(WORLD):
            x, y = _batch(r, step)
            (F.mse_loss(model(x), y) / (1 if world > 1 else WORLD)).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _frozen_layers_clipped(rank: int) -> dict[str, list[str]]:
    one = _clipped(rank, world=1)
    return {name: sorted({k for w in _gathered(_clipped(rank, world=WORLD, shard=shard)) for k in _differ(one, w)})
            for name, shard in (("unsharded", False), ("sharded", True))}


def test_frozen_layers_clip_as_one_process_sharded_or_not() -> None:
    """A model with frozen layers passed whole to the optimizer (``model.parameters()``), clipped by
    ``max_grad_norm``: sharded, the global norm stacked a zero for every parameter without a gradient,
    where ``clip_grad_norm_`` (and the unsharded path) stack only the gradients that exist; the sum of
    the stack is vectorized, so the zeros moved the other norms to other lanes, the clip factor came
    out a rounding apart, and the sharded weights parted from one process's (and the unsharded run's)
    from the first step."""
    for rank, found in enumerate(_on_ranks(_frozen_layers_clipped, WORLD)):
        assert found == {"unsharded": [], "sharded": []}, (rank, found)


class Small(nn.Module):
    """Three linear layers, each a bucket: (N, 8) -> (N, 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.gelu(self.b(F.gelu(self.a(x)))))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, ranks: list[int]) -> None:
    """Train on the batches of ``ranks`` (each loss over their count)."""
    for step in steps:
        for r in ranks:
            x, y = _batch(r, step)
            (F.mse_loss(model(x), y) / len(ranks)).backward()
        opt.step()
        opt.zero_grad()


def _host_adamw(*, world: int, shard: bool = False) -> tuple[nn.Module, HostAdamW]:
    torch.manual_seed(1)
    model = Small()
    options: dict[str, Any] = ({"data_parallel": DataParallel(shard=shard, timeout_s=60)} if world > 1
                               else {"accumulate": WORLD})
    return model, HostAdamW(model.parameters(), lr=1e-2, model=model, **options)


def _begun_without_ooc_then_sharded(root: str, rank: int) -> list[str]:
    """Two steps of torch's AdamW on both ranks' batches (the same on every rank), loaded into a sharded
    HostAdamW on every rank; two steps, a version saved in ``root``/ckpt, two more steps, the weights
    saved in ``root``/rank{rank}.pt. Returns the parameters whose state this rank held after the load."""
    torch.manual_seed(0)
    begun = Small()
    adamw = torch.optim.AdamW(begun.parameters(), lr=1e-2, fused=True)
    _steps(begun, adamw, range(2), list(range(WORLD)))
    model, opt = _host_adamw(world=WORLD, shard=True)
    model.load_state_dict(begun.state_dict())
    opt.load_state_dict(adamw.state_dict())
    names = {id(p): n for n, p in model.named_parameters()}
    held = sorted(names[id(p)] for p in opt.state)
    ckpt = Checkpointer(Path(root) / "ckpt", model, opt, keep=None, layout={"shard": True})
    _steps(model, opt, range(2, 4), [rank])
    ckpt.save(4)
    _steps(model, opt, range(4, 6), [rank])
    ckpt.close()
    opt.close()
    torch.save(model.state_dict(), Path(root) / f"rank{rank}.pt")  # tensors through the result queue die with the rank
    return held


def test_a_torch_optimizer_state_loaded_sharded_keeps_each_ranks_own(tmp_path: Path) -> None:
    """Training begun with torch's AdamW and resumed data-parallel with a sharded HostAdamW: every rank
    loads the AdamW's ``state_dict()``, which holds every parameter's state. Each rank kept all of it,
    the state of the parameters other ranks own too (never updated there: stale after the first step),
    and a version saved then held two states of each parameter: restored on one process, the run went on
    from the stale moments and parted from the two ranks' without a word."""
    held = _on_ranks(functools.partial(_begun_without_ooc_then_sharded, str(tmp_path)), WORLD)
    names = [n for n, _ in Small().named_parameters()]
    assert sorted(held[0] + held[1]) == sorted(names), held
    model, opt = _host_adamw(world=1)
    ckpt = Checkpointer(tmp_path / "ckpt", model, opt, keep=None)
    assert ckpt.restore().step == 4
    _steps(model, opt, range(4, 6), list(range(WORLD)))
    ckpt.close()
    opt.close()
    assert _differ(torch.load(tmp_path / "rank0.pt"), {k: v.detach() for k, v in model.state_dict().items()}) == []


def _one_rank_builds_without_data_parallel(rank: int) -> str:
    """Rank 1 builds its HostAdamW without ``data_parallel=``; what building rank 0's said, and after
    how long ("built" if nothing). Rank 1 stays alive until rank 0 is done (it is not gone: it never joins)."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        HostAdamW(Small().parameters(), lr=1e-2).close()
        store.wait(["rank 0 done"], datetime.timedelta(seconds=60))
        return ""
    started = time.monotonic()
    try:
        HostAdamW(Small().parameters(), lr=1e-2, data_parallel=DataParallel(timeout_s=2)).close()
        said = "built"
    except WorldError as exc:
        said = str(exc)
    store.set("rank 0 done", "1")
    return f"after {time.monotonic() - started:.0f} s: {said}"


def test_a_rank_that_builds_no_data_parallel_optimizer_is_named_within_the_timeout() -> None:
    """A rank that built its HostAdamW without ``data_parallel=`` (a condition on the rank that differs
    by rank) never makes the process groups the others wait for: they failed after the timeout with
    torch's own error out of ``new_group`` ("DistStoreError: wait timeout after 2000ms, keys:
    /default_pg/0//1//cpu//0/1"), naming neither the optimizer nor what to check."""
    said = _on_ranks(_one_rank_builds_without_data_parallel, WORLD)[0]
    assert "rank 0 waited 2 s (DataParallel.timeout_s) for the other ranks to build their HostAdamW with " \
           "data_parallel=" in said, said
    assert int(said.split()[1]) < 20, said  # the timeout and its torch overhead, never the default group's 30 min


class _BackwardFailed(Exception):
    """Raised by :class:`_FailsInBackward` (a type of its own: ooc's errors are RuntimeErrors too)."""


class _FailsInBackward(torch.autograd.Function):
    """The identity, whose backward raises (an error in a layer's backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise _BackwardFailed("a layer's backward failed")


class _Breakable(Small):
    """:class:`Small` whose backward fails before ``a`` and ``b`` while ``fail`` is set (after ``c``'s
    bucket launched)."""

    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.b(F.gelu(self.a(x))))
        return self.c(_FailsInBackward.apply(h) if self.fail else h)


def _backward_fails_after_a_launch(rank: int) -> str:
    """Rank 1's backward at step 1 raises after the last layer's bucket launched (its exchange began);
    its loop catches the error and calls ``zero_grad()``. What HostAdamW said on each rank."""
    torch.manual_seed(0)
    model = _Breakable()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, data_parallel=DataParallel(timeout_s=10))
    try:
        for step in range(STEPS):
            x, y = _batch(rank, step)
            model.fail = rank == 1 and step == 1
            try:
                F.mse_loss(model(x), y).backward()
            except _BackwardFailed:
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
        opt.close()
    except ooc.OocError as exc:
        return str(exc)
    return "trained"


def test_zero_grad_after_a_backward_that_raised_names_it_not_a_grad_scaler() -> None:
    """Data-parallel, ``zero_grad()`` after a backward that raised once an exchange had begun ends the
    run; its refusal said "zero_grad() without step() after a backward (a torch.amp.GradScaler that
    found an inf or NaN skips step() ...)", sending the user to a GradScaler they never had."""
    said = _on_ranks(_backward_fails_after_a_launch, WORLD)
    assert "lost the other ranks" in said[0], said[0]
    assert "zero_grad() after a backward that did not finish (it raised or was interrupted)" in said[1], said[1]
    assert "cannot agree on a half-done data-parallel step" in said[1] and "GradScaler" not in said[1], said[1]


def _buffer_of_another_size_on_rank_1(rank: int) -> str:
    """Every rank's model has a buffer ``table`` (a positional table, say) sized by a per-rank setting:
    16 rows on rank 0, 32 on rank 1. What building the optimizer said ("built" if nothing)."""
    torch.manual_seed(0)
    model = Small()
    model.register_buffer("table", torch.full((16 * (rank + 1), 8), float(rank)))
    try:
        HostAdamW(model.parameters(), lr=1e-2, model=model, data_parallel=DataParallel(timeout_s=30)).close()
    except WorldError as exc:
        return str(exc)
    return f"built; rank {rank}'s table holds {int((model.table == 0).sum())} of rank 0's values"


def test_buffers_of_another_shape_on_one_rank_are_refused_at_start_up() -> None:
    """Rank 0's buffers are broadcast into every rank's as they lie; the start-up check compared the
    parameters, not the buffers. A buffer larger on rank 1 took rank 0's values in its first rows only
    (the ranks' tables parted without a word); one smaller on rank 1 aborted that rank's process inside
    gloo, without a message."""
    for rank, said in enumerate(_on_ranks(_buffer_of_another_size_on_rank_1, WORLD)):
        assert "rank 1 differs from rank 0 in: buffer names, shapes and dtypes" in said, (rank, said)


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), 0.0, True], ids=["inf", "nan", "zero", "bool"])
def test_a_timeout_that_is_not_a_finite_number_of_seconds_is_refused(timeout_s: float) -> None:
    """An infinite timeout (meant as "never") passed, and HostAdamW then failed out of
    ``datetime.timedelta`` making its process groups ("cannot convert float infinity to integer");
    NaN likewise (it is not <= 0)."""
    with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0"):
        DataParallel(timeout_s=timeout_s)
