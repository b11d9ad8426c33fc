"""ooc.checkpoint and the process around it (issue 14): a relative directory and ``os.chdir``, two
jobs saving into one directory (NOTE [one job per directory])."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from ooc.checkpoint import Checkpointer, CheckpointError, list_versions


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


def _saving(directory: Path, steps: tuple[int, ...], seed: int = 0) -> Checkpointer:
    model = _linear(seed)
    ckpt = Checkpointer(directory, model, torch.optim.AdamW(model.parameters()), keep=3)
    for step in steps:
        ckpt.save(step)
        ckpt.wait()
    return ckpt


def test_a_second_checkpointer_saving_into_a_held_directory_is_refused_and_readers_work(tmp_path: Path) -> None:
    """Two Checkpointers on one directory, the second saving the step the first is writing: their
    files went into one folder over each other (the restore caught it as a checksum error, or a mix
    of the two models' files restored). The second now fails at once, saying another job holds the
    directory, and writes nothing; reading works meanwhile; once the first is closed, it saves."""
    first = _saving(tmp_path, (1, 2))
    second = _saving(tmp_path, (), seed=1)
    in_flight, go = threading.Event(), threading.Event()
    first._hook = lambda point: point == "write:model.safetensors" and (in_flight.set(), go.wait(10))
    first.save(3)
    assert in_flight.wait(10)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for attempt in (lambda: second.save(3), lambda: second.save(4), lambda: second.check_step(4)):
        with pytest.raises(CheckpointError, match=rf"another job holds the checkpoint directory {tmp_path}: pid "
                                                  rf"{os.getpid()} on .*close\(\) its Checkpointer"):
            attempt()
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert second.restore().step == 2 and [v.step for v in second.versions()] == [1, 2]
    go.set()
    first.wait()
    first.close()
    assert _steps(tmp_path) == [1, 2, 3] and not list(tmp_path.glob(".writer-*"))
    assert second.restore().step == 3
    second.save(4)
    second.wait()
    second.close()
    assert _steps(tmp_path) == [2, 3, 4] and not list(tmp_path.glob(".writer-*"))


def test_the_ranks_of_one_job_share_the_directory(tmp_path: Path) -> None:
    """Each rank locks a file of its own: two ranks (here in one process) save alike, but a second
    rank 1 is refused."""
    ranks = [Checkpointer(tmp_path, _linear(), rank=r, world=2) for r in range(2)]
    for ckpt in ranks:
        ckpt.save(1)
        ckpt.wait()
    with pytest.raises(CheckpointError, match="another job holds"):
        Checkpointer(tmp_path, _linear(), rank=1, world=2).save(2)
    for ckpt in ranks:
        ckpt.close()
    assert _steps(tmp_path) == [1]


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


def test_a_crashs_lock_file_is_reused_and_cleaned(tmp_path: Path) -> None:
    """A killed job leaves its lock file, unlocked: the next job takes it, and rank 0's next cleanup
    deletes one nobody holds."""
    (tmp_path / ".writer-rank0.lock").write_text("pid 1 on elsewhere")
    (tmp_path / ".writer-rank3.lock").write_text("pid 1 on elsewhere")
    ckpt = _saving(tmp_path, (1,))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".writer-rank0.lock", "step-000000001"]
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001"]


def test_without_flock_the_directory_is_written_unlocked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without flock (ENOLCK: Lustre without ``-o flock``): saves work as before, unlocked."""
    def flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)
    ckpt = _saving(tmp_path, (1, 2))
    other = _saving(tmp_path, (), seed=1)
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
