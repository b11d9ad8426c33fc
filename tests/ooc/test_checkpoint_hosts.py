"""ooc.checkpoint where flock does not reach across hosts (issue 14; NOTE [owner records]): NFS mounted
with ``local_lock=flock``, Lustre with ``-o localflock``, or no flock at all. Two hosts are simulated
on one machine: the holder, a real job in another process, and "host-b", this process with another
host name and boot id and a flock that never conflicts (as a host-local flock looks from another
host) or fails with ENOLCK (none at all)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import ooc.checkpoint as ckpt_mod
from ooc.checkpoint import Checkpointer, CheckpointError, list_versions

_HOST = os.uname().nodename

_HOLDER = """
import errno, fcntl, sys, time
import torch
import ooc.checkpoint as ckpt_mod
directory, flock, pause = sys.argv[1], sys.argv[2], sys.argv[3]
ckpt_mod._HEARTBEAT_SECONDS = 0.1
if flock == "none":
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    fcntl.flock = no_flock
torch.manual_seed(0)
ckpt = ckpt_mod.Checkpointer(directory, torch.nn.Linear(3, 2), keep=1)
ckpt.save(1)
ckpt.wait()
print("saved 1", flush=True)
def hook(point):
    if point == pause:
        print("paused", flush=True)
        sys.stdin.readline()
ckpt._hook = hook
if pause != "idle":
    ckpt.save(2)
    ckpt.wait()
    print("saved 2", flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def _holder(directory: Path, *, flock: str = "host", pause: str = "idle"):  # noqa: ANN202
    """A job in another process that saved version 1 into ``directory`` and holds it (its flock:
    ``host``, the real one, or ``none``: ENOLCK); ``pause``: the point of version 2's write where it
    waits for a line on its stdin."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory), flock, pause], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saved 1"
        if pause != "idle":
            assert proc.stdout.readline().strip() == "paused"
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def _as_host_b(monkeypatch: pytest.MonkeyPatch, flock: str) -> None:
    """This process as a job on another host: another host name and boot id; its flock never
    conflicts (``host``: a host-local flock, as seen from another host) or fails (``none``)."""
    monkeypatch.setattr(ckpt_mod, "_kernel", lambda: ("host-b", "boot-b"))
    _without_flock(monkeypatch, flock)


def _without_flock(monkeypatch: pytest.MonkeyPatch, flock: str) -> None:
    def local(fd: int, op: int) -> None:
        if flock == "none":
            raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", local)


def _checkpointer(directory: Path) -> Checkpointer:
    torch.manual_seed(1)
    return Checkpointer(directory, nn.Linear(3, 2), keep=1)


def _save_once_stale(ckpt: Checkpointer, step: int, holder: int, deadline: float = 60.0) -> float:
    """Save ``step``, refused (naming ``holder``) until the holder counts as dead; return how long it
    was refused."""
    start = time.monotonic()
    while True:
        try:
            ckpt.save(step)
        except CheckpointError as exc:
            assert f"pid {holder} on {_HOST}" in str(exc)
            assert time.monotonic() - start < deadline, "a dead holder's record blocked the directory for good"
            time.sleep(0.1)
            continue
        ckpt.wait()
        return time.monotonic() - start


@pytest.mark.parametrize(("flock", "host"), [("host", "host-b"), ("none", "host-b"), ("none", _HOST)],
                         ids=["host-local-flock", "no-flock-another-host", "no-flock-this-host"])
def test_a_job_on_another_host_is_refused_until_the_holder_is_dead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   flock: str, host: str) -> None:
    """A job saving into a directory a job on another host holds, whose flock this host does not see:
    it took the lock too and wrote the same versions, and its cleanup deleted the holder's lock file.
    Now it is refused by the holder's owner record, naming the holder's host and pid and what to do,
    and leaves the holder's files alone; once the holder is killed, it takes the directory over: at
    once on the holder's host (the pid is gone), after the heartbeat is stale on another."""
    monkeypatch.setattr(ckpt_mod, "_STALE_SECONDS", 1.5)
    with _holder(tmp_path, flock="none" if flock == "none" else "host") as holder:
        if host == "host-b":
            _as_host_b(monkeypatch, flock)
        else:
            _without_flock(monkeypatch, flock)
        ckpt = _checkpointer(tmp_path)  # rank 0 cleans up first
        with pytest.raises(CheckpointError, match=rf"another job holds the checkpoint directory {tmp_path}: pid "
                                                  rf"{holder.pid} on {_HOST} holds its owner record \.writer-rank0\.owner"
                                                  r".*Stop that job.*try again then"):
            ckpt.save(2)
        assert [v.step for v in list_versions(tmp_path)] == [1]
        assert {".writer-rank0.lock", ".writer-rank0.owner"} <= {p.name for p in tmp_path.iterdir()}
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        killed = time.monotonic()
        refused = _save_once_stale(ckpt, 2, holder.pid)
        if host == "host-b":
            assert time.monotonic() - killed >= 1.0  # its last heartbeat at most 0.1 s before the kill
        else:
            assert refused < 1.0
    ckpt.close()
    # (without flock the lock file stays: nothing tells it is not held)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".writer-rank0.lock") == ["step-000000002"]


@pytest.mark.parametrize("flock", ["host", "none"])
def test_another_hosts_cleanup_leaves_alone_the_version_being_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     flock: str) -> None:
    """A Checkpointer made on another host (rank 0 cleans up the directory: to save, or only to
    restore) while the holder writes version 2: it moved the folder away as a crash's leftover, its
    ``.writing.lock`` being free as far as it could see, and the holder's commit failed. Now the
    holder's owner record in the folder keeps it, and the version commits."""
    with _holder(tmp_path, flock=flock, pause="files-written") as holder:
        _as_host_b(monkeypatch, flock)
        reader = _checkpointer(tmp_path)
        assert (tmp_path / "step-000000002" / "model.safetensors").exists()
        assert reader.restore().step == 1
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "saved 2"
        assert [v.step for v in list_versions(tmp_path)] == [2]
        assert reader.restore().step == 2
        reader.close()


@pytest.mark.parametrize("point", [
    "write:model.safetensors",
    pytest.param("files-written", marks=pytest.mark.slow),
    pytest.param("manifest-written", marks=pytest.mark.slow),
    pytest.param("renamed", marks=pytest.mark.slow),
])
def test_a_holder_killed_mid_write_on_another_host_leaves_the_previous_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    """``kill -9`` of the holder while it writes version 2, seen from another host: the last committed
    version restores meanwhile; the dead holder blocks the directory only until its heartbeat is
    stale, and the job that takes it over removes the dead holder's incomplete folder and records."""
    monkeypatch.setattr(ckpt_mod, "_STALE_SECONDS", 1.5)
    with _holder(tmp_path, pause=point) as holder:
        _as_host_b(monkeypatch, "host")
        ckpt = _checkpointer(tmp_path)  # made while the holder lives: its cleanup leaves the folder
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    committed = 2 if point == "renamed" else 1
    assert ckpt.restore().step == committed
    _save_once_stale(ckpt, 3, holder.pid)
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000003"]
    assert sorted(p.name for p in (tmp_path / "step-000000003").iterdir() if p.name.startswith(".")) == []


def test_the_heartbeat_keeps_a_record_fresh_until_it_is_released(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder's heartbeat thread touches its records, so that another host sees them live for as
    long as the holder runs, idle or not; a record nobody touches goes stale."""
    monkeypatch.setattr(ckpt_mod, "_HEARTBEAT_SECONDS", 0.05)
    monkeypatch.setattr(ckpt_mod, "_STALE_SECONDS", 0.5)
    path = tmp_path / ".writer-rank0.owner"
    record = ckpt_mod._OwnerRecord.make(path)
    monkeypatch.setattr(ckpt_mod, "_kernel", lambda: ("host-b", "boot-b"))
    time.sleep(1.0)
    holder = ckpt_mod._read_holder(path)
    assert str(holder) == f"pid {os.getpid()} on {_HOST}" and holder.live()
    record.release()
    assert not path.exists()
    path.write_text(json.dumps({"host": "host-a", "boot": "a", "pid": 1, "started": "1", "token": "0"}))
    assert ckpt_mod._read_holder(path).live()
    time.sleep(0.6)
    assert not ckpt_mod._read_holder(path).live()


@pytest.mark.parametrize("when", ["between-versions", "mid-write"])
def test_a_holder_taken_over_by_another_host_writes_and_deletes_nothing_more(tmp_path: Path, when: str) -> None:
    """A holder whose record another host took over (judging it dead: this process was stopped past
    the stale time) wrote on over the new holder's versions and had its retention delete them. Now
    its save fails saying who took the directory over, and it deletes nothing; at close it leaves
    the new holder's record."""
    ckpt = _checkpointer(tmp_path)
    ckpt.save(1)
    ckpt.wait()
    record = tmp_path / ".writer-rank0.owner"

    def take_over() -> None:
        record.rename(tmp_path / "taken")  # as _drop_dead_record does
        record.write_text(json.dumps({"host": "host-b", "boot": "b", "pid": 4242, "started": "1", "token": "0"}))

    if when == "between-versions":
        take_over()
    else:
        ckpt._hook = lambda point: take_over() if point == "files-written" else None
    ckpt.save(2)
    with pytest.raises(CheckpointError, match=r"no longer holds the checkpoint directory .*: pid 4242 on host-b took it "
                                              r"over, as this process's heartbeat on \.writer-rank0\.owner had stopped"):
        ckpt.wait()
    assert [v.step for v in list_versions(tmp_path)] == ([1] if when == "between-versions" else [1, 2])
    ckpt.close()
    assert json.loads(record.read_text())["pid"] == 4242


def test_a_file_system_without_hard_links_still_saves_and_refuses_another_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vfat, exFAT and FUSE file systems such as s3fs refuse ``link()`` (EPERM, EOPNOTSUPP): every
    save failed making its owner record. There a record is made with ``O_EXCL`` instead, and still
    refuses a job on another host."""
    def link(src: str | Path, dst: str | Path) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted", str(src))

    monkeypatch.setattr(os, "link", link)
    ckpt = _checkpointer(tmp_path)
    ckpt.save(1)
    ckpt.wait()
    assert json.loads((tmp_path / ".writer-rank0.owner").read_text())["pid"] == os.getpid()
    with monkeypatch.context() as elsewhere:
        _as_host_b(elsewhere, "host")
        holder = ckpt_mod._read_holder(tmp_path / ".writer-rank0.owner")
        assert holder.live() and str(holder) == f"pid {os.getpid()} on {_HOST}"
    ckpt.save(2)
    ckpt.wait()
    ckpt.close()
    assert [v.step for v in list_versions(tmp_path)] == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000002"]


def test_a_record_released_by_a_finalizer_inside_the_heartbeat_does_not_hang_it(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [a release while the lock is held]: the garbage collector ran a dropped Checkpointer's
    finalizer inside the heartbeat thread's beats, and its record's release waited for the lock that
    thread held: the heartbeat hung, then the writer and ``wait()`` behind it (a CI worker, for good).
    Here a beat releases another record as that finalizer did; both records go, and the heartbeat
    goes on."""
    monkeypatch.setattr(ckpt_mod, "_HEARTBEAT_SECONDS", 0.05)
    first = ckpt_mod._OwnerRecord.make(tmp_path / "a.owner")
    second = ckpt_mod._OwnerRecord.make(tmp_path / "b.owner")
    released = threading.Event()
    plain_beat = ckpt_mod._OwnerRecord.beat

    def beat_then_collect(record: ckpt_mod._OwnerRecord) -> None:
        plain_beat(record)
        if record is first and not released.is_set():
            released.set()
            second.release()  # what the finalizer did, on the heartbeat thread, inside its beats

    monkeypatch.setattr(ckpt_mod._OwnerRecord, "beat", beat_then_collect)
    assert released.wait(5.0)
    done = threading.Event()
    threading.Thread(target=lambda: (first.release(), done.set()), daemon=True).start()
    assert done.wait(5.0), "the heartbeat thread hangs holding its lock"
    deadline = time.monotonic() + 5.0
    while (tmp_path / "b.owner").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not (tmp_path / "a.owner").exists() and not (tmp_path / "b.owner").exists()


@pytest.mark.parametrize("content", [b"", b"{\"host\": \"h\", \"pi"], ids=["empty", "garbled"])
def test_a_damaged_owner_record_is_named_as_damaged_and_goes_stale(tmp_path: Path, content: bytes) -> None:
    """An owner record emptied by a crash of its host (made with ``link()`` but not fsynced) named
    its holder "pid 0 on an unknown host", a job to go and stop that is none. It is named as damaged,
    with what to do; once its heartbeat (its mtime) is stale, it is taken over as a dead job's."""
    ckpt = Checkpointer(tmp_path, nn.Linear(3, 2))
    ckpt.save(1)
    ckpt.close()
    record = tmp_path / ".writer-rank0.owner"
    record.write_bytes(content)
    ckpt = Checkpointer(tmp_path, nn.Linear(3, 2))
    with pytest.raises(CheckpointError, match=r"a job that its damaged owner record does not name .*delete the record"):
        ckpt.save(2)
    stale = time.time() - ckpt_mod._STALE_SECONDS - 5
    os.utime(record, (stale, stale))
    ckpt.save(2)
    ckpt.close()
    assert [v.step for v in list_versions(tmp_path)] == [1, 2]
