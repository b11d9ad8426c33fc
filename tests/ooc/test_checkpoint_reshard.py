"""Resharding (NOTE [resharding] in ooc.checkpoint): a version saved by two data-parallel ranks, with
HostAdamW's state sharded or not, restores on one rank and on two.

The two ranks run as gloo subprocesses (``torch.multiprocessing``), one thread each. Each rank trains
on micro-batch ``rank`` of every step's global batch; one process accumulating both micro-batches
(``accumulate=2``, each loss halved) on one thread too computes the same gradients bit for bit
(halving is exact), as tests/ooc/test_distributed.py shows for ``ooc train``. So a run resumed on one rank continues exactly
as the two-rank run that was never stopped, and so does one resumed on two ranks with the other
sharding.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ooc.checkpoint import Checkpointer, list_versions
from ooc.distributed import DataParallel
from ooc.models.gpt import GPT, GPT_PRESETS
from ooc.optim import HostAdamW

CFG = replace(GPT_PRESETS["nano"], n_layer=2, dropout=0.1)
STEPS, SAVED = 5, 2  # the two-rank run saves after step SAVED and goes on to STEPS


def _setup(*, world: int, shard: bool, dtype: torch.dtype):
    torch.manual_seed(0)
    model = GPT(CFG).to(dtype)
    dp = DataParallel(shard=shard, timeout_s=60) if world > 1 else None
    # device_params_below: the norms' and some biases' state stays on every rank, sharded or not.
    opt = HostAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, model=model, data_parallel=dp,
                    accumulate=2 if world == 1 else 1, device_params_below=CFG.n_embd + 1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _micro_batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + index)
    x = torch.randint(0, CFG.vocab_size, (2, 16), generator=gen)
    torch.manual_seed(7919 * step + index)  # the dropout masks follow the micro-batch, not the rank
    return x, torch.roll(x, -1, dims=1)


def _train(model, opt, sched, steps: range, micro: list[int], ckpt: Checkpointer | None = None) -> list[float]:  # noqa: ANN001
    """Train on micro-batches ``micro`` of each step (each loss divided by their count); return the
    loss of each micro-batch. Saves after step ``SAVED``."""
    losses = []
    for step in steps:
        for index in micro:
            _, loss = model(*_micro_batch(step, index))
            (loss / len(micro)).backward()
            losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if ckpt is not None and step + 1 == SAVED:
            ckpt.save(SAVED)
    opt.synchronize()
    return losses


def _weights(model) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _named_state(model, opt) -> dict[str, dict[str, torch.Tensor]]:  # noqa: ANN001
    """The optimizer state this process holds, by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


def _on_device(model) -> set[str]:  # noqa: ANN001
    """The parameters ``device_params_below`` keeps on their device with their state."""
    return {n for n, p in model.named_parameters() if p.numel() <= CFG.n_embd}


def _rank(rank: int, world: int, rendezvous: str, root: str, shard: bool, dtype: torch.dtype, resume: bool) -> None:
    """One rank: a run from scratch saving at step SAVED (``resume=False``), or a run resumed from it."""
    os.environ["OOC_CHECK_ORDER"] = "1"  # as test_distributed's ranks: stream order is checked
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        model, opt, sched = _setup(world=world, shard=shard, dtype=dtype)
        ckpt = Checkpointer(Path(root) / "ckpt", model, opt, scheduler=sched, keep=None, layout={"shard": shard})
        start = ckpt.restore().step if resume else 0
        at_save = {}
        if not resume:
            _train(model, opt, sched, range(SAVED), [rank], ckpt)
            at_save = _named_state(model, opt)
        losses = _train(model, opt, sched, range(start if resume else SAVED, STEPS), [rank])
        ckpt.close()
        torch.save({"losses": losses, "weights": _weights(model), "at_save": at_save, "owned": sorted(_named_state(model, opt))},
                   Path(root) / f"{'resumed' if resume else 'run'}-{'sharded' if shard else 'replicated'}-rank{rank}.pt")
        opt.close()
    finally:
        dist.destroy_process_group()


def _spawn(root: Path, *, shard: bool, dtype: torch.dtype, resume: bool) -> list[dict]:
    rendezvous = root / f"rendezvous-{shard}-{resume}"  # a file, not a port another test could take
    mp.spawn(_rank, args=(2, str(rendezvous), str(root), shard, dtype, resume), nprocs=2, join=True)
    tag = f"{'resumed' if resume else 'run'}-{'sharded' if shard else 'replicated'}"
    return [torch.load(root / f"{tag}-rank{r}.pt", weights_only=True) for r in range(2)]


def _interleave(per_rank: list[dict]) -> list[float]:
    """The micro-batch losses of two ranks in one process's order: step by step, rank 0's then rank 1's."""
    return [x for pair in zip(per_rank[0]["losses"], per_rank[1]["losses"]) for x in pair]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _check_one_rank_resume(root: Path, ranks: list[dict], dtype: torch.dtype, *, sharded: bool) -> None:
    """Restore the two-rank version on one process: every parameter's state (fp32 masters and moments)
    is its owner's, exactly; training on goes on exactly as the two ranks did."""
    model, opt, sched = _setup(world=1, shard=False, dtype=dtype)
    v = Checkpointer(root / "ckpt", model, opt, scheduler=sched).restore()
    assert v.step == SAVED and v.world == 2
    files = {name for name in v.files if name.startswith("optimizer-")}
    assert files == ({"optimizer-rank0.safetensors", "optimizer-rank1.safetensors"} if sharded
                     else {"optimizer-rank0.safetensors"})
    saved = {**ranks[0]["at_save"], **ranks[1]["at_save"]}
    on_device = _on_device(model)
    assert on_device <= ranks[0]["at_save"].keys() & ranks[1]["at_save"].keys()  # replicated on every rank
    assert all(_same(ranks[0]["at_save"][n], ranks[1]["at_save"][n]) for n in on_device)
    if sharded:
        host = [ranks[r]["at_save"].keys() - on_device for r in range(2)]
        assert host[0].isdisjoint(host[1]) and host[0] and host[1]
    restored = _named_state(model, opt)
    assert restored.keys() == saved.keys() == {n for n, _ in model.named_parameters()}
    assert all(_same(restored[n], saved[n]) for n in saved)
    if dtype == torch.bfloat16:
        assert all("master" in s and s["master"].dtype == torch.float32 for n, s in restored.items() if n not in on_device)
    assert sched.last_epoch == SAVED
    losses = _train(model, opt, sched, range(SAVED, STEPS), [0, 1])  # one thread, as each rank (tests/conftest.py)
    assert losses == _interleave(ranks)
    assert _same(_weights(model), ranks[0]["weights"])
    opt.close()


@pytest.fixture(scope="module")
def sharded_bf16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("sharded")
    return root, _spawn(root, shard=True, dtype=torch.bfloat16, resume=False)


def test_two_sharded_ranks_restore_on_one(sharded_bf16) -> None:  # noqa: ANN001
    root, ranks = sharded_bf16
    assert _same(ranks[0]["weights"], ranks[1]["weights"])
    _check_one_rank_resume(root, ranks, torch.bfloat16, sharded=True)


@pytest.mark.slow
def test_two_sharded_ranks_restore_on_two_unsharded(sharded_bf16) -> None:  # noqa: ANN001
    root, ranks = sharded_bf16
    resumed = _spawn(root, shard=False, dtype=torch.bfloat16, resume=True)
    assert resumed[0]["owned"] == resumed[1]["owned"] == sorted(n for n, _ in GPT(CFG).named_parameters())
    for r in range(2):
        assert resumed[r]["losses"] == ranks[r]["losses"]
        assert _same(resumed[r]["weights"], ranks[r]["weights"])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_two_unsharded_ranks_restore_on_one_and_on_two_sharded(tmp_path: Path, dtype: torch.dtype) -> None:
    ranks = _spawn(tmp_path, shard=False, dtype=dtype, resume=False)
    _check_one_rank_resume(tmp_path, ranks, dtype, sharded=False)
    resumed = _spawn(tmp_path, shard=True, dtype=dtype, resume=True)
    on_device = _on_device(GPT(CFG))
    assert (set(resumed[0]["owned"]) - on_device).isdisjoint(resumed[1]["owned"])
    for r in range(2):
        assert resumed[r]["losses"] == ranks[r]["losses"]
        assert _same(resumed[r]["weights"], ranks[r]["weights"])


@pytest.mark.slow
def test_one_rank_restores_on_two_sharded(tmp_path: Path) -> None:
    """The other direction: a version saved by one process (accumulating both micro-batches) resumed
    by two sharded ranks, each reading only the state of the parameters it owns."""
    model, opt, sched = _setup(world=1, shard=False, dtype=torch.bfloat16)
    ckpt = Checkpointer(tmp_path / "ckpt", model, opt, scheduler=sched)
    _train(model, opt, sched, range(SAVED), [0, 1], ckpt)  # one thread, as each rank (tests/conftest.py)
    ckpt.close()
    straight = _train(model, opt, sched, range(SAVED, STEPS), [0, 1])
    final = _weights(model)
    opt.close()
    resumed = _spawn(tmp_path, shard=True, dtype=torch.bfloat16, resume=True)
    assert _interleave(resumed) == straight
    assert all(_same(r["weights"], final) for r in resumed)
    assert list_versions(tmp_path / "ckpt")[-1].world == 1



def _save_or_fall_back(rank: int, world: int, rendezvous: str, root: str, phase: str) -> None:
    """One sharded rank: save versions 1 and 2 (``phase="save"``), or restore with ``fallback=True``,
    write the step it restored and save the step after it."""
    os.environ["OOC_CHECK_ORDER"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        model, opt, sched = _setup(world=world, shard=True, dtype=torch.bfloat16)
        ckpt = Checkpointer(Path(root) / "ckpt", model, opt, scheduler=sched, keep=None)
        if phase == "save":
            for step in (1, 2):
                _train(model, opt, sched, range(step - 1, step), [rank])
                ckpt.save(step)
        else:
            step = ckpt.restore(fallback=True).step
            Path(root, f"fell-back-rank{rank}.txt").write_text(str(step))
            _train(model, opt, sched, range(step, step + 1), [rank])
            ckpt.save(step + 1)
        ckpt.close()
        opt.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_ranks_fall_back_to_the_same_version(tmp_path: Path) -> None:
    """NOTE [every rank falls back alike]: the newest version's optimizer file of rank 1 is damaged.
    A sharded rank reads only the files of the parameters it owns, so with ``fallback=True`` rank 0
    loaded the newest version and rank 1 the one before, and the two trained on from different
    steps without a word. Both now fall back to the version before, and save the damaged version's
    step again: one of them moves its folder aside (NOTE [damaged versions moved aside]), where the
    save failed as 'already committed'."""
    mp.spawn(_save_or_fall_back, args=(2, str(tmp_path / "rendezvous-save"), str(tmp_path), "save"), nprocs=2, join=True)
    newest = list_versions(tmp_path / "ckpt")[-1]
    assert newest.step == 2 and {"optimizer-rank0.safetensors", "optimizer-rank1.safetensors"} <= newest.files.keys()
    damaged = newest.path / "optimizer-rank1.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0x01
    damaged.write_bytes(bytes(data))
    mp.spawn(_save_or_fall_back, args=(2, str(tmp_path / "rendezvous-restore"), str(tmp_path), "restore"),
             nprocs=2, join=True)
    assert [(tmp_path / f"fell-back-rank{r}.txt").read_text() for r in range(2)] == ["1", "1"]
    assert [v.step for v in list_versions(tmp_path / "ckpt")] == [1, 2]
    assert [p.name.partition(".damaged-")[0] for p in (tmp_path / "ckpt").iterdir() if ".damaged-" in p.name] \
        == ["step-000000002"]
