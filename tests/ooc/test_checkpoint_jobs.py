"""ooc.checkpoint and the process around it (issue 14): a relative directory and ``os.chdir``, two
jobs saving into one directory (NOTE [one job per directory])."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ooc.checkpoint as ckpt_mod
from ooc.checkpoint import Checkpointer, CheckpointError, list_versions
from ooc.optim import HostAdamW


def _linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def _steps(directory: Path) -> list[int]:
    return [v.step for v in list_versions(directory)]


def test_a_relative_directory_stays_where_it_was_when_the_process_changes_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Checkpointer("ckpt", ...)`` then ``os.chdir``: the next save went into the new working
    directory's ``ckpt`` (and a chdir on the training thread while the writer thread wrote a version
    split its files between two folders, failing it). The directory is made absolute once, when the
    Checkpointer is made."""
    monkeypatch.chdir(tmp_path)
    model = _linear()
    ckpt = Checkpointer("ckpt", model, torch.optim.AdamW(model.parameters()), keep=None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chdir(elsewhere)
    ckpt.save(1)
    ckpt.wait()
    # On the writer thread, between two files of a version.
    ckpt._hook = lambda point: point == "write:model.safetensors.index.json" and os.chdir(tmp_path)
    ckpt.save(2)
    ckpt.wait()
    ckpt.close()
    assert _steps(tmp_path / "ckpt") == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "elsewhere"]
    assert list(elsewhere.iterdir()) == []
    os.chdir(elsewhere)
    fresh = _linear(seed=1)
    assert Checkpointer(tmp_path / "ckpt", fresh, torch.optim.AdamW(fresh.parameters())).restore().step == 2
    assert torch.equal(fresh.weight, model.weight)


def _write_owner_record(path: Path, **fields: object) -> None:
    """An owner record as a holder makes one (NOTE [owner records]): this process's, but for ``fields``."""
    host, boot = ckpt_mod._kernel()
    path.write_text(json.dumps({"host": host, "boot": boot, "pid": os.getpid(), "token": "0" * 16,
                                "started": ckpt_mod._process_start(os.getpid()), **fields}))


def _saving(directory: Path, steps: tuple[int, ...], seed: int = 0) -> Checkpointer:
    model = _linear(seed)
    ckpt = Checkpointer(directory, model, torch.optim.AdamW(model.parameters()), keep=3)
    for step in steps:
        ckpt.save(step)
        ckpt.wait()
    return ckpt


def _writes(ckpt: Checkpointer, log: list[tuple[str, Checkpointer]], then=lambda point: None) -> None:  # noqa: ANN001
    """Log the start and the end (its commit) of each version ``ckpt`` writes, then call ``then``."""
    def hook(point: str) -> None:
        if point.startswith("write:") and (not log or log[-1] != ("start", ckpt)):
            log.append(("start", ckpt))
        if point == "committed":
            log.append(("end", ckpt))
        then(point)

    ckpt._hook = hook


def _one_writer_at_a_time(log: list[tuple[str, Checkpointer]]) -> None:
    """Every version in ``log`` ended before the next one started."""
    assert [what for what, _ in log] == ["start", "end"] * (len(log) // 2), log
    assert all(log[k][1] is log[k + 1][1] for k in range(0, len(log), 2)), log


def test_a_new_checkpointer_in_the_process_takes_over_from_a_live_one_mid_write(tmp_path: Path) -> None:
    """NOTE [a newer Checkpointer takes over]: a notebook cell ``ck = Checkpointer(d, ...)`` run
    again while the earlier one, never closed, was writing a version: the new one's save was refused
    ("another job holds ... (this process)"). Now it waits for the earlier one's version, closes the
    earlier one and saves, warning once; the two never write at once; the earlier one's save then
    says it was superseded, and reading works throughout."""
    log: list[tuple[str, Checkpointer]] = []
    first = _saving(tmp_path, (1, 2))
    second = _saving(tmp_path, (), seed=1)
    in_flight, go = threading.Event(), threading.Event()
    _writes(first, log, lambda point: point == "write:model.safetensors" and (in_flight.set(), go.wait(10)))
    _writes(second, log)
    first.save(3)
    assert in_flight.wait(10)
    assert second.restore().step == 2 and [v.step for v in second.versions()] == [1, 2]
    threading.Timer(0.3, go.set).start()  # the takeover must wait for the write in flight
    with pytest.warns(UserWarning, match=rf"a new Checkpointer of rank 0 on {tmp_path} took the directory over from an "
                                         r"earlier Checkpointer of this process that was not closed .*Its version of "
                                         r"step 3, in flight, was written first, and the earlier one is closed now"):
        second.save(4)
    assert go.is_set()
    second.wait()
    assert _steps(tmp_path) == [2, 3, 4]
    _one_writer_at_a_time(log)
    assert [c for what, c in log if what == "end"] == [first, second]
    for attempt in (lambda: first.save(5), lambda: first.check_step(5)):
        with pytest.raises(CheckpointError, match=rf"this Checkpointer was superseded: a newer Checkpointer of rank 0 "
                                                  rf"on {tmp_path} in this process took over the directory"):
            attempt()
    first.close()  # closed already: nothing (it must not touch the directory the new one writes)
    assert first.restore().step == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second.save(5)  # no second warning
    second.close()
    assert _steps(tmp_path) == [3, 4, 5] and not list(tmp_path.glob(".writer-*"))


def test_a_write_error_of_the_checkpointer_taken_over_is_in_the_warning(tmp_path: Path) -> None:
    """The earlier Checkpointer's version in flight failed: no wait() of its would ever say so, so
    the takeover's warning does, and the new one saves."""
    first = _saving(tmp_path, (1,))

    def full_disk(point: str) -> None:
        if point == "files-written":
            raise OSError(28, "No space left on device")

    first._hook = full_disk
    first.save(2)
    second = _saving(tmp_path, (), seed=1)
    with pytest.warns(UserWarning, match=r"Its version of step 2, in flight, failed \(.*No space left"):
        second.save(2)
    second.wait()
    second.close()
    assert _steps(tmp_path) == [1, 2]


@pytest.mark.parametrize("how", ["dropped", "collected", "uncollected"])
def test_a_checkpointer_dropped_unclosed_lets_go_of_the_directory(tmp_path: Path, how: str) -> None:
    """A notebook re-running ``ck = Checkpointer(d, model, opt)`` with the same model and HostAdamW:
    the optimizer's stage listener and the model's load hook kept the dropped one alive, holding
    the directory, and the new one's save was refused. Now they hold it weakly: a dropped one is
    collected and lets go of the directory (no warning); one in a reference cycle not collected yet
    is taken over (with the warning)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    opt = HostAdamW(model.parameters(), lr=1e-3, model=model)

    def train() -> None:
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()

    gc.disable()  # the cases below decide when the cycle is collected
    try:
        train()
        ckpt = Checkpointer(tmp_path, model, opt)
        assert ckpt.lazy
        ckpt.save(1)
        ckpt.wait()
        if how != "dropped":
            ckpt.cycle = ckpt
        if how == "collected":
            del ckpt
            gc.collect()
        train()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ckpt = Checkpointer(tmp_path, model, opt)  # the cell again
            ckpt.save(2)
            ckpt.wait()
        assert [str(w.message)[:32] for w in caught] == (["a new Checkpointer of rank 0 on "] if how == "uncollected"
                                                         else [])
        ckpt.close()
    finally:
        gc.enable()
    assert _steps(tmp_path) == [1, 2] and not list(tmp_path.glob(".writer-*"))
    opt.close()


def test_two_threads_taking_the_directory_over_never_write_at_once(tmp_path: Path) -> None:
    """A thread saving every step, and another making a Checkpointer on the directory and saving
    while the first is inside a save (or its write): the second takes over once the first's version
    in flight is written; the first's next save says it was superseded; no two versions are written
    at once, and every version restores."""
    log: list[tuple[str, Checkpointer]] = []
    first = _saving(tmp_path, ())
    second = _saving(tmp_path, (), seed=1)
    _writes(first, log, lambda point: point == "write:model.safetensors" and time.sleep(0.02))
    _writes(second, log)
    errors: list[BaseException] = []
    started = threading.Event()

    def saving() -> None:
        try:
            for step in range(1, 1000):
                first.save(step)
                started.set()
        except CheckpointError as exc:
            errors.append(exc)

    thread = threading.Thread(target=saving)
    thread.start()
    assert started.wait(10)
    time.sleep(0.1)
    with pytest.warns(UserWarning, match="took the directory over"):
        second.save(5000)
    thread.join(60)
    assert not thread.is_alive()
    assert len(errors) == 1 and "this Checkpointer was superseded" in str(errors[0])
    second.wait()
    second.save(5001)
    second.close()
    _one_writer_at_a_time(log)
    assert log[-2:] == [("start", second), ("end", second)] and log[-4:-2] == [("start", second), ("end", second)]
    steps = _steps(tmp_path)
    assert steps[-2:] == [5000, 5001] and len(steps) == 3
    for step in steps:
        assert second.restore(step).step == step


def test_the_ranks_of_one_job_share_the_directory(tmp_path: Path) -> None:
    """Each rank locks a file of its own: two ranks (here in one process) save alike; a second rank 1
    in the process takes over from the first rank 1 only."""
    ranks = [Checkpointer(tmp_path, _linear(), rank=r, world=2) for r in range(2)]
    for ckpt in ranks:
        ckpt.save(1)
        ckpt.wait()
    again = Checkpointer(tmp_path, _linear(), rank=1, world=2)
    with pytest.warns(UserWarning, match="rank 1 .* took the directory over"):
        again.save(2)
    with pytest.raises(CheckpointError, match="superseded"):
        ranks[1].save(2)
    ranks[0].save(2)
    for ckpt in (ranks[0], again):
        ckpt.wait()
        ckpt.close()
    assert _steps(tmp_path) == [1, 2]


_HOLDS_THE_DIRECTORY = """
import os, sys, time
import torch
from ooc.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1], torch.nn.Linear(3, 2))
ckpt.save(1)
ckpt.wait()
if sys.argv[2] == "close":
    if os.fork() == 0:  # a DataLoader worker's fork: shares the lock's open file description
        time.sleep(120)
        os._exit(0)
    ckpt.close()
print("saved", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("then", ["kill", "close"])
def test_another_process_holds_the_directory_until_it_dies_or_closes(tmp_path: Path, then: str) -> None:
    """A job in another process that saved into the directory: a save here is refused, naming its
    pid, while ``ooc checkpoints list`` works; once it is killed (``kill -9``: the kernel drops the
    lock), or has closed its Checkpointer (though a child it forked still shares the lock's file),
    the save goes through."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDS_THE_DIRECTORY, str(tmp_path), then],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "saved"
        ckpt = _saving(tmp_path, ())
        if then == "kill":
            with pytest.raises(CheckpointError, match=rf"another job holds .*: pid {holder.pid} on "):
                ckpt.save(2)
            listed = subprocess.run([sys.executable, "-m", "ooc", "checkpoints", "list", str(tmp_path)],
                                    capture_output=True, text=True, timeout=300)
            assert listed.returncode == 0 and listed.stdout.split()[:2] == ["step", "1"], listed.stderr
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait()
        ckpt.save(2)
        ckpt.wait()
        ckpt.close()
        assert _steps(tmp_path) == [1, 2]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, signal.SIGKILL)  # the forked child too
        holder.wait()


_FORKS_A_CHILD_THAT_EXITS = """
import os, sys, time
import torch
from ooc.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1], torch.nn.Linear(3, 2))
ckpt.save(1)
ckpt.wait()
child = os.fork()
if child == 0:
    sys.exit(0)  # as a Python program ends: its atexit handlers run, the copied Checkpointer's finalizer too
os.waitpid(child, 0)
print("saved", flush=True)
time.sleep(120)
"""


def test_a_forked_child_that_exits_leaves_the_directory_held(tmp_path: Path) -> None:
    """A holder forks a child that ends as Python programs do (``sys.exit``: not a DataLoader
    worker's ``os._exit``): the child's exit ran the finalizer of its copy of the Checkpointer, which
    unlocked the lock's open file description it shares with the parent and deleted the lock file,
    and another job then saved into the directory beside the live holder. Now it is still refused."""
    holder = subprocess.Popen([sys.executable, "-c", _FORKS_A_CHILD_THAT_EXITS, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "saved"
        ckpt = _saving(tmp_path, ())
        with pytest.raises(CheckpointError, match=rf"another job holds .*: pid {holder.pid} on "):
            ckpt.save(2)
        assert {".writer-rank0.lock", ".writer-rank0.owner"} <= {p.name for p in tmp_path.iterdir()}
    finally:
        holder.kill()
        holder.wait()


def test_a_crashs_lock_file_is_reused_and_cleaned(tmp_path: Path) -> None:
    """A killed job leaves its lock file, unlocked, and its owner record (of a process of this host
    that is gone: here an earlier process with this pid): the next job takes them over, and rank 0's
    next cleanup deletes those nobody holds (NOTE [owner records])."""
    (tmp_path / ".writer-rank0.lock").write_text("pid 1 on elsewhere")
    (tmp_path / ".writer-rank3.lock").write_text("pid 1 on elsewhere")
    for rank in (0, 3):
        _write_owner_record(tmp_path / f".writer-rank{rank}.owner", started="1")
    # Killed while it made a record, or dropped a dead one (a minute ago), and just now (maybe live).
    for name in (".writer-rank0.owner.0123abcd.tmp", ".writer-rank0.owner.4567.dead", ".writer-rank1.owner.89ab.tmp"):
        (tmp_path / name).write_text("{}")
        os.utime(tmp_path / name, (time.time() - 120,) * 2)
    (tmp_path / ".writer-rank2.owner.cdef.tmp").write_text("{}")
    ckpt = _saving(tmp_path, (1,))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".writer-rank0.lock", ".writer-rank0.owner",
                                                          ".writer-rank2.owner.cdef.tmp", "step-000000001"]
    assert json.loads((tmp_path / ".writer-rank0.owner").read_text())["started"] != "1"
    (tmp_path / ".writer-rank2.owner.cdef.tmp").unlink()
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001"]


def test_without_flock_the_directory_is_written_unlocked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without flock (ENOLCK: Lustre without ``-o flock``): saves work as before, unlocked
    (another job is not detected); a newer Checkpointer in this process still takes over, which needs
    no flock (NOTE [a newer Checkpointer takes over])."""
    def flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)
    ckpt = _saving(tmp_path, (1, 2))
    other = _saving(tmp_path, (), seed=1)
    with pytest.warns(UserWarning, match="took the directory over"):  # in one process: no flock needed
        other.save(3)
    other.wait()
    for c in (ckpt, other):
        c.close()
    assert _steps(tmp_path) == [1, 2, 3]


def test_ooc_train_into_a_directory_another_job_holds_stops_before_it_trains(tmp_path: Path) -> None:
    """``ooc train --save DIR`` started beside a live job saving into DIR: it stops before its first
    step, naming the holder, and writes nothing there."""
    directory = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDS_THE_DIRECTORY, str(directory), "kill"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "saved"
        before = sorted(p.name for p in directory.rglob("*"))
        done = subprocess.run([sys.executable, "-m", "ooc", "train", "--preset", "nano", "--steps", "1", "--batch-size",
                               "2", "--seq", "16", "--plan", "keep", "--no-progress", "--save", str(directory)],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert f"another job holds the checkpoint directory {directory}: pid {holder.pid} on " in done.stderr
        assert "loss" not in done.stdout
        assert sorted(p.name for p in directory.rglob("*")) == before
    finally:
        holder.kill()
        holder.wait()


def test_two_models_saved_into_one_directory_are_told_to_use_two(tmp_path: Path) -> None:
    """A model and its EMA copy, each with a Checkpointer on one directory: the second's first save
    took the directory over and the first's next save said only "superseded ... save with the newer
    one", advice for a notebook cell run again that loses the other model's versions here. Both
    messages say to give each Checkpointer a directory of its own."""
    model, ema = nn.Linear(3, 2), nn.Linear(3, 2)
    first, second = Checkpointer(tmp_path, model), Checkpointer(tmp_path, ema)
    first.save(1)
    with pytest.warns(UserWarning, match="to save two models .* give each Checkpointer a directory of its own"):
        second.save(2)
    with pytest.raises(CheckpointError, match="saving two models .* give each a directory of its own"):
        first.save(3)
    second.close()
