"""ooc.checkpoint: never-torn versions, checked files, exact resume, safetensors weights, the CLI."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import random
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import xxhash

import ooc.checkpoint as ckpt_mod
from ooc.checkpoint import MODEL_FILE, Checkpointer, CheckpointError, CorruptCheckpointError, list_versions
from ooc.models.gpt import GPT, GPT_PRESETS
from ooc.optim import HostAdamW
from ooc.optim.stages import Stage

CFG = replace(GPT_PRESETS["nano"], n_layer=2, dropout=0.1)  # dropout: a resume must restore the RNG
_VERSION = re.compile(r"^step-\d{9,}$")


def _setup(dtype: torch.dtype = torch.float32, *, pipeline: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(CFG).to(dtype)
    opt = HostAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, model=model, pipeline=pipeline)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CFG.vocab_size, (2, 16), generator=gen)
    return x, torch.roll(x, -1, dims=1)


def _train(model, opt, sched, steps: range, ckpt: Checkpointer | None = None) -> list[float]:  # noqa: ANN001
    losses = []
    for step in steps:
        x, y = _batch(step)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(float(loss))
        if ckpt is not None:
            ckpt.save(step + 1, loss=losses[-1])
    opt.synchronize()
    return losses


def _weights(model) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def _opt_state(opt) -> dict:  # noqa: ANN001
    return {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in opt.state_dict()["state"].items()}


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(torch.equal(a[i][k], b[i][k]) for k in a[i]) for i in a)


def _assert_restores(directory: Path, step: int | None, expected: dict, expected_state: dict,
                     dtype: torch.dtype = torch.float32) -> None:
    """A fresh model and optimizer (other initial weights) restored from ``directory`` hold exactly
    ``expected`` weights and ``expected_state``."""
    model, opt, _ = _setup(dtype, seed=3)
    Checkpointer(directory, model, opt).restore(step)
    try:
        assert _same(_weights(model), expected)
        assert _same_state(_opt_state(opt), expected_state)
    finally:
        opt.close()


def test_a_version_saved_before_any_update_restores_a_fresh_optimizer(tmp_path: Path) -> None:
    """Its optimizer file holds no state (NOTE [a fresh state is not saved]); a trained optimizer
    restored from it is fresh again, and trains on as an untouched one."""
    model, opt, sched = _setup()
    straight = _train(model, opt, sched, range(3))
    final, final_state = _weights(model), _opt_state(opt)
    opt.close()

    model, opt, sched = _setup()
    ckpt = Checkpointer(tmp_path, model, opt, scheduler=sched)
    ckpt.save(0)
    _train(model, opt, sched, range(2))
    ckpt.wait()
    assert ckpt.restore().step == 0 and _opt_state(opt) == {}
    assert _train(model, opt, sched, range(3)) == straight
    assert _same(_weights(model), final) and _same_state(_opt_state(opt), final_state)
    opt.close()


def test_a_version_of_torch_adamw_with_a_frozen_weight_restores_into_host_adamw(tmp_path: Path) -> None:
    """AdamW holds no state for a weight it never updated; the restored HostAdamW gives it a fresh
    one (the restore refused: "has no optimizer state for parameter wpe.weight")."""
    torch.manual_seed(0)
    model = GPT(CFG)
    model.wpe.weight.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(2):
        model(*_batch(step))[1].backward()
        opt.step()
        opt.zero_grad()
    ckpt = Checkpointer(tmp_path, model, opt)
    ckpt.save(2)
    ckpt.wait()
    other = GPT(CFG)
    other.wpe.weight.requires_grad_(False)
    host = HostAdamW(other.parameters(), lr=3e-3, model=other)
    try:
        Checkpointer(tmp_path, other, host).restore()
        assert _same(_weights(other), _weights(model))
        assert float(host.state[other.wpe.weight]["step"]) == 0
        assert _same_state(_opt_state(host), {i: s for i, s in opt.state_dict()["state"].items()})
    finally:
        host.close()


def test_three_line_loop_docstring_example(tmp_path: Path) -> None:
    """The module docstring's loop, as written: a fresh start, then a resume from the newest version."""
    model, opt, sched = _setup()
    ckpt = Checkpointer(tmp_path, model, opt, keep=3)
    start = ckpt.restore().step + 1 if ckpt.latest() else 0
    assert start == 0
    for step in range(start, 3):
        x, y = _batch(step)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.save(step, loss=float(loss.detach()))
    ckpt.wait()
    assert [v.step for v in ckpt.versions()] == [0, 1, 2]
    assert ckpt.latest().metadata["loss"] == float(loss.detach())
    opt.close()
    model2, opt2, _ = _setup(seed=1)
    ckpt2 = Checkpointer(tmp_path, model2, opt2, keep=3)
    start = ckpt2.restore().step + 1 if ckpt2.latest() else 0
    assert start == 3
    assert _same(_weights(model2), _weights(model))
    opt2.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "in-step"])
def test_resume_continues_bit_identically(tmp_path: Path, dtype: torch.dtype, pipeline: bool) -> None:
    model, opt, sched = _setup(dtype, pipeline=pipeline)
    straight = _train(model, opt, sched, range(6))
    final, final_state = _weights(model), _opt_state(opt)
    opt.close()

    model, opt, sched = _setup(dtype, pipeline=pipeline)
    ckpt = Checkpointer(tmp_path, model, opt, scheduler=sched, keep=2)
    _train(model, opt, sched, range(3), ckpt)
    _train(model, opt, sched, range(3, 5))  # steps after the version, lost in the "crash"
    ckpt.wait()
    opt.close()

    model, opt, sched = _setup(dtype, pipeline=pipeline, seed=7)  # other initial weights: all must be loaded
    ckpt = Checkpointer(tmp_path, model, opt, scheduler=sched, keep=2)
    v = ckpt.restore()
    assert v.step == 3 and v.metadata["loss"] == straight[2]
    assert sched.last_epoch == 3
    resumed = _train(model, opt, sched, range(3, 6))
    assert resumed == straight[3:]
    assert _same(_weights(model), final)
    assert _same_state(_opt_state(opt), final_state)  # fp32 masters and moments included
    opt.close()


def test_rng_and_extra_round_trip(tmp_path: Path) -> None:
    model, opt, _ = _setup()
    extra = {"position": 41, "epoch": 2}
    ckpt = Checkpointer(tmp_path, model, opt, extra=extra)
    torch.manual_seed(5)
    random.seed(5)
    ckpt.save(1)
    ckpt.wait()
    expected = (torch.rand(4), random.random())
    extra["position"] = 0
    torch.manual_seed(99)
    ckpt.restore()
    assert extra == {"position": 41, "epoch": 2}
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1]
    opt.close()


def test_cuda_rng_states_of_devices_this_process_lacks_are_left_out(monkeypatch) -> None:  # noqa: ANN001
    """A version saved by a process that saw 2 GPUs (torchrun on a bigger node: every rank sees
    every device, and saves each one's RNG state) restored where 1 is visible: torch sets device 1's
    state on a generator that does not exist, at once or, before CUDA starts, when it does (its
    lazy initialization then fails). The states of devices beyond this process's are left out
    (simulated: no GPU here)."""
    set_on: list[int] = []

    def set_rng_state_all(states) -> None:  # noqa: ANN001 - as torch.cuda's: device i gets state i
        for i, _ in enumerate(states):
            if i >= torch.cuda.device_count():
                raise IndexError(f"no CUDA device {i}")
            set_on.append(i)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_rng_state_all)
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": [torch.zeros(16, dtype=torch.uint8)] * 2}
    ckpt_mod.set_rng_state(state)
    assert set_on == [0]


def test_retention_keeps_the_newest(tmp_path: Path) -> None:
    model, opt, sched = _setup()
    ckpt = Checkpointer(tmp_path, model, opt, keep=2)
    for step in range(5):
        ckpt.save(step)
    ckpt.wait()
    assert [v.step for v in ckpt.versions()] == [3, 4]
    # The newest version retired is the next one's spare (NOTE [recycled files]), deleted by close(), as
    # are the lock and the owner record of the writing job (NOTE [one job per directory], NOTE [owner records]).
    assert sorted(p.name for p in tmp_path.iterdir()) == [".spare-000000002", ".writer-rank0.lock", ".writer-rank0.owner",
                                                          "step-000000003", "step-000000004"]
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000003", "step-000000004"]
    opt.close()


def test_safetensors_weights_load_without_ooc(tmp_path: Path) -> None:
    model, opt, sched = _setup()
    _train(model, opt, sched, range(2))
    ckpt = Checkpointer(tmp_path / "ck", model, opt)
    ckpt.save(2)
    ckpt.wait()
    fresh = GPT(CFG)
    fresh.load_state_dict(safetensors.torch.load_file(ckpt.latest().path / "model.safetensors"))
    assert _same(_weights(fresh), _weights(model))
    out = ckpt.export(2, tmp_path / "weights.safetensors")
    other = GPT(CFG)
    other.load_state_dict(safetensors.torch.load_file(out))
    assert _same(_weights(other), _weights(model))
    opt.close()


def _two_versions(tmp_path: Path):
    model, opt, sched = _setup()
    ckpt = Checkpointer(tmp_path, model, opt, scheduler=sched, keep=3)
    _train(model, opt, sched, range(2), ckpt)
    ckpt.wait()
    return model, opt, sched, ckpt


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer-rank0.safetensors", "state-rank0.pt",
                                  "model.safetensors.index.json"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_corrupt_file_is_named_and_fallback_loads_the_previous(tmp_path: Path, name: str, damage: str) -> None:
    model, opt, sched, ckpt = _two_versions(tmp_path)
    path = ckpt.latest().path / name
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=name):
        ckpt.restore()
    assert ckpt.restore(fallback=True).step == 1
    opt.close()


FAIL_POINTS = ["snapshot", "write:model.safetensors", "write:model.safetensors.index.json",
               "write:optimizer-rank0.safetensors", "write:state-rank0.pt", "files-written", "manifest-written", "renamed",
               "committed"]


def _save_failing_at(ckpt: Checkpointer, step: int, point: str) -> None:
    """``save(step)`` with an exception injected at the writer's ``point``, which ``wait`` raises."""

    def hook(at: str) -> None:
        if at == point:
            raise RuntimeError(f"injected at {at}")

    ckpt._hook = hook
    ckpt.save(step)
    with pytest.raises(CheckpointError, match=f"injected at {point}"):
        ckpt.wait()


@pytest.mark.parametrize("point", FAIL_POINTS)
def test_exception_at_each_commit_point_leaves_the_previous_version(tmp_path: Path, point: str) -> None:
    model, opt, sched, ckpt = _two_versions(tmp_path)
    previous = ckpt.latest()
    _save_failing_at(ckpt, 3, point)
    latest = ckpt.latest()
    if point in ("renamed", "committed"):  # the rename is the commit: the version exists (what failed came after)
        assert latest.step == 3
    else:
        assert latest.step == previous.step
        assert not (tmp_path / "step-000000003").exists()
    assert not list(tmp_path.rglob("*.tmp"))
    assert ckpt.restore().step == latest.step
    opt.close()


def _inodes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in folder.iterdir() if p.suffix in (".safetensors", ".pt")}


def test_a_retired_versions_files_are_written_over_by_the_next(tmp_path: Path) -> None:
    """NOTE [recycled files]: with keep=1 the version retention retires becomes a spare, not a
    version; the next version's files are its files written over (the same inodes), and that version
    restores exactly; close() leaves the versions only."""
    model, opt, sched = _setup()
    ckpt = Checkpointer(tmp_path, model, opt, keep=1)
    inodes = {}
    for step in range(1, 4):
        _train(model, opt, sched, range(step - 1, step))
        ckpt.save(step)
        ckpt.wait()
        inodes[step] = _inodes(ckpt.latest().path)
        assert [v.step for v in list_versions(tmp_path)] == [step]
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".spare-")] == (
            [f".spare-{step - 1:09d}"] if step > 1 else [])
    assert inodes[3] == inodes[1] and inodes[2] != inodes[1] and len(inodes[1]) == 3
    expected = (_weights(model), _opt_state(opt))
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000003"]
    _assert_restores(tmp_path, 3, *expected)
    opt.close()


@pytest.mark.parametrize("kind", ["nfs", "lustre", "fuse.sshfs", None])
def test_on_a_shared_or_unknown_file_system_versions_go_into_new_files(tmp_path: Path, monkeypatch, kind) -> None:  # noqa: ANN001
    """NOTE [recycled files]: a lease sees this host's readers only, so where another host may read
    (or the file system is unknown) no retired file is written over: every version has new files."""
    monkeypatch.setattr(ckpt_mod, "_file_system", lambda directory: kind)
    model, opt, sched = _setup()
    ckpt = Checkpointer(tmp_path, model, opt, keep=1)
    inodes = []
    for step in range(1, 4):
        _train(model, opt, sched, range(step - 1, step))
        ckpt.save(step)
        ckpt.wait()
        inodes.append(set(_inodes(ckpt.latest().path).values()))
    assert not inodes[2] & inodes[0]
    ckpt.close()
    opt.close()


def test_the_file_system_of_a_folder_is_read_from_the_mount_table(tmp_path: Path) -> None:
    assert ckpt_mod._file_system(Path("/proc/self")) == "proc"
    assert ckpt_mod._file_system(tmp_path / "not" / "made") == ckpt_mod._file_system(tmp_path)


@pytest.mark.parametrize("point", [*FAIL_POINTS, "retired"])
def test_exception_at_each_point_of_a_recycling_save_leaves_the_previous_version(tmp_path: Path, point: str) -> None:
    """As the commit-point test, where the failing save writes over a spare's files and its
    retention retires the previous version: whatever fails, the newest committed version restores
    exactly, nothing half-written is a version, and a new Checkpointer cleans up."""
    model, opt, sched = _setup()
    ckpt = Checkpointer(tmp_path, model, opt, keep=1)
    for step in (1, 2):
        _train(model, opt, sched, range(step - 1, step))
        ckpt.save(step)
        ckpt.wait()
    saved2 = (_weights(model), _opt_state(opt))
    _train(model, opt, sched, range(2, 3))
    saved3 = (_weights(model), _opt_state(opt))
    _save_failing_at(ckpt, 3, point)
    committed = point in ("renamed", "committed", "retired")
    assert [v.step for v in list_versions(tmp_path)] == ([2, 3] if point in ("renamed", "committed") else
                                                        [3] if committed else [2])
    _assert_restores(tmp_path, None, *(saved3 if committed else saved2))
    assert not list(tmp_path.rglob("*.tmp"))
    ckpt.close()
    Checkpointer(tmp_path, model, opt, keep=1).close()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".spare-")]
    assert all((p / "manifest-rank0.json").exists() for p in tmp_path.iterdir())
    opt.close()


def _keep_one_saving(directory: Path, steps: range):
    """A keep=1 Checkpointer on ``directory`` that has saved ``steps`` (each the step's version)."""
    model, opt, sched = _setup()
    ckpt = Checkpointer(directory, model, opt, keep=1)
    _save_steps(model, opt, sched, ckpt, steps)
    return model, opt, sched, ckpt


def _save_steps(model, opt, sched, ckpt: Checkpointer, steps: range) -> None:  # noqa: ANN001
    for step in steps:
        _train(model, opt, sched, range(step - 1, step))
        ckpt.save(step)
        ckpt.wait()


def test_a_retired_file_a_reader_maps_is_not_written_over(tmp_path: Path) -> None:
    """NOTE [recycled files]: a reader that mapped a retired version's file (safetensors' load_file
    does: its tensors are the file's pages; or mmap itself) keeps its bytes, as after a delete: the
    next version writes that file anew and takes only the spare's files nobody holds."""
    model, opt, sched, ckpt = _keep_one_saving(tmp_path, range(1, 2))
    first = ckpt.latest().path
    inodes = _inodes(first)
    loaded = safetensors.torch.load_file(first / MODEL_FILE)
    expected = {k: v.clone() for k, v in loaded.items()}
    with open(first / "state-rank0.pt", "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    state = bytes(mapped)
    _save_steps(model, opt, sched, ckpt, range(2, 4))  # 1 retired at 2, written over by 3
    assert _same(loaded, expected) and bytes(mapped) == state
    third = _inodes(ckpt.latest().path)
    assert third[MODEL_FILE] != inodes[MODEL_FILE] and third["state-rank0.pt"] != inodes["state-rank0.pt"]
    assert third["optimizer-rank0.safetensors"] == inodes["optimizer-rank0.safetensors"]
    mapped.close()
    saved = (_weights(model), _opt_state(opt))
    ckpt.close()
    _assert_restores(tmp_path, 3, *saved)
    opt.close()


def test_a_retired_file_linked_elsewhere_is_not_written_over(tmp_path: Path) -> None:
    """A hard link to a version's file (a backup made with ``cp -al`` or ``rsync --link-dest``)
    keeps its bytes when retention retires the version, as after a delete (NOTE [recycled files])."""
    model, opt, sched, ckpt = _keep_one_saving(tmp_path / "ck", range(1, 2))
    backup = tmp_path / "backup.safetensors"
    os.link(ckpt.latest().path / MODEL_FILE, backup)
    expected = backup.read_bytes()
    _save_steps(model, opt, sched, ckpt, range(2, 4))
    assert backup.read_bytes() == expected
    saved = (_weights(model), _opt_state(opt))
    ckpt.close()
    _assert_restores(tmp_path / "ck", 3, *saved)
    opt.close()


def test_a_retired_file_that_is_a_symbolic_link_is_not_written_through(tmp_path: Path) -> None:
    """A version's file replaced by a symbolic link (a data-versioning tool such as DVC or git-annex
    links files into its cache; a user deduplicating versions): once retired, the next version was
    written over the link's target, outside the checkpoint directory, through the link. Now the
    link is left to be deleted, as a file shared otherwise is (NOTE [recycled files])."""
    model, opt, sched, ckpt = _keep_one_saving(tmp_path / "ck", range(1, 2))
    cached = tmp_path / "cache" / "object"
    cached.parent.mkdir()
    linked = ckpt.latest().path / MODEL_FILE
    os.replace(linked, cached)
    os.symlink(cached, linked)
    expected = cached.read_bytes()
    _save_steps(model, opt, sched, ckpt, range(2, 4))
    assert cached.read_bytes() == expected
    saved = (_weights(model), _opt_state(opt))
    ckpt.close()
    _assert_restores(tmp_path / "ck", 3, *saved)
    opt.close()


def test_a_retired_read_only_file_is_not_written_over(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """A retired version's file this process may not write (made read-only; as root, simulated) is
    left to be deleted, not taken: the next save writes a new file and succeeds (NOTE [recycled files])."""
    model, opt, sched, ckpt = _keep_one_saving(tmp_path, range(1, 2))
    read_only = {p.stat().st_ino for p in ckpt.latest().path.iterdir()}
    for p in ckpt.latest().path.iterdir():
        p.chmod(0o444)
    real_open = os.open

    def open_(path, flags, *args):  # noqa: ANN001, ANN202
        if flags & (os.O_WRONLY | os.O_RDWR) and os.path.exists(path) and os.stat(path).st_ino in read_only:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_)
    _save_steps(model, opt, sched, ckpt, range(2, 4))
    saved = (_weights(model), _opt_state(opt))
    ckpt.close()
    monkeypatch.undo()
    _assert_restores(tmp_path, 3, *saved)
    opt.close()


def _restore_from_another_at(ckpt: Checkpointer, directory: Path, point: str) -> HostAdamW:
    """At the writer's ``point``, a second Checkpointer (another model and optimizer) opens
    ``directory`` and restores its newest version; returns that optimizer, for the test to close."""
    other_model, other_opt, _ = _setup(seed=5)

    def hook(at: str) -> None:
        if at == point:
            Checkpointer(directory, other_model, other_opt, keep=None).restore()

    ckpt._hook = hook
    return other_opt


def test_a_retirement_another_checkpointer_cleans_away_does_not_fail_the_committed_save(tmp_path: Path) -> None:
    """A Checkpointer opened on the directory (to restore, or by another run) removes incomplete
    folders; one doing so while the training one retires a version (its records gone, the folder
    not yet a spare) leaves retention nothing to rename: the version just committed is reported
    written, as when retention deleted (NOTE [recycled files])."""
    model, opt, sched, ckpt = _keep_one_saving(tmp_path, range(1, 3))
    other_opt = _restore_from_another_at(ckpt, tmp_path, "retired")
    _save_steps(model, opt, sched, ckpt, range(3, 4))
    assert [v.step for v in list_versions(tmp_path)] == [3]
    saved = (_weights(model), _opt_state(opt))
    ckpt.close()
    _assert_restores(tmp_path, 3, *saved)
    opt.close()
    other_opt.close()


@pytest.mark.parametrize("spare", ["longer", "shorter"])
@pytest.mark.parametrize("refused", [None, "open"])
def test_a_full_disk_while_writing_over_a_spare_leaves_the_previous_version(tmp_path: Path, monkeypatch,  # noqa: ANN001
                                                                           spare: str, refused: str | None) -> None:
    """The disk fills while a file taken from a spare, longer or shorter than what is written over
    it, is half written (a short write, then ENOSPC; with direct I/O or without): the save fails
    naming the full disk, the previous version restores exactly, and the next save works."""
    model, opt, sched, ckpt = _keep_one_saving(tmp_path, range(1, 3))
    saved = (_weights(model), _opt_state(opt))
    spare_files = list(next(tmp_path.glob(".spare-*")).iterdir())
    taken = {path.stat().st_ino for path in spare_files}
    for path in spare_files:
        if spare == "longer":
            with open(path, "ab") as f:
                f.write(os.urandom(50000))
        else:
            os.truncate(path, path.stat().st_size // 3)
    if refused:
        _refuse_direct_io(monkeypatch, refused)
    monkeypatch.setattr(ckpt_mod, "_BOUNCE_BYTES", 4 * 4096)
    real_write, writes = os.write, []

    def filling(fd: int, data) -> int:  # noqa: ANN001
        if not os.readlink(f"/proc/self/fd/{fd}").endswith("optimizer-rank0.safetensors"):
            return real_write(fd, data)  # only the optimizer file's writes are counted
        writes.append(os.fstat(fd).st_ino in taken)
        if len(writes) == 2:
            return real_write(fd, data[:len(data) // 2 + 1])  # short, and not a whole block
        if len(writes) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", filling)
    _train(model, opt, sched, range(2, 3))
    ckpt.save(3)
    with pytest.raises(CheckpointError, match="No space left"):
        ckpt.wait()
    assert writes == [True] * 3  # in a file taken from the spare
    assert [v.step for v in list_versions(tmp_path)] == [2] and not (tmp_path / "step-000000003").exists()
    _assert_restores(tmp_path, None, *saved)
    monkeypatch.setattr(os, "write", real_write)
    ckpt.save(3)
    ckpt.wait()
    saved = (_weights(model), _opt_state(opt))
    ckpt.close()
    _assert_restores(tmp_path, 3, *saved)
    opt.close()


def test_a_checkpointer_opened_to_restore_leaves_a_save_in_flight_be(tmp_path: Path) -> None:
    """A second Checkpointer on a directory a run is saving into (to restore its newest version, as
    ``ooc train --resume DIR`` does with a live run's directory) while a save is in flight: the
    save still commits."""
    model, opt, sched, ckpt = _keep_one_saving(tmp_path, range(1, 3))
    other_opt = _restore_from_another_at(ckpt, tmp_path, "files-written")
    try:
        _save_steps(model, opt, sched, ckpt, range(3, 4))
        assert [v.step for v in list_versions(tmp_path)] == [3]
    finally:
        opt.close()
        other_opt.close()


def test_a_spare_another_checkpointer_deletes_while_a_save_takes_its_files_falls_back_to_new_files(
        tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Another Checkpointer on the directory deletes the spares (at its start, or ``close``) while a
    save takes a file out of one, between the check that the file is unshared and its rename (NOTE
    [recycled files]): the save writes a new file instead, commits and restores exactly."""
    model, opt, sched, ckpt = _keep_one_saving(tmp_path, range(1, 3))
    real_unshared, cleaned = ckpt_mod._unshared, []

    def unshared(path: Path) -> bool:
        free = real_unshared(path)
        if free and not cleaned:
            cleaned.append(path.name)
            Checkpointer(tmp_path, torch.nn.Linear(1, 1), keep=None)  # deletes the spares
        return free

    monkeypatch.setattr(ckpt_mod, "_unshared", unshared)
    _save_steps(model, opt, sched, ckpt, range(3, 4))
    assert cleaned and [v.step for v in list_versions(tmp_path)] == [3]
    assert [p.name for p in tmp_path.glob(".spare-*")] == [".spare-000000002"]  # version 1's went, 2 retired
    saved = (_weights(model), _opt_state(opt))
    ckpt.close()
    _assert_restores(tmp_path, 3, *saved)
    opt.close()


@pytest.mark.parametrize("between", ["mkdir-open", "open-lock"])
def test_a_cleanup_between_the_folders_mkdir_and_its_lock_does_not_fail_the_save(tmp_path: Path, monkeypatch,  # noqa: ANN001
                                                                                 between: str) -> None:
    """A cleanup may take a new folder's lock before its writer does (NOTE [folder locks]): it moves
    the folder away and deletes it, and the writer, finding that the lock file it holds (or would
    open) is not the folder's, makes the folder again; the save commits."""
    model, opt, sched, ckpt = _keep_one_saving(tmp_path, range(1, 3))
    real_open, cleaned = os.open, []

    def open_(path, flags, *args, **kwargs):  # noqa: ANN001, ANN202 - rmtree passes dir_fd
        writer = str(path).endswith("step-000000003/" + ckpt_mod._LOCK_FILE) and not cleaned
        if writer:
            cleaned.append(between)  # once: the cleanup opens the file too
        if writer and between == "mkdir-open":
            Checkpointer(tmp_path, torch.nn.Linear(1, 1), keep=None)
        fd = real_open(path, flags, *args, **kwargs)
        if writer and between == "open-lock":
            Checkpointer(tmp_path, torch.nn.Linear(1, 1), keep=None)
        return fd

    monkeypatch.setattr(os, "open", open_)
    _save_steps(model, opt, sched, ckpt, range(3, 4))
    monkeypatch.undo()
    assert cleaned and [v.step for v in list_versions(tmp_path)] == [3]
    assert not list(tmp_path.glob(".removing-*"))
    saved = (_weights(model), _opt_state(opt))
    ckpt.close()
    _assert_restores(tmp_path, 3, *saved)
    opt.close()


def test_a_rank_that_committed_keeps_the_folder_locked_until_every_rank_has(tmp_path: Path) -> None:
    """Two ranks: rank 0 commits version 3 before rank 1 has begun writing it. A Checkpointer opened
    on the directory meanwhile leaves the folder be, as rank 0 still holds its lock (NOTE [folder
    locks]); rank 1 then commits into it, and the version is complete, without a lock file."""
    ranks = [_setup() for _ in range(2)]  # equal replicas
    ckpts = [Checkpointer(tmp_path, m, o, scheduler=s, rank=r, world=2) for r, (m, o, s) in enumerate(ranks)]
    for model, opt, sched in ranks:
        _train(model, opt, sched, range(3))
    ckpts[0].save(3)
    ckpts[0].wait()
    assert (tmp_path / "step-000000003" / "manifest-rank0.json").exists() and not list_versions(tmp_path)
    Checkpointer(tmp_path, torch.nn.Linear(1, 1), keep=None)
    ckpts[1].save(3)
    ckpts[1].wait()
    assert [v.step for v in list_versions(tmp_path)] == [3]
    assert not (tmp_path / "step-000000003" / ckpt_mod._LOCK_FILE).exists()
    expected = (_weights(ranks[0][0]), _opt_state(ranks[0][1]))
    for ckpt in ckpts:
        ckpt.close()
    _assert_restores(tmp_path, 3, *expected)
    for _, opt, _ in ranks:
        opt.close()


def test_a_version_that_failed_on_another_rank_is_let_go_of_and_removed_after_a_newer_one(tmp_path: Path) -> None:
    """Rank 1's write of version 3 fails after rank 0 committed its part: rank 0 holds the folder's
    lock until a newer version is complete (no rank writes 3 any more then), and retention removes
    the incomplete folder after the next save (NOTE [folder locks])."""
    ranks = [_setup() for _ in range(2)]
    ckpts = [Checkpointer(tmp_path, m, o, scheduler=s, rank=r, world=2) for r, (m, o, s) in enumerate(ranks)]
    ckpts[0].save(3)
    ckpts[0].wait()
    _save_failing_at(ckpts[1], 3, "files-written")
    ckpts[1]._hook = lambda point: None
    assert (tmp_path / "step-000000003" / "manifest-rank0.json").exists()
    for step in (4, 5):
        for ckpt in ckpts:
            ckpt.save(step)
            ckpt.wait()
    assert [v.step for v in list_versions(tmp_path)] == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".writer-rank0.lock", ".writer-rank0.owner", ".writer-rank1.lock",
                                                          ".writer-rank1.owner", "step-000000004", "step-000000005"]
    for ckpt in ckpts:
        ckpt.close()
    for _, opt, _ in ranks:
        opt.close()


_HOLDS_A_FOLDER = """
import sys, time
from pathlib import Path
import ooc.checkpoint as C
held = C._FolderLock.writing(Path(sys.argv[1]))  # kept: a lock let go of is released
print("locked", flush=True)
time.sleep(120)
"""


def test_a_folder_another_process_writes_stays_until_that_process_dies(tmp_path: Path) -> None:
    """An incomplete folder whose writer (another process) is alive is left be by a new
    Checkpointer; once that process is killed (``kill -9``: the kernel drops its lock), the next
    Checkpointer removes it as a crash's (NOTE [folder locks])."""
    folder = tmp_path / "step-000000003"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDS_A_FOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        (folder / MODEL_FILE).write_bytes(b"being written")
        Checkpointer(tmp_path, torch.nn.Linear(1, 1))
        assert (folder / MODEL_FILE).read_bytes() == b"being written"
    finally:
        holder.kill()
        holder.wait()
    Checkpointer(tmp_path, torch.nn.Linear(1, 1))
    assert list(tmp_path.iterdir()) == []


def test_lock_files_are_no_part_of_a_version_and_a_crashs_are_cleaned(tmp_path: Path) -> None:
    """A committed version carries no lock file; one a crash left in a committed version (killed
    between the commit and deleting it), or a folder a cleanup was deleting, changes nothing readers
    see (versions, restore, export, ``ooc checkpoints list``), and the next Checkpointer removes
    both (NOTE [folder locks])."""
    directory = tmp_path / "ck"
    model, opt, sched, ckpt = _two_versions(directory)
    latest = ckpt.latest()
    assert sorted(p.name for p in latest.path.iterdir()) == sorted([*latest.files, "manifest-rank0.json"])
    listed_before = subprocess.run([sys.executable, "-m", "ooc", "checkpoints", "list", str(directory)],
                                   capture_output=True, text=True, check=True).stdout
    (latest.path / ckpt_mod._LOCK_FILE).write_bytes(b"")
    removing = directory / ".removing-step-000000009-0a1b2c3d"
    removing.mkdir()
    (removing / MODEL_FILE).write_bytes(b"half")
    assert list_versions(directory) == ckpt.versions() and ckpt.latest() == latest
    listed = subprocess.run([sys.executable, "-m", "ooc", "checkpoints", "list", str(directory)],
                            capture_output=True, text=True, check=True).stdout
    assert listed == listed_before
    expected = _weights(model)
    fresh = GPT(CFG)
    fresh.load_state_dict(safetensors.torch.load_file(ckpt.export(None, tmp_path / "weights.safetensors")))
    assert _same(_weights(fresh), expected)
    ckpt.close()
    _assert_restores(directory, None, expected, _opt_state(opt))  # its Checkpointer cleans up first
    assert sorted(p.name for p in directory.iterdir()) == ["step-000000001", "step-000000002"]
    assert not (latest.path / ckpt_mod._LOCK_FILE).exists()
    opt.close()


_KILLED_WHILE_RECYCLING = """
import os, signal, sys
from pathlib import Path
import torch
import ooc.checkpoint as C
sys.path.insert(0, sys.argv[3])
from test_checkpoint import _opt_state, _setup, _train, _weights

directory, at = Path(sys.argv[1]), sys.argv[2]
C._BOUNCE_BYTES = 4 * 4096  # several writes to each file
model, opt, sched = _setup()
ckpt = C.Checkpointer(directory, model, opt, keep=1)
for step in (1, 2, 3):
    _train(model, opt, sched, range(step - 1, step))
    torch.save((_weights(model), _opt_state(opt)), directory.parent / f"expected-{step}.pt")
    if step == 3:
        for path in next(directory.glob(".spare-*")).iterdir():
            with open(path, "ab") as f:
                f.write(os.urandom(50000))  # longer than what is written over it: truncated at the end
        kill = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
        real_rename, real_write = os.rename, os.write
        if at == "taken":
            os.rename = lambda a, b: (real_rename(a, b), ".spare-" in str(a) and kill())
        elif at == "overwriting":
            os.write = lambda fd, data: (real_write(fd, data[:len(data) // 2]), kill())
        elif at == "truncating":
            os.ftruncate = kill
        else:
            ckpt._hook = lambda point: point == at and kill()
    ckpt.save(step)
    ckpt.wait()
"""


@pytest.mark.slow
@pytest.mark.parametrize("at", ["taken", "overwriting", "truncating", "files-written", "renamed", "retired"])
def test_kill_9_while_writing_over_a_spare_leaves_the_previous_version(tmp_path: Path, at: str) -> None:
    """SIGKILL at each moment of a save that writes over a spare's (longer) files (NOTE [recycled
    files]): once a spare file is renamed into the new folder, halfway through writing over it,
    before its truncation, before the commit, after it, and between the retired version's records
    going and its rename. The newest committed version restores exactly, and the next Checkpointer
    leaves only versions (the killed writer's lock died with it: NOTE [folder locks]), without lock files."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    done = subprocess.run([sys.executable, "-c", _KILLED_WHILE_RECYCLING, str(directory), at, str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    latest = 3 if at in ("renamed", "retired") else 2
    assert list_versions(directory)[-1].step == latest
    _assert_restores(directory, None, *torch.load(tmp_path / f"expected-{latest}.pt", weights_only=False))
    model, opt, _ = _setup()
    Checkpointer(directory, model, opt).close()
    assert all(_VERSION.match(p.name) and (p / "manifest-rank0.json").exists() for p in directory.iterdir())
    assert not list(directory.rglob(ckpt_mod._LOCK_FILE))
    opt.close()


def test_every_file_and_folder_is_fsynced_once_before_the_commit(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The commit record is renamed into place only after each file it names, the version's folder
    and the directory are fsynced (each once: not per tensor); the folder again after the rename."""
    model, opt, sched, ckpt = _two_versions(tmp_path)
    events: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        real(fd)
        events.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(os, "fsync", fsync)
    ckpt._hook = lambda at: events.append(at) if at == "renamed" else None
    ckpt.save(3)
    ckpt.wait()
    monkeypatch.undo()
    folder = tmp_path / "step-000000003"
    renamed = events.index("renamed")
    before = events[:renamed]
    names = set(ckpt.latest().files)
    assert sorted(before) == sorted([str(folder / n) for n in names] + [str(folder / ".manifest-rank0.json.tmp"),
                                                                       str(folder), str(tmp_path)])
    assert before[-1] == str(folder / ".manifest-rank0.json.tmp")
    assert events[renamed + 1:] == [str(folder)]
    opt.close()


def _refuse_direct_io(monkeypatch, at: str) -> None:  # noqa: ANN001
    """Make the file system refuse O_DIRECT ``at`` open (as tmpfs does) or at the first write."""
    if at == "open":
        real_open = os.open

        def refusing_open(path, flags, *args):  # noqa: ANN001, ANN202
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument", str(path))
            return real_open(path, flags, *args)

        monkeypatch.setattr(os, "open", refusing_open)
    else:
        real_write = os.write

        def refusing_write(fd: int, data) -> int:  # noqa: ANN001
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", refusing_write)


def _takes_direct_io(folder: Path) -> bool:
    try:
        os.close(os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        (folder / "probe").unlink(missing_ok=True)


@pytest.mark.parametrize("refused", [None, "open", "write"])
def test_write_file_writes_any_chunks_exactly(tmp_path: Path, monkeypatch, refused: str | None) -> None:  # noqa: ANN001
    """_write_file's bytes and XXH3-64 equal its chunks', whatever their sizes against the bounce
    buffer (tails of every length), with direct I/O and where the file system refuses it."""
    monkeypatch.setattr(ckpt_mod, "_BOUNCE_BYTES", 4 * ckpt_mod._ALIGN)
    if refused:
        _refuse_direct_io(monkeypatch, refused)
    rng = random.Random(0)
    for sizes in ([0], [1], [ckpt_mod._ALIGN], [4 * ckpt_mod._ALIGN], [4 * ckpt_mod._ALIGN + 1],
                  [rng.randrange(1, 40000) for _ in range(20)]):
        chunks = [rng.randbytes(n) for n in sizes]
        path = tmp_path / "f.bin"
        path.write_bytes(rng.randbytes(sum(sizes) + rng.choice([0, 1, 5000])))  # written over (NOTE [recycled files])
        size, crc = ckpt_mod._write_file(path, [chunks[0], *(memoryview(c) for c in chunks[1:])])
        data = b"".join(chunks)
        assert path.read_bytes() == data and size == len(data) and crc == xxhash.xxh3_64_hexdigest(data)


def test_large_files_are_written_directly_in_aligned_blocks(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Where the file system takes O_DIRECT, every write of a version's files bypasses the page
    cache, in whole aligned blocks (NOTE [direct writes]); the version restores exactly."""
    if not _takes_direct_io(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    model, opt, sched = _setup()
    _train(model, opt, sched, range(2))
    expected, expected_state = _weights(model), _opt_state(opt)
    monkeypatch.setattr(ckpt_mod, "_BOUNCE_BYTES", 64 << 10)
    writes: dict[str, list[tuple[bool, int]]] = {}
    real = os.write

    def write(fd: int, data) -> int:  # noqa: ANN001
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        writes.setdefault(name, []).append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), len(data)))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    ckpt = Checkpointer(tmp_path, model, opt)
    ckpt.save(2)
    ckpt.wait()
    monkeypatch.undo()
    size = (tmp_path / "step-000000002" / "optimizer-rank0.safetensors").stat().st_size
    done = writes["optimizer-rank0.safetensors"]
    assert len(done) == -(-size // (64 << 10))
    assert all(direct and n % ckpt_mod._ALIGN == 0 for direct, n in done)
    # Not a version's file: a writer's owner record, a hundred bytes written once (NOTE [owner records]).
    assert all(direct for name, w in writes.items() if ".owner." not in name for direct, _ in w)
    _assert_restores(tmp_path, None, expected, expected_state)
    ckpt.close()
    opt.close()


@pytest.mark.parametrize("refused", ["open", "write"])
def test_without_direct_io_large_files_are_handed_to_the_disk_while_written(tmp_path: Path, monkeypatch,  # noqa: ANN001
                                                                           refused: str) -> None:
    """Where the file system refuses O_DIRECT, _write_file writes through the page cache and starts
    the writeback of each stretch of _WRITEBACK_BYTES as it goes (contiguous ranges from the start);
    the version still restores exactly."""
    model, opt, sched = _setup()
    _train(model, opt, sched, range(2))
    expected, expected_state = _weights(model), _opt_state(opt)
    monkeypatch.setattr(ckpt_mod, "_WRITEBACK_BYTES", 64 << 10)
    monkeypatch.setattr(ckpt_mod, "_BOUNCE_BYTES", 64 << 10)
    _refuse_direct_io(monkeypatch, refused)
    ranges: dict[str, list[tuple[int, int]]] = {}
    real = os.posix_fadvise

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_DONTNEED
        ranges.setdefault(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), []).append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    ckpt = Checkpointer(tmp_path, model, opt)
    ckpt.save(2)
    ckpt.wait()
    monkeypatch.undo()
    size = (tmp_path / "step-000000002" / "optimizer-rank0.safetensors").stat().st_size
    spans = ranges["optimizer-rank0.safetensors"]
    assert len(spans) >= size // (128 << 10)
    assert all(offset == sum(n for _, n in spans[:i]) and n >= 64 << 10 for i, (offset, n) in enumerate(spans))
    assert sum(n for _, n in spans) > size - (64 << 10)
    _assert_restores(tmp_path, None, expected, expected_state)
    ckpt.close()
    opt.close()


def test_crash_leftovers_are_ignored_and_cleaned(tmp_path: Path) -> None:
    """A writer killed at any point leaves a folder without a commit record, or a temp record."""
    model, opt, sched, ckpt = _two_versions(tmp_path)
    partial = tmp_path / "step-000000003"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    (partial / ".manifest-rank0.json.tmp").write_text("{")
    (ckpt.latest().path / ".manifest-rank0.json.tmp").write_text("{")
    assert ckpt.latest().step == 2
    Checkpointer(tmp_path, model, opt)
    assert not partial.exists() and not list(tmp_path.rglob("*.tmp"))
    assert [v.step for v in list_versions(tmp_path)] == [1, 2]
    opt.close()


def test_full_disk_leaves_no_temp_file_and_the_previous_version(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    model, opt, sched, ckpt = _two_versions(tmp_path)
    real = ckpt_mod._write_file
    written = []

    def full(path: Path, chunks) -> tuple[int, str]:  # noqa: ANN001
        if written:  # the second file finds the disk full, half written
            data = b"".join(chunks)
            path.write_bytes(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        written.append(path)
        return real(path, chunks)

    monkeypatch.setattr(ckpt_mod, "_write_file", full)
    ckpt.save(3)
    with pytest.raises(CheckpointError, match="No space left"):
        ckpt.wait()
    assert not (tmp_path / "step-000000003").exists()
    assert not list(tmp_path.rglob("*.tmp"))
    assert ckpt.restore().step == 2
    monkeypatch.setattr(ckpt_mod, "_write_file", real)
    ckpt.save(3)  # the next save, with room again, works
    ckpt.wait()
    assert ckpt.latest().step == 3
    opt.close()


_FILE_SIZE_LIMITED = """
import resource, signal, sys, torch
from ooc.checkpoint import Checkpointer
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
opt = torch.optim.AdamW(model.parameters())
ckpt = Checkpointer(sys.argv[1], model, opt)
ckpt.save(1)
ckpt.wait()
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))  # under each tensor file's size
ckpt.save(2)
try:
    ckpt.wait()
except Exception as exc:
    print(exc)
"""


def test_a_file_size_limit_mid_write_names_the_file_and_what_to_do(tmp_path: Path) -> None:
    """A full disk as the kernel reports it (RLIMIT_FSIZE: each write past the limit fails, on the
    real writer's path): the error was "could not write checkpoint <folder>: [Errno 27] File too
    large", naming no file (a write on a file descriptor names none) and not saying what became of
    the version or what to do. It names the file, the newest version left and the limit to raise;
    nothing of the failed version is left."""
    out = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMITED, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert re.search(r"File too large: '.*step-000000002/(model|optimizer-rank0)\.safetensors'", out), out
    assert "The version was not committed; the newest version is still step 1" in out, out
    assert "raise the limit" in out, out
    assert [v.step for v in list_versions(tmp_path)] == [1]
    assert not (tmp_path / "step-000000002").exists()


def test_a_full_disk_at_a_files_fsync_names_the_file_and_what_to_do(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Delayed allocation: a full disk may fail only the fsync, which names no file either."""
    model, opt, sched, ckpt = _two_versions(tmp_path)
    real = os.fsync

    def full(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("state-rank0.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(ckpt_mod.os, "fsync", full)
    ckpt.save(3)
    with pytest.raises(CheckpointError, match=r"No space left on device: '.*step-000000003/state-rank0\.pt'\. The "
                       r"version was not committed; the newest version is still step 2 .*Free space") as info:
        ckpt.wait()
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.undo()
    assert ckpt.latest().step == 2 and not (tmp_path / "step-000000003").exists()
    ckpt.close()
    opt.close()


def test_a_file_system_gone_read_only_mid_save_reports_the_writes_error(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """ext4 remounts read-only on a disk error: the write fails, and so does the removal of the
    version's files. That second error replaced the first (a bare OSError naming a file whose
    removal failed, not the write that failed), and the folder stayed locked by this process, so
    neither retention nor a new Checkpointer removed it. Now the write's error is raised and the
    folder is let go of, for the next cleanup to remove."""
    model, opt, sched, ckpt = _two_versions(tmp_path)
    real_write, real_unlink = ckpt_mod._write_file, Path.unlink

    def read_only(what: Path) -> OSError:
        return OSError(errno.EROFS, "Read-only file system", str(what))

    def write(path: Path, chunks) -> tuple[int, str]:  # noqa: ANN001
        if path.name == "state-rank0.pt":
            raise read_only(path)
        return real_write(path, chunks)

    def unlink(path: Path, missing_ok: bool = False) -> None:
        if path.parent.name == "step-000000003":
            raise read_only(path)
        real_unlink(path, missing_ok=missing_ok)

    def rename(src: str | Path, dst: str | Path) -> None:
        if Path(src).name == "step-000000003":
            raise read_only(src)
        real_rename(src, dst)

    real_rename = os.rename
    monkeypatch.setattr(ckpt_mod, "_write_file", write)
    monkeypatch.setattr(Path, "unlink", unlink)
    monkeypatch.setattr(os, "rename", rename)
    ckpt.save(3)
    with pytest.raises(CheckpointError, match=r"Read-only file system: '.*state-rank0\.pt'"):
        ckpt.wait()
    monkeypatch.undo()
    assert (tmp_path / "step-000000003").exists()  # the failed removal left it
    Checkpointer(tmp_path, model)  # the next cleanup, in this process too, removes it
    assert not (tmp_path / "step-000000003").exists()
    assert ckpt.restore().step == 2
    opt.close()


def test_two_unsharded_ranks_restore_on_one_and_on_three(tmp_path: Path) -> None:
    """Two replicas (as data-parallel ranks without sharding hold them) save into one version: rank 0
    writes the optimizer state for both, each rank its RNG. One rank, and each of three, restores it:
    state exact, RNG from the rank that saved it, a new rank starts with rank 0's scheduler."""
    replicas = [_setup(torch.bfloat16) for _ in range(2)]
    for rank, (model, opt, sched) in enumerate(replicas):
        _train(model, opt, sched, range(3))
        torch.manual_seed(100 + rank)
        ckpt = Checkpointer(tmp_path, model, opt, scheduler=sched, rank=rank, world=2, layout={"shard": False})
        ckpt.save(3)
        ckpt.wait()
    v = list_versions(tmp_path)[-1]
    assert v.world == 2 and v.layout == {"world": 2, "shard": False}
    assert "optimizer-rank1.safetensors" not in v.files  # equal replicas: written once
    model, opt, _ = replicas[0]
    expected, expected_state = _weights(model), _opt_state(opt)
    for world in (1, 3):
        for rank in range(world):
            model2, opt2, sched2 = _setup(torch.bfloat16, seed=9)
            torch.manual_seed(7)
            before = torch.get_rng_state()
            Checkpointer(tmp_path, model2, opt2, scheduler=sched2, rank=rank, world=world).restore()
            assert _same(_weights(model2), expected)
            assert _same_state(_opt_state(opt2), expected_state)  # fp32 masters and moments, exactly
            assert sched2.last_epoch == 3
            if rank < 2:  # the RNG as the rank that saved it had it
                got = torch.rand(3)
                torch.manual_seed(100 + rank)
                assert torch.equal(got, torch.rand(3))
            else:
                assert torch.equal(torch.get_rng_state(), before)  # no saved RNG for a new rank: left alone
            opt2.close()
    for _, opt, _ in replicas:
        opt.close()


def test_optimizer_state_files_are_safetensors_with_an_index(tmp_path: Path) -> None:
    """Every optimizer state tensor is in the rank's safetensors file under ``{param}.{field}``, and
    the commit record gives its global shape and the slice the rank held (NOTE [resharding])."""
    model, opt, sched, ckpt = _two_versions(tmp_path)
    v = ckpt.latest()
    tensors = safetensors.torch.load_file(v.path / "optimizer-rank0.safetensors")
    state = opt.state_dict()["state"]
    names = [n for n, _ in model.named_parameters()]
    assert set(tensors) == {f"{names[i]}.{f}" for i, s in state.items() for f in s}
    for i, s in state.items():
        for f, value in s.items():
            key = f"{names[i]}.{f}"
            assert torch.equal(tensors[key], value)
            (entry,) = v.tensors[key]
            assert entry == {"file": "optimizer-rank0.safetensors", "param": names[i], "field": f, "dtype": str(value.dtype),
                             "global_shape": list(value.shape), "offsets": [0] * value.dim(), "shape": list(value.shape)}
    index = json.loads((v.path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict()) and set(index["weight_map"].values()) == {"model.safetensors"}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    opt.close()


def test_a_plain_torch_optimizer_round_trips(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        x, y = _batch(step)
        model(x, y)[1].backward()
        opt.step()
    ckpt = Checkpointer(tmp_path, model, opt)
    ckpt.save(2)
    ckpt.wait()
    model2 = GPT(CFG)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    Checkpointer(tmp_path, model2, opt2).restore()
    assert _same(_weights(model2), _weights(model))
    assert _same_state(_opt_state(opt2), _opt_state(opt))


def test_a_version_of_another_format_is_refused(tmp_path: Path) -> None:
    model, opt, sched, ckpt = _two_versions(tmp_path)
    record = ckpt.latest().path / "manifest-rank0.json"
    manifest = json.loads(record.read_text())
    del manifest["record_xxh3"]
    # A record of format 1 holds no digest of itself; one of a later ooc holds its own, intact.
    for fmt, digest in ((1, False), (5, True)):
        written = {**manifest, "format": fmt}
        if digest:
            written["record_xxh3"] = ckpt_mod._record_digest(written)
        record.write_text(json.dumps(written))
        with pytest.raises(CheckpointError, match=f"has format {fmt}; this ooc reads formats 2, 3, 4"):
            ckpt.restore()
    opt.close()


def _flip(path: Path, at: int) -> bytes:
    """Flip one bit of the byte at ``at`` of ``path``; return the file's bytes before."""
    data = path.read_bytes()
    damaged = bytearray(data)
    damaged[at] ^= 0x01
    path.write_bytes(bytes(damaged))
    return data


def test_records_hold_an_xxh3_and_a_flipped_bit_anywhere_is_caught(tmp_path: Path) -> None:
    """NOTE [checksums]: each file's record holds its XXH3-64; one flipped bit in the header, the
    first or last tensor byte or in between is named before anything is loaded."""
    model, opt, sched, ckpt = _two_versions(tmp_path)
    v = ckpt.latest()
    assert v.format == 4
    for name, record in v.files.items():
        assert set(record) == {"bytes", "xxh3"}
        assert record["xxh3"] == xxhash.xxh3_64_hexdigest((v.path / name).read_bytes())
    path = v.path / "optimizer-rank0.safetensors"
    size = path.stat().st_size
    for at in (0, 8, size // 3, size - 1):
        data = _flip(path, at)
        with pytest.raises(CorruptCheckpointError, match="optimizer-rank0.safetensors is corrupt: XXH3-64 differs"):
            ckpt.restore()
        path.write_bytes(data)
    assert ckpt.restore().step == 2
    opt.close()


@pytest.mark.parametrize("fmt, key, digest, flipped, message", [
    (3, "crc32", lambda data: f"{zlib.crc32(data):08x}", "optimizer-rank0.safetensors", "CRC-32 differs"),
    (2, "sha256", lambda data: hashlib.sha256(data).hexdigest(), "model.safetensors", "sha256 differs"),
], ids=["format3-crc32", "format2-sha256"])
def test_a_version_of_an_earlier_format_is_still_read_and_checked(tmp_path: Path, fmt: int, key: str, digest,  # noqa: ANN001
                                                                   flipped: str, message: str) -> None:
    """Versions written before XXH3 hold CRC-32s (format 3), and before NOTE [checksums] sha256
    digests (format 2): they restore exactly, and a flipped bit is caught with their own checksum."""
    model, opt, sched, ckpt = _two_versions(tmp_path)
    expected, expected_state = _weights(model), _opt_state(opt)
    v = ckpt.latest()
    record = v.path / "manifest-rank0.json"
    manifest = json.loads(record.read_text())
    manifest["format"] = fmt
    del manifest["record_xxh3"]  # records of those formats hold no digest of themselves (NOTE [damaged records])
    manifest["files"] = {name: {"bytes": r["bytes"], key: digest((v.path / name).read_bytes())}
                         for name, r in manifest["files"].items()}
    record.write_text(json.dumps(manifest))
    model2, opt2, sched2 = _setup(seed=5)
    assert Checkpointer(tmp_path, model2, opt2, scheduler=sched2).restore().format == fmt
    assert _same(_weights(model2), expected)
    assert _same_state(_opt_state(opt2), expected_state)
    _flip(v.path / flipped, 100)
    with pytest.raises(CorruptCheckpointError, match=f"{flipped} is corrupt: {message}"):
        ckpt.restore()
    opt.close()
    opt2.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_weights_loaded_into_the_model_while_a_version_is_written_do_not_reach_it(tmp_path: Path,
                                                                                 dtype: torch.dtype) -> None:
    """NOTE [lazy snapshots]: ``model.load_state_dict`` while the writer was held back wrote the
    live parameters it reads lazily, and the version held the loaded weights (found by an
    adversarial helper). Now the load first has the unread tensors copied aside."""
    model, opt, sched = _setup(dtype)
    _train(model, opt, sched, range(2))
    expected, expected_state = _weights(model), _opt_state(opt)
    other = {k: v + 1 for k, v in model.state_dict().items()}
    ckpt = Checkpointer(tmp_path, model, opt)
    release = threading.Event()
    ckpt._hook = lambda at: release.wait(60) if at == "snapshot" else None
    ckpt.save(2)
    model.load_state_dict(other)
    release.set()
    ckpt.wait()
    _assert_restores(tmp_path, 2, expected, expected_state, dtype)
    assert all(torch.equal(v, other[k]) for k, v in model.state_dict().items())
    ckpt.close()
    opt.close()


def test_a_lazy_version_holds_the_weights_at_save_when_a_parameters_data_moves(tmp_path: Path) -> None:
    """NOTE [live device tensors after the gate]: the writer read a bucket's live parameter through the
    Parameter object, whose ``.data`` weight streaming points at a fresh device copy for each block's
    forward; on a GPU the writer's read of that copy is ordered after its stream-in only by the
    training's stream (the default one, or none under ``torch.cuda.stream(s)``). The version holds
    the tensor as it was at ``save``; here the moved ``.data`` holds other values (the copy not landed)."""
    model, opt, sched = _setup()
    _train(model, opt, sched, range(2))
    expected, expected_state = _weights(model), _opt_state(opt)
    ckpt = Checkpointer(tmp_path, model, opt)
    assert ckpt.lazy
    release = threading.Event()
    ckpt._hook = lambda at: release.wait(60) if at == "snapshot" else None
    ckpt.save(2)
    moved = {p: p.data for p in model.parameters()}
    for p, data in moved.items():
        p.data = torch.full_like(data, 7.0)
    release.set()
    ckpt.wait()
    for p, data in moved.items():
        p.data = data
    _assert_restores(tmp_path, 2, expected, expected_state)
    ckpt.close()
    opt.close()


def test_a_lazy_version_of_streamed_weights_holds_the_state_at_save(tmp_path: Path) -> None:
    """The slots of streamed weights hold their host copies (NOTE [live device tensors after the
    gate]), which each update writes after the listener copied them aside: two more steps while the
    writer waits leave the version as it was at ``save``."""
    import ooc
    from ooc.backend import ChaosConfig, CpuBackend

    def setup(seed: int):  # noqa: ANN202
        torch.manual_seed(seed)
        model = GPT(CFG)
        backend = CpuBackend(chaos=ChaosConfig(seed=1, max_delay_s=0.001))
        ooc.wrap(model, ooc.scheduler.Plan.uniform("keep", 2).streaming([0, 1]), backend=backend)
        return model, HostAdamW(model.parameters(), lr=3e-3, model=model, backend=backend)

    model, opt = setup(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    _train(model, opt, sched, range(2))
    expected, expected_state = _weights(model), _opt_state(opt)
    ckpt = Checkpointer(tmp_path, model, opt)
    release = threading.Event()
    ckpt._hook = lambda at: release.wait(60) if at == "snapshot" else None
    ckpt.save(2)
    _train(model, opt, sched, range(2, 4))
    release.set()
    ckpt.wait()
    assert ckpt.copied_by_listener == len(opt.buckets)
    ckpt.close()
    opt.close()
    ooc.unwrap(model)
    fresh, fresh_opt = setup(3)
    try:
        Checkpointer(tmp_path, fresh, fresh_opt).restore(2)
        assert _same(_weights(fresh), expected)
        assert _same_state(_opt_state(fresh_opt), expected_state)
    finally:
        fresh_opt.close()
        ooc.unwrap(fresh)


@pytest.mark.parametrize("held_at", ["snapshot", "write:model.safetensors"], ids=["before-all", "files-opened"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "in-step"])
def test_lazy_snapshot_copies_a_bucket_aside_before_its_next_update(tmp_path: Path, dtype: torch.dtype, held_at: str,
                                                                    pipeline: bool) -> None:
    """The writer is held back (before any file, or with the tensor files opened, written together:
    NOTE [write order]) while training goes on: each bucket's update must first copy
    aside what is not written yet, so the version still holds the state at save() (NOTE [lazy
    snapshots]); in stream
    order: in-step with bf16 weights, the copy aside reads device parameters on the training thread
    that the update's copy in then overwrites."""
    model, opt, sched = _setup(dtype, pipeline=pipeline)
    _train(model, opt, sched, range(2))
    expected, expected_state = _weights(model), _opt_state(opt)
    ckpt = Checkpointer(tmp_path, model, opt)
    assert ckpt.lazy
    release = threading.Event()
    ckpt._hook = lambda at: release.wait(60) if at == held_at else None
    ckpt.save(2)
    _train(model, opt, sched, range(2, 4))  # two more updates of every bucket while the writer waits
    release.set()
    ckpt.wait()
    _assert_restores(tmp_path, 2, expected, expected_state, dtype)
    assert ckpt.copied_by_listener == len(opt.buckets)
    ckpt.close()
    assert ckpt._listener not in opt.stage_listeners and len(opt.stage_listeners) == 0
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_copies_aside_reuse_the_last_versions_buffers_and_hold_the_state_at_save(tmp_path: Path,
                                                                                 dtype: torch.dtype) -> None:
    """NOTE [reused copies aside]: the second version's copies aside go into the first version's
    buffers (no new pages), each version still holds exactly the state at its save(), and close()
    frees the buffers."""
    model, opt, sched = _setup(dtype)
    _train(model, opt, sched, range(2))
    ckpt = Checkpointer(tmp_path, model, opt, keep=None)
    release = threading.Event()
    ckpt._hook = lambda at: release.wait(60) if at == "snapshot" else None
    expected: dict[int, tuple[dict, dict]] = {}
    buffers: list[set[int]] = []
    for step in (2, 4, 6):
        expected[step] = _weights(model), _opt_state(opt)
        release.clear()
        ckpt.save(step)
        snapshot = ckpt._snapshot
        _train(model, opt, sched, range(step, step + 2))  # every bucket updated before its write
        release.set()
        ckpt.wait()
        buffers.append({c.untyped_storage().data_ptr() for c in snapshot.copies})
    assert ckpt.copied_by_listener == 3 * len(opt.buckets)
    assert buffers[1] == buffers[0] == buffers[2] and ckpt._aside.reused == 2 * len(snapshot.copies)
    for step, (weights, state) in expected.items():
        _assert_restores(tmp_path, step, weights, state, dtype)
    ckpt.close()
    assert not ckpt._aside._free
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.save(8)  # no listener would protect a lazy snapshot from the next updates
    assert [v.step for v in ckpt.versions()] == [2, 4, 6]
    opt.close()


def test_a_kept_buffer_goes_only_to_a_tensor_laid_out_as_it_is() -> None:
    """NOTE [reused copies aside]: a copy of a transposed tensor is no buffer for a contiguous one of
    the same shape (the writer would read it through a contiguous copy per slice)."""
    aside = ckpt_mod._AsideBuffers()
    transposed = torch.randn(64, 32).t()
    aside.keep([aside.copy(transposed)])
    contiguous = torch.randn(32, 64)
    copy = aside.copy(contiguous)
    assert copy.is_contiguous() and torch.equal(copy, contiguous) and aside.reused == 0
    assert torch.equal(aside.copy(transposed), transposed) and aside.reused == 1


def test_the_writer_goes_by_the_order_the_last_step_updated_the_buckets(tmp_path: Path) -> None:
    """NOTE [write order]: the tensors of the bucket the last step updated first, first (the next
    step's first update is the earliest deadline), its moments and its weights before the next
    bucket's: the optimizer and model files are written together, not one after the other (every
    bucket updated while the optimizer file was written had its weights copied aside)."""
    model, opt, sched = _setup()
    updated: list[int] = []
    opt.stage_listeners.append(lambda bucket, stage: updated.append(bucket) if stage is Stage.EXCHANGE else None)
    ckpt = Checkpointer(tmp_path, model, opt)
    _train(model, opt, sched, range(2))
    last_step = updated[len(updated) // 2:]
    assert sorted(last_step) == sorted(set(last_step))  # each bucket once
    read: list[tuple[str, str]] = []
    ckpt._hook = lambda at: read.append(tuple(at.split(":")[1:])) if at.startswith("tensor:") else None
    ckpt.save(2)
    ckpt.wait()
    bucket_of = {id(p): b.index for b in opt.buckets for p in b.params}
    params = dict(model.named_parameters())
    name_of = {"optimizer-rank0.safetensors": lambda key: key.rsplit(".", 1)[0], "model.safetensors": str}
    ranks = [(last_step.index(bucket_of[id(params[name_of[file](key)])]), file) for file, key in read
             if name_of[file](key) in params]
    assert [rank for rank, _ in ranks] == sorted(rank for rank, _ in ranks)  # across both files
    assert {file for rank, file in ranks if rank == 0} == set(name_of)  # the first bucket's moments and weights
    folder = ckpt.latest().path
    for file in name_of:  # each file's tensors lie in the order they were written
        header = json.loads((folder / file).read_bytes()[8:8 + struct.unpack("<Q", (folder / file).read_bytes()[:8])[0]])
        keys = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        assert [k for k in keys if name_of[file](k) in params] == [k for f, k in read if f == file and name_of[f](k) in params]
        forward_order = [name for name in model.state_dict() if name in params]
        assert [name_of[file](k) for k in keys if name_of[file](k) in params] != forward_order, file  # the last block's first
    ckpt.close()
    opt.close()


def test_an_update_waits_for_the_write_of_its_bucket_in_progress(tmp_path: Path) -> None:
    """The writer is held in the middle of writing block 0's first weight from the live tensor: block
    0's next update must wait until that write ends, and the version holds the state at save()."""
    model, opt, sched = _setup()
    _train(model, opt, sched, range(2))
    expected, expected_state = _weights(model), _opt_state(opt)
    ckpt = Checkpointer(tmp_path, model, opt)
    block0 = next(b.index for b in opt.buckets if any(p is model.blocks[0].attn.qkv.weight for p in b.params))
    writing, release, seen = threading.Event(), threading.Event(), []

    def hold(at: str) -> None:
        if at == "tensor:model.safetensors:blocks.0.attn.qkv.weight":
            writing.set()
            release.wait(60)

    def listener(bucket: int, stage: Stage) -> None:  # runs after the checkpointer's, before the update
        if bucket == block0 and stage is Stage.EXCHANGE:
            seen.append(release.is_set())

    ckpt._hook = hold
    opt.stage_listeners.append(listener)
    ckpt.save(2)
    assert writing.wait(60)
    threading.Timer(0.2, release.set).start()
    _train(model, opt, sched, range(2, 4))
    ckpt.wait()
    assert seen == [True, True]  # the first update came after the write; the second found nothing to wait for
    _assert_restores(tmp_path, 2, expected, expected_state)
    ckpt.close()
    opt.close()


def test_an_update_waits_for_the_slice_being_read_not_for_the_next(tmp_path: Path) -> None:
    """NOTE [lazy snapshots]: an update that finds the writer reading a slice of its bucket waits for
    that slice only: the writer starts no other slice of the bucket meanwhile (it would wait for
    every one), and reads on from the copy aside the update makes."""
    state = {"a": torch.arange(4.0), "b": torch.arange(4.0) + 10}
    live_b = state["b"]
    snapshot = ckpt_mod._Snapshot({0: [(state, "a"), (state, "b")]}, ckpt_mod._AsideBuffers())
    _, token = snapshot.acquire(state, "a")
    copied: list[bool] = []
    update = threading.Thread(target=lambda: copied.append(snapshot.before_update(0)))
    update.start()
    time.sleep(0.2)  # the update waits for the slice of "a" being read
    assert not copied
    snapshot.release(token, finished=True)
    b, token_b = snapshot.acquire(state, "b")  # the writer's next slice: after the update's copy aside
    snapshot.release(token_b, finished=True)
    update.join(10)
    assert copied == [True] and token_b is None and b is not live_b and torch.equal(b, live_b)


def test_an_update_between_two_slices_of_a_tensor_copies_the_rest_aside(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The writer reads a live tensor a slice at a time and holds its bucket only while it reads one
    (NOTE [lazy snapshots]): paused between two slices of block 0's first weight, block 0's next
    update must not wait for the rest of the tensor; it copies the tensor aside, the writer goes on
    from the copy at the same offset, and the version holds the state at save()."""
    monkeypatch.setattr(ckpt_mod, "_SLICE_BYTES", 4096)
    model, opt, sched = _setup()
    _train(model, opt, sched, range(2))
    expected, expected_state = _weights(model), _opt_state(opt)
    ckpt = Checkpointer(tmp_path, model, opt)
    name = "blocks.0.attn.qkv.weight"
    assert model.blocks[0].attn.qkv.weight.numel() * 4 > 2 * 4096
    paused, resume, reads = threading.Event(), threading.Event(), []
    acquire = ckpt_mod._Snapshot.acquire

    def pausing_acquire(self, container, key):  # noqa: ANN001, ANN202
        if key == name and container is not None and len(reads) < 3:
            reads.append(key)
            if len(reads) == 2:  # between the first and the second slice: the bucket is not held
                paused.set()
                resume.wait(60)
        return acquire(self, container, key)

    monkeypatch.setattr(ckpt_mod._Snapshot, "acquire", pausing_acquire)
    ckpt.save(2)
    assert paused.wait(60)
    trainer = threading.Thread(target=_train, args=(model, opt, sched, range(2, 3)), daemon=True)
    trainer.start()
    trainer.join(60)
    alive = trainer.is_alive()
    resume.set()
    trainer.join(60)
    assert not alive, "the update waited for the rest of a tensor the writer was not reading"
    ckpt.wait()
    assert ckpt.copied_by_listener >= 1
    _assert_restores(tmp_path, 2, expected, expected_state)
    ckpt.close()
    opt.close()


def test_a_write_failing_midway_lets_go_of_the_bucket_it_was_writing(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The disk fills up while the writer writes a live tensor and the bucket's next update waits
    for that write: the update must go on, not wait for a write that will never end."""
    model, opt, sched = _setup()
    _train(model, opt, sched, range(1))
    ckpt = Checkpointer(tmp_path, model, opt)
    holding, reading = threading.Event(), []
    ckpt._hook = lambda at: reading.append(at) if at.startswith("tensor:") else None

    def fails_in_the_first_tensor(writer, chunk, release=None) -> None:  # noqa: ANN001
        if not reading:  # a header
            return real_feed(writer, chunk, release)
        holding.set()  # the first tensor's bytes: its bucket is being written
        time.sleep(1.0)  # meanwhile the training thread's update of that bucket comes and waits
        raise OSError(errno.ENOSPC, "No space left on device")

    real_feed = ckpt_mod._FileWriter.feed
    monkeypatch.setattr(ckpt_mod._FileWriter, "feed", fails_in_the_first_tensor)
    ckpt.save(1)
    assert holding.wait(60)
    trainer = threading.Thread(target=_train, args=(model, opt, sched, range(1, 3)), daemon=True)
    trainer.start()
    trainer.join(120)
    assert not trainer.is_alive(), "an update waits for the failed write"
    with pytest.raises(CheckpointError, match="No space left"):
        ckpt.wait()
    monkeypatch.undo()
    ckpt.save(3)
    ckpt.wait()
    assert ckpt.latest().step == 3
    ckpt.close()
    opt.close()


def test_lazy_snapshot_without_conflict_writes_from_the_live_tensors(tmp_path: Path) -> None:
    model, opt, sched = _setup()
    ckpt = Checkpointer(tmp_path, model, opt)
    for step in range(3):
        _train(model, opt, sched, range(step, step + 1))
        ckpt.save(step + 1)
        ckpt.wait()  # the writer is done before the next update: no bucket was copied
    assert ckpt.copied_by_listener == 0 and [v.step for v in ckpt.versions()] == [1, 2, 3]
    ckpt.close()
    opt.close()



def test_a_loops_own_in_place_change_during_a_lazy_write_fails_it(tmp_path: Path) -> None:
    """NOTE [changes the snapshot does not see]: weights clamped in place (WGAN) after ``save``
    returned, while the version waited for the writer: the clamped values reached the file, and the
    version restored them without a word. The write fails instead, naming the tensors and what to
    do; the previous version stays the newest; with ``lazy=False`` the version holds the state at
    ``save``."""
    model, opt, sched = _setup()
    _train(model, opt, sched, range(1))
    ckpt = Checkpointer(tmp_path, model, opt)
    ckpt.save(1)
    ckpt.close()
    _train(model, opt, sched, range(1, 2))
    expected, expected_state = _weights(model), _opt_state(opt)
    for lazy in (True, False):
        ckpt = Checkpointer(tmp_path, model, opt, lazy=lazy)
        go = threading.Event()
        ckpt._hook = lambda at, go=go: go.wait(10) if at == "snapshot" else None
        ckpt.save(2)
        with torch.no_grad():
            model.blocks[0].mlp.fc.weight.clamp_(-0.01, 0.01)  # the loop's own change, not an update
        go.set()
        if lazy:
            with pytest.raises(CheckpointError, match=r"blocks\.0\.mlp\.fc\.weight were changed in place after "
                                                      r"save\(2\) returned .*ckpt\.wait\(\).*lazy=False"):
                ckpt.wait()
            assert [v.step for v in ckpt.versions()] == [1] and not (tmp_path / "step-000000002").exists()
        else:
            ckpt.wait()
        ckpt.close()
        model.load_state_dict(expected)
    _assert_restores(tmp_path, 2, expected, expected_state)
    opt.close()


def test_one_writer_thread_serves_every_save_and_ends(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """NOTE [writer thread]: saves are handed to one waiting thread (no thread start per save); it
    ends at close(), or when no save came for _IDLE_SECONDS, and the next save starts another."""
    model, opt, sched = _setup()
    ckpt = Checkpointer(tmp_path, model, opt, keep=None)
    assert ckpt._writer is None
    writers = set()
    for step in range(3):
        _train(model, opt, sched, range(step, step + 1))
        ckpt.save(step + 1)
        writers.add(ckpt._writer)
    ckpt.wait()
    (writer,) = writers
    assert [v.step for v in ckpt.versions()] == [1, 2, 3] and writer.is_alive()
    ckpt.close()
    assert not writer.is_alive() and ckpt._writer is None
    monkeypatch.setattr(ckpt_mod, "_IDLE_SECONDS", 0.05)
    ckpt = Checkpointer(tmp_path, model, opt, keep=None)
    ckpt.save(4)
    writer = ckpt._writer
    ckpt.wait()
    writer.join(30)
    assert not writer.is_alive() and ckpt._writer is None  # idle: ended
    ckpt.save(5)
    ckpt.wait()
    assert [v.step for v in ckpt.versions()] == [1, 2, 3, 4, 5] and ckpt._writer is not writer
    ckpt.close()
    opt.close()


def test_the_writer_thread_survives_an_error_escaping_a_write(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """An exception out of _write itself (not its file errors, which it hands over) reaches wait(),
    and the same writer thread writes the next save: a dead writer would leave the next wait() hanging."""
    model, opt, sched = _setup()
    _train(model, opt, sched, range(1))
    ckpt = Checkpointer(tmp_path, model, opt)

    def broken(*job: object) -> None:
        raise RuntimeError("escaped")

    monkeypatch.setattr(ckpt, "_write", broken)
    ckpt.save(1)
    writer = ckpt._writer
    with pytest.raises(RuntimeError, match="escaped"):
        ckpt.wait()
    monkeypatch.undo()
    ckpt.save(2)
    ckpt.wait()
    assert ckpt._writer is writer and ckpt.latest().step == 2
    ckpt.close()
    opt.close()


def test_skip_if_busy_writes_nothing_while_the_previous_version_is_written(tmp_path: Path) -> None:
    """NOTE [skipped saves]: while a version is being written, save(if_busy="skip") returns False at
    once and writes nothing for its step; once the write is done, it saves. "wait" saves every step."""
    model, opt, sched = _setup()
    _train(model, opt, sched, range(1))
    expected, expected_state = _weights(model), _opt_state(opt)
    ckpt = Checkpointer(tmp_path, model, opt, keep=None)
    release = threading.Event()
    ckpt._hook = lambda at: release.wait(60) if at == "write:model.safetensors" else None
    assert ckpt.save(1, if_busy="skip") is True
    _train(model, opt, sched, range(1, 2))
    started = time.perf_counter()
    assert ckpt.save(2, if_busy="skip", loss=1.0) is False
    assert time.perf_counter() - started < 5  # did not wait for the held write
    release.set()
    ckpt.wait()
    assert ckpt.save(3, if_busy="skip") is True
    ckpt.wait()
    assert ckpt.save(4) is True
    ckpt.wait()
    assert [v.step for v in ckpt.versions()] == [1, 3, 4]
    model2, opt2, _ = _setup(seed=3)
    Checkpointer(tmp_path, model2, opt2).restore(1)
    assert _same(_weights(model2), expected) and _same_state(_opt_state(opt2), expected_state)
    with pytest.raises(ValueError, match="if_busy must be"):
        ckpt.save(5, if_busy="queue")
    with pytest.raises(ValueError, match="needs one rank"):
        Checkpointer(tmp_path / "dp", model, opt, rank=0, world=2).save(5, if_busy="skip")
    ckpt.close()
    opt.close()
    opt2.close()


_SAVES_AND_EXITS = """
import sys, torch, torch.nn as nn
from ooc.checkpoint import Checkpointer
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])  # 32 MiB: its write outlasts the exit
ckpt = Checkpointer(sys.argv[1], model)
ckpt.save(1)
print("saved", flush=True)
"""


def test_a_script_that_ends_right_after_save_still_writes_that_version(tmp_path: Path) -> None:
    """``save()`` returns at once and the script ends without ``wait()`` or ``close()``: the version it
    saved is written before the interpreter exits (the writer thread was a daemon, killed at exit with
    the version half written, or the process aborted in the writer's torch code), and the exit says so."""
    done = subprocess.run([sys.executable, "-c", _SAVES_AND_EXITS, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [v.step for v in list_versions(tmp_path / "ckpt")] == [1]
    assert "writing the version of step 1 before the interpreter exits" in done.stderr


def _wide(seed: int = 0, width: int = 512):  # noqa: ANN202
    """A model whose weights and moments are 256 KiB or more (the nano GPT's are smaller)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.GELU(), torch.nn.Linear(width, 256))
    return model, HostAdamW(model.parameters(), lr=1e-3, model=model)


def _wide_step(model, opt) -> None:  # noqa: ANN001
    model(torch.randn(4, model[0].in_features)).square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    opt.synchronize()


def _assert_wide_restores(directory: Path, step: int, expected: dict, expected_state: dict, width: int = 512) -> None:
    model, opt = _wide(seed=3, width=width)
    Checkpointer(directory, model, opt).restore(step)
    try:
        assert _same(_weights(model), expected) and _same_state(_opt_state(opt), expected_state)
    finally:
        opt.close()


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "copied"])
def test_large_tensors_are_written_straight_from_their_memory(tmp_path: Path, monkeypatch, lazy: bool) -> None:  # noqa: ANN001
    """NOTE [writes straight from the tensors]: every byte went through the bounce buffers, a copy
    that was the writer's largest CPU cost. Now of tensors of 256 KiB or more only the bytes before
    the first aligned offset and after the last go through them (the headers are padded so that
    memory and file offsets agree, and each parameter's 4-byte step no longer shifts the offsets
    of the next tensors); the version restores bit for bit and safetensors loads its files. (The
    weights are 32 MiB, which glibc always maps afresh: their memory lies alike modulo a page.)"""
    width = 32768
    model, opt = _wide(width=width)
    _wide_step(model, opt)
    bounce: list[tuple[int, int]] = []  # the bounce buffers' memory
    real_take, real_write = ckpt_mod._take_bounce_buffers, os.write

    def take() -> list:
        buffers = real_take()
        bounce.extend((b.ctypes.data, b.ctypes.data + len(b)) for b in buffers)
        return buffers

    copied = []  # bytes of the tensor files written from a bounce buffer

    def write(fd: int, data) -> int:  # noqa: ANN001
        address = np.frombuffer(data, np.uint8).ctypes.data
        done = real_write(fd, data)
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors") and any(lo <= address < hi for lo, hi in bounce):
            copied.append(done)
        return done

    monkeypatch.setattr(ckpt_mod, "_take_bounce_buffers", take)
    monkeypatch.setattr(os, "write", write)
    ckpt = Checkpointer(tmp_path, model, opt, lazy=lazy)
    assert ckpt.lazy == lazy
    ckpt.save(1)
    ckpt.wait()
    expected, expected_state = _weights(model), _opt_state(opt)
    folder = ckpt.latest().path
    tensor_bytes = sum((folder / f).stat().st_size for f in (MODEL_FILE, "optimizer-rank0.safetensors"))
    large = sum(p.numel() * 4 * 3 for p in model.parameters() if p.numel() * 4 >= 256 << 10)
    small = sum(p.numel() * 4 * 3 for p in model.parameters() if p.numel() * 4 < 256 << 10)
    headers = tensor_bytes - large - small - 4 * len(list(model.parameters()))  # the steps: 4 bytes each
    assert large > 0.9 * (tensor_bytes - headers)
    pieces = large // (4 << 20) + 4
    # The headers, the small tensors, each piece's ends, and the last block's padding.
    assert sum(copied) <= headers + small + 4 * len(expected_state) + (pieces + 2) * 2 * 4096, (sum(copied), tensor_bytes)
    for name in (MODEL_FILE, "optimizer-rank0.safetensors"):
        loaded = safetensors.torch.load_file(folder / name)
        assert loaded.keys() and all(t.is_contiguous() for t in loaded.values())
    assert torch.equal(safetensors.torch.load_file(folder / MODEL_FILE)["0.weight"], expected["0.weight"])
    _wide_step(model, opt)  # the live tensors change after the version
    _assert_wide_restores(tmp_path, 1, expected, expected_state, width)
    ckpt.close()
    opt.close()


def test_an_update_waits_for_a_write_straight_from_its_bucket(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """A piece of a live tensor written straight from its memory is held immutable until the write
    has returned, not only until it is handed to the I/O thread: the write is held back here, and
    the next step's update of that bucket waits for it; the version holds the state at save()
    (released earlier, the update changed the bytes under the write, whose checksum no longer
    matched)."""
    model, opt = _wide()
    _wide_step(model, opt)
    expected, expected_state = _weights(model), _opt_state(opt)
    writing, go = threading.Event(), threading.Event()
    real_write = ckpt_mod._Sink.write

    def held_back(sink, data) -> None:  # noqa: ANN001
        if len(data) >= 256 << 10 and not writing.is_set():  # the first: a piece of a tensor (the small ones are first)
            writing.set()
            assert go.wait(60)
        real_write(sink, data)

    monkeypatch.setattr(ckpt_mod._Sink, "write", held_back)
    ckpt = Checkpointer(tmp_path, model, opt)
    ckpt.save(1)
    assert writing.wait(60)
    trainer = threading.Thread(target=_wide_step, args=(model, opt), daemon=True)
    trainer.start()
    trainer.join(0.5)
    assert trainer.is_alive(), "the update went on while a write from its bucket's memory was in flight"
    go.set()
    trainer.join(60)
    assert not trainer.is_alive()
    ckpt.wait()
    _assert_wide_restores(tmp_path, 1, expected, expected_state)
    ckpt.close()
    opt.close()
