"""Data parallel as a user writes it: two gloo ranks on this CPU, spawned with torch.multiprocessing,
HostAdamW(data_parallel=...) on the model against torch's DistributedDataParallel + AdamW(fused=True).

Every rank runs one thread, so both sides compute each rank's gradient with the same kernels; two
ranks sum two gradients and halve the sum exactly, so the weights must be equal bit for bit.
Each test spawns its ranks once and runs its cases in them; a rank that dies (gloo aborts the
process on a collective of the wrong size) or hangs fails the test within its timeout.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ooc
from ooc.checkpoint import _CLOSED_GRACE_S, Checkpointer, CheckpointError, list_versions
from ooc.distributed import DataParallel, WorldError, check_world, fingerprint
from ooc.optim import HostAdamW
from tests.helpers import small_resnet

WORLD = 2
STEPS = 3


class Gated(nn.Module):
    """A block whose ``extra`` layer runs only while ``use_extra`` is set: (N, 16) -> (N, 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(16, 16)
        self.extra = nn.Linear(16, 16)
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.main(x))
        return h + self.extra(h) if self.use_extra else h


class Net(nn.Module):
    """A chain of three :class:`Gated` blocks and an ``aux`` head that runs only while ``use_aux``
    is set: (N, 8) -> (N, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.Sequential(Gated(), Gated(), Gated())
        self.aux = nn.Linear(16, 4)
        self.out = nn.Linear(16, 4)
        self.use_aux = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.inp(x))
        return self.out(h) + self.aux(h) if self.use_aux else self.out(h)


def _batch(rank: int, step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 8, generator=g).to(dtype), torch.randn(8, 4, generator=g).to(dtype)


def _set_use(model: nn.Module, rank: int, step: int, unused: str) -> None:
    """Step 0 runs every layer on every rank (each gradient buffer gets written once); later steps
    leave ``unused`` ("aux" or "extra": block 1's extra layer) out on rank 1."""
    used = not (rank == 1 and step > 0)
    if unused == "aux":
        model.use_aux = used
    else:
        model.blocks[1].use_extra = used


def _train(model: nn.Module, step_fn: Callable[[int], None]) -> dict[str, torch.Tensor]:
    for step in range(STEPS):
        step_fn(step)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ddp_adamw(rank: int, unused: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    def step(i: int) -> None:
        _set_use(model, rank, i, unused)
        x, y = _batch(rank, i)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()

    return _train(model, step)


def _host_adamw(rank: int, unused: str, *, dtype: torch.dtype = torch.float32, wrap: str | None = "swap",
                world: int = WORLD, **options: Any) -> dict[str, torch.Tensor]:
    """``world`` 1: one process trains on every rank's batch (``accumulate=WORLD``, each loss over WORLD)."""
    torch.manual_seed(0)
    model = Net().to(dtype)
    if wrap is not None:
        ooc.wrap(model, ooc.Plan.uniform(wrap, 3), blocks=model.blocks)
    if world > 1:
        options["data_parallel"] = DataParallel(shard=options.pop("shard", False),
                                                reduce_on=options.pop("reduce_on", "auto"), timeout_s=60)
    else:
        options = {**options, "accumulate": WORLD}
        options.pop("shard", None)
        options.pop("reduce_on", None)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, **options)

    def step(i: int) -> None:
        for r in [rank] if world > 1 else range(WORLD):
            _set_use(model, r, i, unused)
            x, y = _batch(r, i, dtype)
            (F.mse_loss(model(x), y) / (1 if world > 1 else WORLD)).backward()
        opt.step()
        opt.zero_grad()

    try:
        weights = _train(model, step)
    finally:
        opt.close()
        if wrap is not None:
            ooc.unwrap(model)
    return weights


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def _gathered(weights: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, weights)
    return everyone


def _unused_against_ddp(rank: int) -> dict[str, list[str]]:
    """Per case, the weights that differ from DDP + AdamW's."""
    found = {}
    for unused in ("aux", "extra"):
        reference = _ddp_adamw(rank, unused)
        for name, options in {"": {}, "sharded": {"shard": True}, "in step()": {"pipeline": False},
                              "small on device": {"device_params_below": 20},
                              "summed on the device": {"reduce_on": "device"}}.items():
            found[f"{unused} {name}"] = _differ(reference, _host_adamw(rank, unused, **options))
    return found


def _unused_in_bf16(rank: int) -> dict[str, list[str]]:
    """Per case, the weights that differ between the ranks or from one process accumulating both
    ranks' batches (bf16 parameters: fp32 masters, gradients copied out into host buffers)."""
    found = {}
    for unused in ("aux", "extra"):
        one = _host_adamw(0, unused, dtype=torch.bfloat16, world=1)
        for name, options in {"": {}, "sharded": {"shard": True}, "summed on the device": {"reduce_on": "device"}}.items():
            ranks = _gathered(_host_adamw(rank, unused, dtype=torch.bfloat16, **options))
            found[f"{unused} {name}"] = sorted({k for w in ranks for k in _differ(one, w)})
    return found


def _worker(rank: int, world: int, port: int, case: Callable[[int], Any], out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      # The ranks check stream order, as test_distributed.py's (NOTE [a blocking torch
                      # copy waits for compute] in ooc.backend.order: the exchange thread's gather).
                      OOC_CHECK_ORDER="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out.put((rank, "ok", case(rank)))
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put((rank, "raised", traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _on_two_ranks(case: Callable[[int], Any], timeout: float = 120) -> list[Any]:
    """``case(rank)`` on two spawned ranks (``_on_ranks``)."""
    return _on_ranks(case, WORLD, timeout)


def _on_ranks(case: Callable[[int], Any], world: int, timeout: float = 120) -> list[Any]:
    """``case(rank)`` on ``world`` spawned gloo ranks; their results by rank. Fails (never hangs) if a
    rank raises, dies or is still running after ``timeout`` seconds."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, world, port, case, out)) for rank in range(world)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, how, value = out.get(timeout=1)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    pytest.fail(f"a rank died (exit codes {dead}) or hung: results so far {results}")
                continue
            if how != "ok":
                pytest.fail(f"rank {rank} raised:\n{value}")
            results[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in range(world)]


def test_parameters_unused_on_one_rank_train_as_under_ddp() -> None:
    """A head or a layer that one rank's batch does not use (an auxiliary loss on some batches, a
    branch taken by the data): DistributedDataParallel(find_unused_parameters=True) averages its
    gradient with zeros from that rank, and every rank updates it. The rank without its gradient
    skipped the bucket's exchange: the other's collective met the next bucket's (gloo aborted the
    process on the size mismatch; buckets of one size would have summed each other's gradients),
    and the rank left the parameter alone while the other updated it."""
    for rank, found in enumerate(_on_two_ranks(_unused_against_ddp)):
        assert not any(found.values()), f"rank {rank}: weights that differ from DDP's: {found}"


def test_parameters_unused_on_one_rank_in_bf16_stay_equal_across_ranks() -> None:
    """bf16 parameters copy their gradients into host buffers, where a parameter without a gradient
    on this rank kept the one of an earlier step, which the sum took."""
    for rank, found in enumerate(_on_two_ranks(_unused_in_bf16)):
        assert not any(found.values()), f"rank {rank}: weights that differ from one process's: {found}"


def _clipped_in_the_loop(rank: int) -> dict[str, str]:
    """Per case, what ``step()`` said after the loop clipped the gradients between ``backward()`` and
    ``step()`` ("stepped" if nothing); a limit so small that every rank clips."""
    said = {}
    for name, options in {"in step()": {"pipeline": False}, "in step(), no model": {"pipeline": False, "model": None},
                          "pipelined": {}}.items():
        torch.manual_seed(0)
        model = Net()
        options = {"model": model, **options}
        opt = HostAdamW(model.parameters(), lr=1e-2, data_parallel=DataParallel(timeout_s=60), **options)
        x, y = _batch(rank, 0)
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        try:
            opt.step()
            said[name] = "stepped"
        except ooc.OocError as exc:
            said[name] = str(exc)
        opt.close()
    return said


def test_a_clip_in_the_loop_under_data_parallel_is_refused_even_in_step() -> None:
    """Between ``backward()`` and ``step()`` a rank's gradients are its own, not yet averaged (DDP's
    are): ``clip_grad_norm_`` there clips each rank by its own norm, and the weights part from
    DDP + ``clip_grad_norm_``'s. A pipelined HostAdamW refused the step but advised
    ``pipeline=False``, which took the clipped gradients without a word (``max_grad_norm=`` clips
    the averaged gradients by their global norm, as DDP's loop does)."""
    for rank, said in enumerate(_on_two_ranks(_clipped_in_the_loop)):
        for name, message in said.items():
            assert "max_grad_norm=" in message and "data_parallel" in message, (rank, name, message)
            assert "pipeline=False" not in message, (rank, name, message)


def test_plans_that_differ_between_ranks_say_how_to_share_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ooc.wrap(model, budget=..., sample=batch)`` on every rank (the README's first example) plans
    from each rank's own measured profile, and timing noise chose other plans on two ranks about one
    start in two here: the start-up check refused, saying to check each rank's command line, which
    were the same. It now says why plans differ and how to take one rank's."""
    mine = fingerprint(None, [], {}, "plan of rank 0")
    other = fingerprint(None, [], {}, "plan of rank 1")
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None), [mine, other]))
    with pytest.raises(WorldError, match="rank 1 differs from rank 0 in: plan") as raised:
        check_world(mine)
    assert "budget" in str(raised.value) and "broadcast_object_list" in str(raised.value), str(raised.value)


def test_a_data_parallel_checkpoint_saved_by_rank_0_alone_is_refused(tmp_path: Path) -> None:
    """``if rank == 0: ckpt.save(step)``, the habit of torch.save checkpoints: a version is complete
    (restorable) only with every rank's record, so every save returned and none was ever complete;
    the run learnt it at its resume ("no complete checkpoint"). A rank that has committed three
    versions after one still incomplete knows the others do not save it (ranks exchanging gradients
    every step lag each other by less; here rank 1 never saves): its next save says so."""
    ckpt = Checkpointer(tmp_path, nn.Linear(2, 2), rank=0, world=2, timeout_s=0.5)
    for step in range(1, 5):
        ckpt.save(step)
    with pytest.raises(CheckpointError, match="every rank") as raised:
        ckpt.save(5)
    assert "rank 1" in str(raised.value), str(raised.value)
    # Without a process group close() waits on the files for rank 1's record of step 4, then says so.
    with pytest.raises(CheckpointError, match="no commit record of rank 1"):
        ckpt.close()


def test_ranks_that_save_alike_are_not_refused_while_one_lags(tmp_path: Path) -> None:
    """Rank 1 writes each version after rank 0 has committed the next two."""
    ranks = [Checkpointer(tmp_path, nn.Linear(2, 2), rank=r, world=2, keep=None) for r in range(2)]
    for step in range(1, 7):
        ranks[0].save(step)
        ranks[0].wait()
        if step > 2:
            ranks[1].save(step - 2)
            ranks[1].wait()
    ranks[1].close()
    # Rank 1 stops lagging here without saving 5 and 6: a rank that went on would, and rank 0's close()
    # waits for its records (on the files: no process group); here nothing would come.
    ranks[0].close(check_ranks=False)
    assert [v.step for v in list_versions(tmp_path)] == [1, 2, 3, 4]


CLOSE_TIMEOUT_S = 60.0


def _save_into(root: str, per_rank: bool, late_rank: int | None, rank: int) -> tuple[float, str, int]:
    """Every rank saves versions 1 and 2 into ``root`` (``per_rank``: into ``root/r{rank}``, one
    directory per rank), ``late_rank`` the second one two seconds after the others, then closes.
    Returns how long ``close`` took, what it raised ("" if nothing) and the complete versions in
    its directory right after it."""
    torch.manual_seed(0)
    directory = f"{root}/r{rank}" if per_rank else root
    ckpt = Checkpointer(directory, Net(), timeout_s=CLOSE_TIMEOUT_S)
    ckpt.save(1)
    ckpt.wait()
    dist.barrier()
    if rank == late_rank:
        time.sleep(2.0)
    ckpt.save(2)
    started = time.monotonic()
    try:
        ckpt.close()
        said = ""
    except CheckpointError as exc:
        said = str(exc)
    return time.monotonic() - started, said, len(list_versions(directory))


def test_checkpoints_in_a_directory_per_rank_fail_at_close_naming_the_missing_rank(tmp_path: Path) -> None:
    """``Checkpointer(f"{root}/r{rank}", ...)`` (or ranks on hosts without a shared file system):
    no version was ever complete, as each folder held one rank's record, and every save, wait and
    close returned; a run that saved a few times lost its checkpoint without a word (the check of
    NOTE [every rank saves] comes after three more saves). ``close`` now says so, without waiting
    its whole ``timeout_s``: each rank sees on the store that the other closed without writing its
    record here (NOTE [every rank commits where this rank does])."""
    import functools

    ranks = _on_two_ranks(functools.partial(_save_into, str(tmp_path), True, None))
    for rank, (took, said, complete) in enumerate(ranks):
        assert complete == 0, (rank, complete)
        assert f"rank {1 - rank}" in said and "one shared directory" in said, (rank, said)
        assert took < CLOSE_TIMEOUT_S / 2, (rank, took, said)


def test_close_waits_for_a_late_ranks_record_in_a_shared_directory(tmp_path: Path) -> None:
    """The same check on ranks sharing the directory: rank 0's close waits for the record of rank
    1, which saves two seconds late, and returns with the version complete (none raises)."""
    import functools

    ranks = _on_two_ranks(functools.partial(_save_into, str(tmp_path / "ckpt"), False, 1))
    assert [(said, complete) for _, said, complete in ranks] == [("", 2), ("", 2)], ranks
    assert ranks[0][0] > 1.0, ranks  # rank 0 did wait for rank 1



def _close_unchecked(root: str, rank: int) -> tuple[float, str]:
    ckpt = Checkpointer(f"{root}/r{rank}", Net(), timeout_s=CLOSE_TIMEOUT_S)
    ckpt.save(1)
    ckpt.wait()  # timed: close alone
    started = time.monotonic()
    ckpt.close(check_ranks=False)
    return time.monotonic() - started, str(list_versions(f"{root}/r{rank}"))


def test_close_after_an_error_does_not_wait_for_the_other_ranks(tmp_path: Path) -> None:
    """``close(check_ranks=False)``, as ``ooc train`` closes after an error (a rank may be gone):
    it writes the version in flight and returns, without waiting for the other ranks' records."""
    import functools

    for took, found in _on_two_ranks(functools.partial(_close_unchecked, str(tmp_path))):
        assert took < _CLOSED_GRACE_S and found == "[]", (took, found)


def _two_directories_in_turn(root: str, rank: int) -> list[tuple[str, int]]:
    """Both ranks save version 1 into ``root/a``, rank 1 two seconds late, close, then into
    ``root/b``, rank 0 three seconds late (past ``_CLOSED_GRACE_S``), and close; what each close
    raised ("" if nothing) and the complete versions right after it."""
    found = []
    for name, late in (("a", 1), ("b", 0)):
        ckpt = Checkpointer(f"{root}/{name}", Net(), timeout_s=CLOSE_TIMEOUT_S)
        dist.barrier()
        if rank == late:
            time.sleep(2.0 if name == "a" else 3.0)
        ckpt.save(1)
        try:
            ckpt.close()
            said = ""
        except CheckpointError as exc:
            said = str(exc)
        found.append((said, len(list_versions(f"{root}/{name}"))))
    return found


def test_closes_of_the_ranks_meet_in_order_whichever_found_its_version_complete(tmp_path: Path) -> None:
    """Rank 0's first close waits for rank 1's record, rank 1's finds the version complete: both
    count that close on the store, so rank 0's second close, late, is not taken by rank 1's for
    the close of a rank that went without its record."""
    import functools

    assert _on_two_ranks(functools.partial(_two_directories_in_turn, str(tmp_path))) == [[("", 1), ("", 1)]] * 2


def _rank_1_never_closes(root: str, rank: int) -> tuple[float, str]:
    """Each rank saves version 1 into a directory of its own; rank 1 then leaves without ``close``,
    rank 0 closes with a ``timeout_s`` of 3 s and returns how long that took and what it raised."""
    ckpt = Checkpointer(f"{root}/r{rank}", Net(), timeout_s=3.0)
    ckpt.save(1)
    ckpt.wait()
    if rank == 1:
        return 0.0, ""
    started = time.monotonic()
    try:
        ckpt.close()
    except CheckpointError as exc:
        return time.monotonic() - started, str(exc)
    return time.monotonic() - started, ""


def test_close_waits_at_most_its_timeout_for_a_rank_that_never_closes(tmp_path: Path) -> None:
    import functools

    took, said = _on_two_ranks(functools.partial(_rank_1_never_closes, str(tmp_path)))[0]
    assert "rank 1" in said and "waited 3 s" in said and "one shared directory" in said, said
    assert 3.0 <= took < 3.0 + 10, took

RESTORE_TIMEOUT_S = 3.0


def _restore_on_rank_0_alone(root: str, rank: int) -> str:
    """Both ranks train and save a version; then ``if rank == 0: ckpt.restore()``. Rank 0 returns
    what its restore raised (or "restored"), rank 1 what its next step did."""
    torch.manual_seed(0)
    model = Net()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, data_parallel=DataParallel(timeout_s=2 * RESTORE_TIMEOUT_S))
    ckpt = Checkpointer(root, model, opt, timeout_s=RESTORE_TIMEOUT_S)

    def step(i: int) -> None:
        x, y = _batch(rank, i)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.synchronize()
        opt.zero_grad()

    try:
        step(0)
        ckpt.save(1)
        ckpt.wait()
        step(1)
        if rank == 0:
            started = time.monotonic()
            try:
                ckpt.restore()
            except CheckpointError as exc:
                return f"{time.monotonic() - started:.1f} s: {exc}"
            return "restored"
        try:
            step(2)  # rank 0 is not there: its exchange fails within DataParallel.timeout_s
        except ooc.OocError:
            return "its step failed"
        return "stepped"
    finally:
        ckpt.close()
        opt.close()


def test_a_restore_on_one_rank_alone_is_refused_within_the_timeout(tmp_path: Path) -> None:
    """``if rank == 0: ckpt.restore()`` in a data-parallel run: rank 0 loaded the version while
    rank 1 went on from its own weights, and the ranks parted without a word (or, where a load
    exchanged state, hung). Every rank must call restore(): it waits ``timeout_s`` for the others,
    then says so."""
    import functools

    restored, other = _on_two_ranks(functools.partial(_restore_on_rank_0_alone, str(tmp_path / "ckpt")))
    assert "every rank" in restored and "rank 1" in restored, restored
    assert float(restored.split(" s:")[0]) < RESTORE_TIMEOUT_S + 5, restored
    assert other == "its step failed", other


def _restore_on_every_rank(root: str, rank: int) -> list[int]:
    torch.manual_seed(0)
    model = Net()
    ckpt = Checkpointer(root, model, timeout_s=RESTORE_TIMEOUT_S)
    try:
        ckpt.save(1)
        ckpt.wait()
        dist.barrier()
        if rank == 1:
            time.sleep(1.0)  # a rank a little late is waited for
        return [ckpt.restore().step, ckpt.restore().step]
    finally:
        ckpt.close()


def test_a_restore_on_every_rank_waits_for_the_late_one(tmp_path: Path) -> None:
    import functools

    assert _on_two_ranks(functools.partial(_restore_on_every_rank, str(tmp_path / "ckpt"))) == [[1, 1], [1, 1]]


HUNG_S = 9
TIMEOUT_S = 2.0


def _one_rank_hangs(rank: int) -> float | str:
    """Rank 1 stops for ``HUNG_S`` seconds before its second step; rank 0 returns how long its
    second step took to raise ("stepped" if it did not)."""
    torch.manual_seed(0)
    model = Net()
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, device_params_below=20,
                    data_parallel=DataParallel(timeout_s=TIMEOUT_S))
    for step in range(2):
        if rank == 1 and step == 1:
            time.sleep(HUNG_S)
            return "hung"  # and leaves without a word, as a killed rank would
        x, y = _batch(rank, step)
        started = time.monotonic()
        try:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.synchronize()
        except ooc.OocError:
            return time.monotonic() - started
        opt.zero_grad()
    return "stepped"


@pytest.mark.slow  # a rank hangs for HUNG_S seconds: about 25 s in all
def test_a_hung_rank_fails_the_small_parameters_step_within_the_timeout() -> None:
    """``device_params_below``: the small parameters' gradients were averaged on the default process
    group, whose timeout is the one torch.distributed.init_process_group got (30 minutes by default),
    not ``DataParallel.timeout_s``: a peer that hung held this rank there until it went away."""
    elapsed, _ = _on_two_ranks(_one_rank_hangs)
    assert isinstance(elapsed, float) and elapsed < TIMEOUT_S + 5, elapsed


def _batchnorm_against_ddp(rank: int) -> dict[str, list[str]]:
    """Per case, the entries of the state dict (weights and buffers) that differ from DDP + AdamW's."""
    found = {}
    for accumulate in (1, 2):
        states = []
        for ours in (False, True):
            torch.manual_seed(0)
            model = small_resnet()
            if ours:
                forward, opt = model, HostAdamW(model.parameters(), lr=1e-2, model=model, accumulate=accumulate,
                                                data_parallel=DataParallel(timeout_s=60))
            else:
                forward, opt = DistributedDataParallel(model), torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            for step in range(STEPS):
                for micro in range(accumulate):
                    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                    x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
                    last = micro == accumulate - 1
                    with contextlib.nullcontext() if ours or last else forward.no_sync():
                        (F.cross_entropy(forward(x), y) / accumulate).backward()
                opt.step()
                opt.zero_grad()
            if ours:
                opt.close()
            states.append(model.state_dict())
        found[f"accumulate={accumulate}"] = _differ(*states)
    return found


def test_batchnorm_statistics_follow_rank_0_as_under_ddp() -> None:
    """DistributedDataParallel broadcasts rank 0's buffers before each forward that syncs gradients
    (``broadcast_buffers=True``; not inside ``no_sync()``), so every rank's BatchNorm statistics
    are rank 0's updated by its own last batch. Each rank kept its own: rank 1's statistics, what
    it evaluates with, parted from DDP's."""
    for rank, found in enumerate(_on_two_ranks(_batchnorm_against_ddp)):
        assert not any(found.values()), f"rank {rank}: entries that differ from DDP's: {found}"


class _OddBuffers(nn.Module):
    """A linear layer with an expand()ed buffer and a channels_last one: (N, 4) -> (N, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("offset", torch.zeros(1).expand(4))
        self.register_buffer("stats", torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.offset


def _odd_buffers(rank: int) -> float:
    torch.manual_seed(0)
    model = _OddBuffers()
    model.stats.fill_(rank + 1)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, data_parallel=DataParallel(timeout_s=60))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.close()
    return float(model.stats.sum())


def test_buffers_of_any_layout_follow_rank_0() -> None:
    """A channels_last buffer is broadcast as its memory lies; an expand()ed one is left as it is.
    (NCCL refuses a tensor not contiguous in its memory format, a transposed buffer's or an
    expand()ed one's; gloo takes them, so on this CPU the test guards the layouts only.)"""
    assert _on_two_ranks(_odd_buffers) == [120.0, 120.0]


def test_ranks_that_freeze_other_parameters_are_told_at_start_up() -> None:
    """A parameter frozen on one rank only (a freeze under a condition that differs by rank) took
    the other ranks' gradients there, averaged: a frozen weight trained on one rank, the ranks'
    weights parted. The start-up check compares which parameters train."""
    models = [Net(), Net()]
    models[1].aux.weight.requires_grad_(False)
    prints = [fingerprint(m, list(m.parameters()), {}, None) for m in models]
    assert [k for k in prints[0] if prints[0][k] != prints[1][k]] == ["trainable parameters"]
