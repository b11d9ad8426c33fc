"""Data parallel misused on purpose: gloo ranks on this CPU, spawned with torch.multiprocessing, that
disagree on their optimizer's settings or on when they finish, against what DistributedDataParallel
+ AdamW(fused=True) would train. Each test spawns its ranks once; a rank that raises, dies or hangs
fails the test within its timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ooc
from ooc.distributed import DataParallel
from ooc.optim import HostAdamW
from tests.ooc.test_distributed_users import _on_ranks as on_ranks

STEPS = 3


class Net(nn.Module):
    """Three linear layers, each a bucket: (N, 8) -> (N, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.mid(F.gelu(self.inp(x)))))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _on_ranks(case: Callable[[int], Any], world: int = 2, timeout: float = 90) -> list[Any]:
    """``case(rank)`` on ``world`` spawned gloo ranks (the harness of test_distributed_users)."""
    return on_ranks(case, world, timeout)


def _groups_that_differ(rank: int) -> str:
    """Rank 0 puts the biases in a group without weight decay, rank 1 leaves every group at the
    defaults; what building the optimizer said ("built" if nothing)."""
    torch.manual_seed(0)
    model = Net()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": weights}, {"params": biases, "weight_decay": 0.0 if rank == 0 else 1e-2}]
    try:
        opt = HostAdamW(groups, lr=1e-2, model=model, data_parallel=DataParallel(timeout_s=30))
    except ooc.OocError as exc:
        return str(exc)
    opt.close()
    return "built"


def test_parameter_groups_that_differ_between_ranks_are_refused_at_start_up() -> None:
    """A group's settings differing by rank (a no-decay group made under a condition that differs by
    rank) passed the start-up check, which compared only HostAdamW's own lr, betas, eps and
    weight_decay: unsharded each rank updated the group with its own settings, and every weight
    parted between the ranks without a word."""
    for rank, said in enumerate(_on_ranks(_groups_that_differ)):
        assert "rank 1 differs from rank 0 in: parameter groups" in said, (rank, said)


def _train(model: nn.Module, opt: HostAdamW, rank: int, steps: int = STEPS) -> None:
    for step in range(steps):
        x, y = _batch(rank, step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_close_after_the_last_step_waits_for_its_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    """``step()`` returns with its last updates running (data-parallel: their exchange too, waiting for
    a rank whose batch took longer); ``close()`` gave each host thread a few seconds and returned, so
    the weights a loop saved after it could lack the last step's update in some buckets. Here the
    threads' grace is 0.1 s and each of the last step's updates begins 0.5 s late."""
    import ooc.optim.pipeline as pipeline

    monkeypatch.setattr(pipeline, "_JOIN_S", 0.1)
    weights = []
    for slow in (False, True):
        torch.manual_seed(0)
        model = Net()
        opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
        if slow:
            state = opt.state[model.inp.weight]
            opt.stage_listeners.append(lambda _bucket, stage, state=state: time.sleep(0.5)
                                       if stage is ooc.optim.Stage.EXCHANGE and state["step"] == STEPS - 1 else None)
        _train(model, opt, 0)
        opt.close()
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
    assert [k for k in weights[0] if not torch.equal(weights[0][k], weights[1][k])] == []


def _one_rank_leaves_before_the_last_step(rank: int) -> str:
    """Rank 1 stops before the last step (its process ends); what rank 0's ``close()`` after its last
    ``step()`` said ("closed" if nothing)."""
    torch.manual_seed(0)
    model = Net()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, data_parallel=DataParallel(timeout_s=30))
    _train(model, opt, rank, STEPS - rank)
    try:
        opt.close()
    except ooc.OocError as exc:
        return str(exc)
    return "closed"


def test_close_reports_a_last_exchange_that_failed() -> None:
    """The last step's exchange failed on the exchange thread after ``step()`` returned (a rank
    gone), and ``close()`` returned without a word: the weights lacked that step's update."""
    said, left = _on_ranks(_one_rank_leaves_before_the_last_step)
    assert left == "closed"
    assert "lost the other ranks" in said, said


def _every_rank_loads_rank_0s_shard(rank: int) -> str:
    """Two sharded steps, then every rank loads rank 0's ``state_dict()``; what the load said
    ("loaded" if nothing)."""
    torch.manual_seed(0)
    model = Net()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, data_parallel=DataParallel(shard=True, timeout_s=30))
    _train(model, opt, rank, 2)
    saved: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(saved, opt.state_dict())
    try:
        opt.load_state_dict(saved[0])
        said = "loaded"
    except ooc.OocError as exc:
        said = str(exc)
    opt.close()
    return said


def test_a_sharded_state_loaded_on_another_rank_is_refused() -> None:
    """``if rank == 0: torch.save(opt.state_dict(), path)`` and every rank loading it, the habit of
    unsharded optimizers: a sharded state holds only its rank's parameters, and rank 1 took it
    without a word, its own parameters' moments and step counts reset to zero (and it held rank 0's)."""
    on_0, on_1 = _on_ranks(_every_rank_loads_rank_0s_shard)
    assert on_0 == "loaded"
    assert "rank: saved 0, now 1" in on_1 and "Checkpointer" in on_1, on_1


def _one_rank_runs_out_of_batches(rank: int) -> str:
    """Rank 1 has one batch fewer: it ends its loop and stays alive (evaluating) past rank 0's
    timeout; what rank 0's last step said ("trained" if nothing)."""
    torch.manual_seed(0)
    model = Net()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, data_parallel=DataParallel(timeout_s=2))
    try:
        _train(model, opt, rank, STEPS - rank)
        opt.close()
    except ooc.OocError as exc:
        return str(exc)
    if rank == 1:
        time.sleep(5)  # alive, not in the exchange rank 0 waits in
    return "trained"


def test_a_rank_that_runs_out_of_batches_is_named_as_a_cause() -> None:
    """Ranks with uneven data: the one that stops first is alive, so rank 0's exchange fails by its
    timeout, as under DistributedDataParallel; the error said only that a rank died or hung."""
    said, _ = _on_ranks(_one_rank_runs_out_of_batches)
    assert "lost the other ranks" in said and "fewer backward passes and step() calls" in said, said


class _Normed(nn.Module):
    """Linear, BatchNorm, linear: (N, 8) -> (N, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.norm(self.inp(x))))


def _evaluated_on_rank_0_with_grad(rank: int) -> dict[str, list[str] | str]:
    """Per case, the state-dict entries that differ from DDP + AdamW's (or what HostAdamW raised).
    "evaluated": a loop that zeroes gradients first and, after one step(), evaluates on rank 0 alone
    in eval mode with grad left enabled (under DDP: the module inside the wrapper). "eval mode
    throughout": the ranks' BatchNorm statistics start apart and the model trains in eval mode."""
    from torch.nn.parallel import DistributedDataParallel

    found: dict[str, list[str] | str] = {}
    for case in ("evaluated", "eval mode throughout"):
        states = []
        for ours in (False, True):
            torch.manual_seed(0)
            model = _Normed()
            if case == "eval mode throughout":
                model.norm.running_mean.fill_(rank)
                model.eval()
            if ours:
                forward, opt = model, HostAdamW(model.parameters(), lr=1e-2, model=model,
                                                data_parallel=DataParallel(timeout_s=5))
            else:
                forward = DistributedDataParallel(model)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            try:
                for step in range(STEPS):
                    opt.zero_grad()
                    x, y = _batch(rank, step)
                    F.mse_loss(forward(x), y).backward()
                    opt.step()
                    if case == "evaluated" and rank == 0 and step == 1:
                        model.eval()
                        model(_batch(7, 7)[0])
                        model.train()
                if ours:
                    opt.close()
            except ooc.OocError as exc:
                found[case] = str(exc)
                break
            states.append(model.state_dict())
        else:
            found[case] = [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]
    return found


def test_an_evaluation_on_rank_0_in_eval_mode_with_grad_enabled_broadcasts_nothing() -> None:
    """The first forward with grad enabled after step() broadcasts rank 0's buffers: rank 0's
    evaluation, grad left enabled, broadcast where rank 1 did not, and the ranks' collectives went
    out of step (a timeout here; buffers of one size would have taken each other's values). A model
    in eval mode now broadcasts none, except once when the optimizer is built, as DDP's constructor."""
    for rank, found in enumerate(_on_ranks(_evaluated_on_rank_0_with_grad)):
        assert not any(found.values()), f"rank {rank}: {found}"


class _Tiny(nn.Module):
    """A linear layer scaled by a parameter of two elements, fewer than the ranks: (N, 7) -> (N, 7)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(7, 7)
        self.scale = nn.Parameter(torch.randn(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.linear(x)) * self.scale.sum()


class _OddNet(nn.Module):
    """Three :class:`_Tiny` blocks between linear layers of odd sizes: (N, 5) -> (N, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.blocks = nn.Sequential(_Tiny(), _Tiny(), _Tiny())
        self.out = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def _three_ranks_against_ddp(rank: int) -> dict[str, tuple[float, bool]]:
    """Per case, the largest difference from DDP + AdamW's weights and whether every rank holds the
    same; each rank's batch has another size (2, 5, 9 rows)."""
    from torch.nn.parallel import DistributedDataParallel

    rows = (2, 5, 9)[rank]
    found = {}
    reference = None
    for case in ("ddp", "unsharded", "sharded"):
        torch.manual_seed(0)
        model = _OddNet()
        if case == "ddp":
            forward, opt = DistributedDataParallel(model), torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        else:
            ooc.wrap(model, ooc.Plan.uniform("swap", 3), blocks=model.blocks)
            forward, opt = model, HostAdamW(model.parameters(), lr=1e-2, model=model,
                                            data_parallel=DataParallel(shard=case == "sharded", timeout_s=30))
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)
            F.mse_loss(forward(torch.randn(rows, 5, generator=g)), torch.randn(rows, 3, generator=g)).backward()
            opt.step()
            opt.zero_grad()
        if case != "ddp":
            opt.close()
            ooc.unwrap(model)
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if reference is None:
            reference = weights
            continue
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, weights)
        found[case] = (max(float((weights[k] - reference[k]).abs().max()) for k in weights),
                       all(torch.equal(weights[k], other[k]) for other in everyone for k in weights))
    return found


def test_three_ranks_with_uneven_batches_agree_with_ddp_to_fp32_rounding() -> None:
    """Three ranks (no power of two: DDP scales each gradient by 1/3 before the sum, HostAdamW divides
    the sum), batches of three sizes, parameters sharded unevenly, one of fewer elements than ranks:
    every rank holds the same weights, within fp32 rounding of DDP's (observed 6e-8 after three
    steps; a step's worth, lr = 1e-2, would show as a difference of 1e-3)."""
    for rank, found in enumerate(_on_ranks(_three_ranks_against_ddp, world=3)):
        for case, (difference, same) in found.items():
            assert same and difference < 1e-6, (rank, case, difference, same)


class _Fails(torch.autograd.Function):
    """The identity, whose backward raises while ``armed`` (an error in a block's backward)."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _Fails.armed:
            raise RuntimeError("a block's backward failed")
        return grad


class _Breakable(Net):
    """:class:`Net` whose ``mid`` layer's input goes through :class:`_Fails`: a failed backward has
    written ``out``'s and ``mid``'s gradients, not ``inp``'s."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.mid(_Fails.apply(F.gelu(self.inp(x))))))


def _backward_fails_on_rank_1(rank: int, *, then_zero_grad: bool) -> dict[str, list[str] | str]:
    """Per case (``pipeline=False`` data-parallel), the weights that differ from DDP + AdamW's trained
    on the same batches without a failure, or what HostAdamW raised. Rank 1's backward at step 1
    fails; its loop catches the error, calls zero_grad() (``then_zero_grad``) or not, and runs the
    step again."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = _Breakable()
    ddp, adamw = DistributedDataParallel(model), torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        F.mse_loss(ddp(x), y).backward()
        adamw.step()
        adamw.zero_grad()
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    model = _Breakable()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, pipeline=False, data_parallel=DataParallel(timeout_s=10))
    try:
        for step in range(STEPS):
            x, y = _batch(rank, step)
            _Fails.armed = rank == 1 and step == 1
            try:
                F.mse_loss(model(x), y).backward()
            except RuntimeError:
                _Fails.armed = False
                if then_zero_grad:
                    opt.zero_grad()
                F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        opt.close()
    except ooc.OocError as exc:
        return {"raised": str(exc)}
    return {"differ": [k for k in reference if not torch.equal(reference[k], model.state_dict()[k])]}


def _failed_backward_run_again(rank: int) -> dict[str, list[str] | str]:
    return _backward_fails_on_rank_1(rank, then_zero_grad=True)


def _failed_backward_gradients_kept(rank: int) -> dict[str, list[str] | str]:
    return _backward_fails_on_rank_1(rank, then_zero_grad=False)


def test_a_failed_backward_run_again_after_zero_grad_trains_as_if_it_never_failed() -> None:
    """No rank has exchanged any of the step: the step run again meets the others' exchange."""
    for rank, found in enumerate(_on_ranks(_failed_backward_run_again)):
        assert found == {"differ": []}, (rank, found)


def test_a_failed_backward_without_zero_grad_is_refused_with_pipeline_false() -> None:
    """With ``pipeline=False`` nothing watched the backward: the partial gradients of the failed one
    were summed into the step run again, on rank 1 alone, and the weights parted from DDP's (which
    refuses that forward) without a word."""
    _, on_1 = _on_ranks(_failed_backward_gradients_kept)
    assert "zero_grad()" in on_1.get("raised", ""), on_1
