"""ooc.checkpoint as a new user meets it (issue 14): values a loop puts in ``extra``, ``keep``,
restoring into the wrong model, a damaged commit record, continuing after a fallback."""

from __future__ import annotations

import errno
import os
import threading
import warnings
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from torch import nn

from ooc.checkpoint import (
    MODEL_FILE,
    Checkpointer,
    CheckpointError,
    CorruptCheckpointError,
    UnreadableCheckpointError,
    damaged_versions,
    list_versions,
)

Point = namedtuple("Point", "x y")


def _linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def _steps(directory: Path) -> list[int]:
    return [v.step for v in list_versions(directory)]


@pytest.mark.parametrize("value", [np.int64(3), np.float32(0.5), np.arange(3), slice(1, 2)],
                         ids=["np.int64", "np.float32", "ndarray", "slice"])
def test_an_extra_value_restore_cannot_read_fails_the_save_not_the_restore(tmp_path: Path, value: object) -> None:
    """``extra={"pos": np.int64(3)}`` (a data position taken from a numpy index) pickles, but
    ``restore`` reads the state file with ``weights_only=True``, which refuses numpy objects: the
    version was committed and every later restore called its intact file corrupt (and with
    ``fallback=True``, every version). The save fails instead, saying what to convert, and commits
    nothing."""
    ckpt = Checkpointer(tmp_path, _linear(), extra={"pos": value})
    ckpt.save(1)
    with pytest.raises(CheckpointError, match=r"weights_only.*\(in extra\)") as info:
        ckpt.wait()
    assert not isinstance(info.value, CorruptCheckpointError)
    ckpt.close()
    assert _steps(tmp_path) == [] and os.listdir(tmp_path) == []
    extra = {"pos": 3}
    ckpt = Checkpointer(tmp_path, _linear(), extra=extra)
    ckpt.save(2)
    ckpt.wait()  # a plain value saves as before
    extra["pos"] = 0
    Checkpointer(tmp_path, _linear(), extra=extra).restore()
    assert extra == {"pos": 3}


@pytest.mark.parametrize("keep", [2.5, "3", True])
def test_keep_must_be_an_integer(tmp_path: Path, keep: object) -> None:
    """``keep=2.5`` was accepted; the first save's retention then failed on the writer thread, and
    the next ``wait`` reported a committed version as not written."""
    with pytest.raises(ValueError, match="keep must be"):
        Checkpointer(tmp_path, _linear(), keep=keep)


class _Other(nn.Module):
    """Shares ``weight`` with ``nn.Linear(3, 2)``'s names, not the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, 3))
        self.scale = nn.Parameter(torch.zeros(2))


@pytest.mark.parametrize("other", ["keys", "shapes"])
def test_a_version_that_does_not_fit_the_model_loads_nothing(tmp_path: Path, other: str) -> None:
    """A model built otherwise than the saved one (other keys, or the same keys with other shapes):
    ``restore`` raises ``CheckpointError`` saying so, and the model keeps its weights. Before, the
    matching tensors were loaded first (other keys), or torch's own size-mismatch error came out of
    ``load_state_dict`` (other shapes)."""
    ckpt = Checkpointer(tmp_path, _linear())
    ckpt.save(1)
    ckpt.wait()
    model = _Other() if other == "keys" else nn.Linear(4, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="does not fit the model"):
        Checkpointer(tmp_path, model).restore()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_model_of_another_size_is_told_in_a_line_not_a_wall(tmp_path: Path) -> None:
    """``ooc train --resume`` with another --preset listed every tensor of the model (60 of them) with
    both shapes in one line; it names how many differ and the first few."""
    ckpt = Checkpointer(tmp_path, nn.Sequential(*(nn.Linear(8, 8) for _ in range(6))))
    ckpt.save(1)
    ckpt.wait()
    with pytest.raises(CheckpointError) as info:
        Checkpointer(tmp_path, nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))).restore()
    assert str(info.value) == (
        f"checkpoint {tmp_path / 'step-000000001'} does not fit the model: tensors 4 unexpected (4.bias, 4.weight, "
        "5.bias and 1 more), 8 of other shapes (0.weight: saved [8, 8], now [4, 4], 0.bias: saved [8], now [4], "
        "1.weight: saved [8, 8], now [4, 4] and 5 more); build the model as it was saved")


@pytest.mark.parametrize("damage", ["flipped", "truncated", "empty"])
def test_a_damaged_commit_record_is_reported_and_its_version_kept(tmp_path: Path, damage: str) -> None:
    """A commit record is renamed into place whole, so one that exists but does not parse was
    damaged after its commit, as any other file can be; a crash leaves none. It was taken for a
    crash's leftover: the next Checkpointer deleted the whole version (weights and optimizer state
    intact) and ``restore()`` loaded the version before it without a word. Now the version stays,
    ``restore()`` raises ``CorruptCheckpointError`` naming the record, and ``fallback=True`` loads
    the version before."""
    ckpt = Checkpointer(tmp_path, _linear(), keep=3)
    for step in (1, 2):
        ckpt.save(step)
        ckpt.wait()
    ckpt.close()
    record = tmp_path / "step-000000002" / "manifest-rank0.json"
    data = bytearray(record.read_bytes())
    if damage == "flipped":
        data[0] ^= 0x01
    record.write_bytes(bytes(data[:len(data) // 2] if damage == "truncated" else b"" if damage == "empty" else data))
    files = sorted(os.listdir(record.parent))
    ckpt = Checkpointer(tmp_path, _linear(seed=1))
    assert sorted(os.listdir(record.parent)) == files
    for step in (None, 2):
        with pytest.raises(CorruptCheckpointError, match="manifest-rank0.json"):
            ckpt.restore(step)
    assert ckpt.restore(fallback=True).step == 1


@pytest.mark.parametrize("change", [('"pos": 20', '"pos": 21'), ('.safetensors"', '.safetensorr"'), ('"shape": [2', '"shape": [3'),
                                    ('"world": 1', '"world": 3'), ('"format": 4', '"format": 5'),
                                    ('"format": 4', '"format": 0')],
                         ids=["metadata", "file-name", "shape", "world", "format-5", "format-0"])
def test_a_commit_record_with_a_flipped_bit_that_still_parses_is_reported(tmp_path: Path, change: tuple[str, str]) -> None:
    """One flipped bit in a commit record that leaves valid JSON (a digit, a letter of a name):
    the record held no checksum of its own, so a changed metadata value restored without a word, a
    changed file name raised a plain ``CheckpointError`` and a changed shape a ``RuntimeError``,
    both of which ``restore(fallback=True)`` passed on instead of loading the version before, and a
    changed world size made the version look uncommitted (records of ranks that never were), so the
    next Checkpointer deleted it, intact files and all. The record now holds its own XXH3-64,
    checked before anything in it is used (NOTE [damaged records]), whatever format the record
    says it has: a flipped bit in the format (5, or 0) was taken for a version of another ooc
    release ("restore it with the ooc that wrote it"), which ``fallback=True`` did not skip."""
    model = _linear()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    ckpt = Checkpointer(tmp_path, model, opt, keep=3)
    for step in (1, 2):
        ckpt.save(step, pos=10 * step)
        ckpt.wait()
    ckpt.close()
    record = tmp_path / "step-000000002" / "manifest-rank0.json"
    text = record.read_text()
    assert change[0] in text
    record.write_text(text.replace(*change, 1))
    other = _linear(seed=1)
    ckpt = Checkpointer(tmp_path, other, torch.optim.AdamW(other.parameters()))
    assert record.exists()
    with pytest.raises(CorruptCheckpointError, match="manifest-rank0.json"):
        ckpt.restore()
    assert list(damaged_versions(tmp_path)) == [2]
    v = ckpt.restore(fallback=True)
    assert v.step == 1 and v.metadata == {"pos": 10}


def test_metadata_json_changes_is_recorded_as_it_reads_back(tmp_path: Path) -> None:
    """JSON turns an int key into a string (two keys can become one) and a tuple into a list: the
    record holds the metadata as a reader parses it, so its own XXH3-64 matches on reading and the
    metadata ``versions()`` and ``restore()`` give is that parsed value."""
    ckpt = Checkpointer(tmp_path, _linear())
    ckpt.save(1, pos={1: "a", "1": "b"}, shape=(2, 3))
    ckpt.close()
    assert damaged_versions(tmp_path) == {}
    v = Checkpointer(tmp_path, _linear()).restore()
    assert v.metadata == {"pos": {"1": "b"}, "shape": [2, 3]}


def _damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _saved(directory: Path, steps: tuple[int, ...], keep: int | None = 3) -> Checkpointer:
    ckpt = Checkpointer(directory, _linear(), keep=keep)
    for step in steps:
        ckpt.save(step)
        ckpt.wait()
    return ckpt


def _moved_aside(directory: Path) -> list[str]:
    return sorted(p.name.partition(".damaged-")[0] for p in directory.iterdir() if ".damaged-" in p.name)


def test_retention_keeps_an_older_version_with_a_damaged_record(tmp_path: Path) -> None:
    """NOTE [damaged records]: retention took a version whose record was damaged for a crash's
    leftover and deleted it, intact files and all, once a newer version was committed."""
    ckpt = _saved(tmp_path, (1, 2), keep=2)
    _damage(tmp_path / "step-000000001" / "manifest-rank0.json")
    ckpt.close()
    ckpt = _saved(tmp_path, (), keep=2)
    for step in (3, 4):
        ckpt.save(step)
        ckpt.wait()
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == ["step-000000001", "step-000000003", "step-000000004"]
    assert list(damaged_versions(tmp_path)) == [1]


@pytest.mark.parametrize("damage", ["file", "record"])
def test_a_loop_continues_saving_after_falling_back_past_a_damaged_version(tmp_path: Path, damage: str) -> None:
    """README's loop with ``restore(fallback=True)``: the newest version's model file (or its commit
    record) is damaged, the resume loads the one before and saves the steps after it, as the run
    that never stopped. The save at the damaged version's step failed ('already committed', raised
    by the next save). Now it moves the damaged folder aside, kept and named in a warning, and
    writes the version (NOTE [damaged versions moved aside])."""
    _saved(tmp_path, (1, 2, 3)).close()
    damaged = tmp_path / "step-000000003" / ("model.safetensors" if damage == "file" else "manifest-rank0.json")
    _damage(damaged)
    ckpt = Checkpointer(tmp_path, _linear(seed=1), keep=3)
    start = ckpt.restore(fallback=True).step + 1
    assert start == 3
    with pytest.warns(UserWarning, match=r"step-000000003 is damaged .*moved it aside to step-000000003\.damaged-"):
        ckpt.save(start)
    ckpt.save(start + 1)
    ckpt.wait()
    assert _steps(tmp_path) == [2, 3, 4]
    assert ckpt.restore(3).step == 3
    assert _moved_aside(tmp_path) == ["step-000000003"]
    kept = next(tmp_path.glob("step-000000003.damaged-*"))
    assert (kept / damaged.name).read_bytes() != (tmp_path / "step-000000003" / damaged.name).read_bytes()
    Checkpointer(tmp_path, _linear()).close()  # a new Checkpointer's cleanup leaves it be too
    assert _moved_aside(tmp_path) == ["step-000000003"]


@pytest.mark.parametrize("unreadable", ["file", "record"])
def test_a_version_the_file_system_fails_to_read_is_never_moved_aside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      unreadable: str) -> None:
    """An I/O error reading the newest version (a disk or network file system failing for a while)
    was taken for damage: the fallback skipped it, as it should, but the next save then moved the
    intact version aside. Now it raises ``UnreadableCheckpointError``, a fallback skips it alike, and
    it stays where it is, whole, for the resume once the file system answers again."""
    _saved(tmp_path, (1, 2, 3), keep=None).close()
    failing = tmp_path / "step-000000003" / ("model.safetensors" if unreadable == "file" else "manifest-rank0.json")

    def fail_at(original):  # noqa: ANN001, ANN202
        def read(self: Path, *args: object, **kwargs: object) -> object:
            if self == failing:
                raise OSError(errno.EIO, "Input/output error")
            return original(self, *args, **kwargs)
        return read

    monkeypatch.setattr(Path, "read_text", fail_at(Path.read_text))
    monkeypatch.setattr(Path, "read_bytes", fail_at(Path.read_bytes))
    ckpt = Checkpointer(tmp_path, _linear(seed=1), keep=None)
    with pytest.raises(UnreadableCheckpointError, match=r"cannot be read .*Input/output error.*kept as it is"):
        ckpt.restore()
    assert ckpt.restore(fallback=True).step == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of a version moved aside
        ckpt.save(4)
        ckpt.wait()
    monkeypatch.undo()
    assert _moved_aside(tmp_path) == [] and _steps(tmp_path) == [1, 2, 3, 4]
    assert ckpt.restore(3).step == 3
    ckpt.close()


def test_every_damaged_version_above_the_restored_one_is_moved_aside(tmp_path: Path) -> None:
    """Versions 2 and 3 damaged: the fallback loads 1, and the next save (at 2, below the damaged 3)
    moves both aside; a save at the step of a version found intact is still refused."""
    _saved(tmp_path, (1, 2, 3), keep=None).close()
    for step in (2, 3):
        _damage(tmp_path / f"step-00000000{step}" / "model.safetensors")
    ckpt = Checkpointer(tmp_path, _linear(seed=1))
    assert ckpt.restore(fallback=True).step == 1
    with pytest.raises(CheckpointError, match="already committed"):
        ckpt.save(1)
    with pytest.warns(UserWarning, match="damaged"):
        ckpt.save(2)
    ckpt.wait()
    assert _steps(tmp_path) == [1, 2] and _moved_aside(tmp_path) == ["step-000000002", "step-000000003"]


@pytest.mark.parametrize("first", [0, 1], ids=["rank0-first", "rank1-first"])
def test_two_ranks_continue_past_a_damaged_version_moved_aside_once(tmp_path: Path, first: int) -> None:
    """Two ranks fall back past version 2 alike and save it again: the rank that saves first moves
    the damaged folder aside and begins the new one (held midway here, its folder locked); the
    other finds the name taken by the new folder, moves nothing and commits into it."""
    ranks = [Checkpointer(tmp_path, _linear(), rank=r, world=2) for r in range(2)]
    for step in (1, 2):
        for ckpt in ranks:
            ckpt.save(step)
            ckpt.wait()
    _damage(tmp_path / "step-000000002" / "model.safetensors")
    assert [ckpt.restore(fallback=True).step for ckpt in ranks] == [1, 1]
    held, go = threading.Event(), threading.Event()
    ranks[first]._hook = lambda point: point == "files-written" and (held.set(), go.wait(10))
    with pytest.warns(UserWarning, match="step-000000002 is damaged") as warned:
        ranks[first].save(2)
        assert held.wait(10)
        ranks[1 - first].save(2)
        ranks[1 - first].wait()
        go.set()
        ranks[first].wait()
    assert len(warned) == 1
    assert _steps(tmp_path) == [1, 2] and _moved_aside(tmp_path) == ["step-000000002"]
    for ckpt in ranks:
        ckpt.close()
    assert Checkpointer(tmp_path, _linear(seed=1)).restore().step == 2


def test_a_damaged_version_no_restore_judged_still_refuses_a_save_at_its_step(tmp_path: Path) -> None:
    """A version whose files were never checked (no fallback restore skipped it) counts as intact:
    the save at its step is refused, the error saying how to get past it, and nothing is moved."""
    _saved(tmp_path, (1, 2)).close()
    _damage(tmp_path / "step-000000002" / "model.safetensors")
    ckpt = Checkpointer(tmp_path, _linear(seed=1))
    ckpt.restore(1)
    with pytest.raises(CheckpointError, match=r"already committed.*restore\(fallback=True\)"):
        ckpt.save(2)
    assert _moved_aside(tmp_path) == [] and _steps(tmp_path) == [1, 2]


def test_a_save_below_the_newest_version_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """``save(1)`` after versions 5, 6, 7 returned True and committed the version, then retention
    (keep the newest by step) retired it at once: save said the step got a version and there was
    none (with a larger ``keep`` it stayed, but a resume went on picking step 7). ``save`` now
    refuses it at once, saying how to branch (NOTE [saves go forward]); at a committed step too,
    which the writer refused only later, from the next save."""
    ckpt = _saved(tmp_path, (5, 6, 7))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(CheckpointError, match=r"step 1 is below the newest version \(step 7\).*new directory"):
        ckpt.save(1)
    with pytest.raises(CheckpointError, match=r"step-000000007 is already committed"):
        ckpt.save(7)
    with pytest.raises(CheckpointError, match=r"step 6 is below"):
        ckpt.check_step(6)
    assert sorted(os.listdir(tmp_path)) == before
    ckpt.close()
    with pytest.raises(CheckpointError, match=r"step 6 is below"):
        Checkpointer(tmp_path, _linear()).check_step(6)
    assert sorted(os.listdir(tmp_path)) == [name for name in before if not name.startswith(".writer-")]
    ckpt = Checkpointer(tmp_path, _linear())
    assert ckpt.save(8)
    ckpt.wait()
    assert _steps(tmp_path) == [6, 7, 8]


def test_a_save_below_only_damaged_or_incomplete_versions_is_written(tmp_path: Path) -> None:
    """Steps 3 (its commit record damaged) and 4 (incomplete: no record) do not count as newer."""
    _saved(tmp_path, (1, 2, 3)).close()
    _damage(tmp_path / "step-000000003" / "manifest-rank0.json")
    (tmp_path / "step-000000004").mkdir()
    ckpt = Checkpointer(tmp_path, _linear(), keep=3)
    with pytest.warns(UserWarning, match="step-000000003 is damaged"):
        ckpt.save(3)
    ckpt.wait()
    assert _steps(tmp_path) == [1, 2, 3]


def test_saves_read_the_directory_once(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The check of a save's step is a comparison with the newest step the Checkpointer knows: the
    training thread reads the directory at the start (rank 0's cleanup) and at the first save, as it
    takes the directory's lock, not per save (retention reads it on the writer)."""
    import ooc.checkpoint as ckpt_mod

    reads = []
    real = ckpt_mod._scan
    main = threading.current_thread()

    def scan(directory: Path):  # noqa: ANN202
        if threading.current_thread() is main:
            reads.append(1)
        return real(directory)

    monkeypatch.setattr(ckpt_mod, "_scan", scan)
    _saved(tmp_path, (1,)).close()
    reads.clear()
    ckpt = Checkpointer(tmp_path, _linear())
    assert reads == [1]  # its cleanup's
    for step in range(2, 6):
        ckpt.save(step)
        ckpt.wait()
    assert reads == [1, 1]  # and the first save's, as it takes the directory (NOTE [one job per directory])


def test_restoring_an_older_version_then_saving_the_next_step_is_refused(tmp_path: Path) -> None:
    """Versions 3, 4, 5; ``restore(3)`` then ``save(4)`` would lose the branch at once (NOTE [saves
    go forward]): refused before anything is written, saying how to branch."""
    _saved(tmp_path, (3, 4, 5)).close()
    ckpt = Checkpointer(tmp_path, _linear(seed=1), keep=3)
    assert ckpt.restore(3).step == 3
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(CheckpointError, match=r"step 4 is below the newest version \(step 5\).*new directory"):
        ckpt.save(4)
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("damage", ["file", "record"])
def test_a_fallback_then_keep_1_leaves_the_newest_and_the_damaged_version_aside(tmp_path: Path, damage: str) -> None:
    """Retention with ``keep=1`` after a fallback past damaged version 3: the saves from 3 on leave
    the newest version and the damaged one moved aside, nothing else."""
    _saved(tmp_path, (1, 2, 3), keep=None).close()
    _damage(tmp_path / "step-000000003" / ("model.safetensors" if damage == "file" else "manifest-rank0.json"))
    ckpt = Checkpointer(tmp_path, _linear(seed=1), keep=1)
    assert ckpt.restore(fallback=True).step == 2
    with pytest.warns(UserWarning, match="step-000000003 is damaged"):
        ckpt.save(3)
    for step in (4, 5):
        ckpt.save(step)
        ckpt.wait()
    ckpt.close()
    assert _steps(tmp_path) == [5] and _moved_aside(tmp_path) == ["step-000000003"]
    assert len(os.listdir(tmp_path)) == 2


def test_a_fresh_start_after_every_version_failed_moves_them_aside(tmp_path: Path) -> None:
    """``keep=1`` left one version, and it is damaged: ``restore(fallback=True)`` finds none intact;
    the loop starts afresh, and its first save moves the damaged version aside."""
    _saved(tmp_path, (1,), keep=1).close()
    _damage(tmp_path / "step-000000001" / "model.safetensors")
    ckpt = Checkpointer(tmp_path, _linear(seed=1), keep=1)
    with pytest.raises(CheckpointError, match="every checkpoint"):
        ckpt.restore(fallback=True)
    with pytest.warns(UserWarning, match="step-000000001 is damaged"):
        ckpt.save(1)
    ckpt.wait()
    ckpt.close()
    assert _steps(tmp_path) == [1] and _moved_aside(tmp_path) == ["step-000000001"]


def test_two_checkpointers_on_one_directory_refuse_each_others_steps(tmp_path: Path) -> None:
    """Two Checkpointers saving into one directory took turns: each refused (late, from ``wait``) the
    steps the other had committed, and retention went by both. Now the second, in the same process,
    takes the directory over from the first (NOTE [a newer Checkpointer takes over]; another job's
    is refused: NOTE [one job per directory]) and reads the directory again as it takes it, so a
    step the first committed meanwhile is refused at once; the first saves no more."""
    a = _saved(tmp_path, (1, 2))
    b = Checkpointer(tmp_path, _linear(seed=1), keep=3)
    a.save(3)
    with pytest.warns(UserWarning, match="took the directory over"), \
            pytest.raises(CheckpointError, match="step-000000003 is already committed"):
        b.save(3)
    with pytest.raises(CheckpointError, match="superseded"):
        a.save(4)
    b.save(4)
    b.wait()
    b.close()
    assert _steps(tmp_path) == [2, 3, 4]


@pytest.mark.parametrize("step", [np.int64(3), torch.tensor(3)], ids=["np.int64", "tensor"])
def test_a_step_of_an_integer_type_saves_as_an_int(tmp_path: Path, step: object) -> None:
    """``for step in np.arange(n): ckpt.save(step)`` failed on the writer thread (the commit record's
    JSON has no numpy int), reported by the next save as 'could not write checkpoint'."""
    ckpt = Checkpointer(tmp_path, _linear())
    assert ckpt.save(step)
    ckpt.wait()
    assert _steps(tmp_path) == [3]


def test_a_step_that_is_no_integer_is_refused_at_once(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, _linear())
    with pytest.raises(TypeError, match="step must be an int"):
        ckpt.save(3.0)


@pytest.mark.parametrize("version", [2.7, True, "2"], ids=["float", "bool", "str"])
def test_a_version_that_is_no_step_is_refused_by_restore_and_export(tmp_path: Path, version: object) -> None:
    """``restore(2.7)`` loaded step 2 and ``restore(True)`` step 1 (``int(version)``), without a
    word; ``export("2")`` said there was no version of step 2. Each is refused, as ``save`` refuses a
    step that is no integer, and nothing is loaded."""
    model = _linear()
    ckpt = Checkpointer(tmp_path, model)
    for step in (1, 2):
        ckpt.save(step)
        ckpt.wait()
    other = _linear(seed=1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    reader = Checkpointer(tmp_path, other)
    with pytest.raises(TypeError, match="version must be a step"):
        reader.restore(version)
    with pytest.raises(TypeError, match="version must be a step"):
        reader.export(version, tmp_path / "w.safetensors")
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    assert reader.restore(np.int64(1)).step == 1  # an integer of another type is a step
    ckpt.close()


def test_a_resume_that_leaves_out_the_saved_scheduler_or_extra_says_so(tmp_path: Path) -> None:
    """NOTE [state a restore leaves out]: a resume made without the ``scheduler=`` and ``extra=``
    the version was saved with restored the rest without a word: the LR schedule started over.
    It warns now, naming both, from the caller's line; restoring the weights alone does not."""
    model = _linear()
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    ckpt = Checkpointer(tmp_path, model, opt, scheduler=sched, extra={"pos": 3})
    ckpt.save(1)
    ckpt.close()
    other = _linear(seed=1)
    with pytest.warns(UserWarning, match=r"LR scheduler's state and an extra dict.*without scheduler= and extra=") as info:
        Checkpointer(tmp_path, other, torch.optim.AdamW(other.parameters())).restore()
    assert info[0].filename == __file__
    other_opt = torch.optim.AdamW(other.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Checkpointer(tmp_path, _linear(seed=2)).restore()
        Checkpointer(tmp_path, other, other_opt, scheduler=torch.optim.lr_scheduler.StepLR(other_opt, 1, 0.5),
                     extra={}).restore()


def test_an_optimizer_parameter_the_model_does_not_hold_is_warned_of(tmp_path: Path) -> None:
    """NOTE [parameters outside the model]: a learnable temperature beside the model, in the
    optimizer: its moments were saved, its value not, and a restore left it as built with its
    state at the saved step, without a word. The first save and restore warn, naming it."""
    model, temp = _linear(), nn.Parameter(torch.ones(()))
    opt = torch.optim.AdamW([*model.parameters(), temp], lr=0.1)
    (model(torch.ones(1, 3)).sum() * temp).backward()
    opt.step()
    ckpt = Checkpointer(tmp_path, model, opt)
    with pytest.warns(UserWarning, match=r"1 parameter\(s\) that the model .* does not hold \(param2 of shape \[\]\)") as info:
        ckpt.save(1)
    assert info[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per Checkpointer
        ckpt.save(2)
    ckpt.close()
    other, other_temp = _linear(seed=1), nn.Parameter(torch.ones(()))
    with pytest.warns(UserWarning, match="param2 of shape") as info:
        Checkpointer(tmp_path, other, torch.optim.AdamW([*other.parameters(), other_temp])).restore()
    assert info[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every parameter in the model: nothing to say
        Checkpointer(tmp_path / "held", model, torch.optim.AdamW(model.parameters())).save(1)


@pytest.mark.parametrize("extra", [[1, 2], (1, 2), 5], ids=["list", "tuple", "int"])
def test_an_extra_that_is_no_dict_is_refused_where_the_checkpointer_is_made(tmp_path: Path, extra: object) -> None:
    """``extra=[...]`` was taken and saved, and every restore failed after loading the model
    (``AttributeError: 'list' object has no attribute 'update'``): restore updates it in place."""
    with pytest.raises(TypeError, match=f"extra must be a dict .*got {type(extra).__name__}"):
        Checkpointer(tmp_path, _linear(), extra=extra)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("saved, restored, lacking", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), torch.optim.AdamW, "'betas'"),
    (torch.optim.AdamW, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "'momentum'"),
], ids=["sgd-into-adamw", "adamw-into-sgd"])
def test_a_version_of_another_kind_of_optimizer_loads_nothing(tmp_path: Path, saved, restored, lacking: str) -> None:  # noqa: ANN001
    """NOTE [an optimizer of another kind]: an SGD's version restored into an AdamW loaded the
    model and failed with ``KeyError: 'step'``; an AdamW's into an SGD restored, and the next step
    failed with ``KeyError: 'momentum'``. Refused now, naming the saver, before anything is loaded;
    Adam's restores into AdamW as before."""
    model = _linear()
    opt = saved(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    ckpt = Checkpointer(tmp_path, model, opt)
    ckpt.save(1)
    ckpt.close()
    other = _linear(seed=1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    other_opt = restored(other.parameters())
    groups = [dict(g) for g in other_opt.state_dict()["param_groups"]]
    with pytest.raises(CheckpointError, match=f"another kind of optimizer \\(saved by {type(opt).__name__}\\).*{lacking}"):
        Checkpointer(tmp_path, other, other_opt).restore()
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    assert other_opt.state_dict()["param_groups"] == groups
    adam_model = _linear(seed=2)
    ckpt = Checkpointer(tmp_path / "adam", adam_model, torch.optim.Adam(adam_model.parameters()))
    ckpt.save(1)
    ckpt.close()
    adamw = torch.optim.AdamW(other.parameters())
    Checkpointer(tmp_path / "adam", other, adamw).restore()
    other(torch.ones(1, 3)).sum().backward()
    adamw.step()


@pytest.mark.parametrize("saved, now", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["fp32-into-bf16", "bf16-into-fp32"])
def test_a_resume_into_a_model_of_other_dtypes_says_so(tmp_path: Path, saved: torch.dtype, now: torch.dtype) -> None:
    """NOTE [a resume into other dtypes]: fp32 weights and AdamW moments restored into a bf16 model
    (``.to(torch.bfloat16)`` forgotten, or added) were cast by ``load_state_dict`` without a word,
    and the run went on from rounded state. A restore with an optimizer warns, naming the tensors;
    weights alone are cast as asked."""
    model = _linear().to(saved)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3, dtype=saved)).sum().backward()
    opt.step()
    ckpt = Checkpointer(tmp_path, model, opt)
    ckpt.save(1)
    ckpt.close()
    other = _linear(seed=1).to(now)
    with pytest.warns(UserWarning, match=f"other dtypes, 2 tensor.*weight: saved {saved}, now {now}") as info:
        Checkpointer(tmp_path, other, torch.optim.AdamW(other.parameters())).restore()
    assert info[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Checkpointer(tmp_path, _linear(seed=2).to(now)).restore()


def test_a_version_folder_given_for_the_directory_is_refused_naming_the_directory(tmp_path: Path) -> None:
    """``Checkpointer("ckpt/step-000000005", model).restore()``: "no complete checkpoint in
    ckpt/step-000000005", with the version right there; a save nested versions inside it (which the
    retention of ``ckpt`` deletes with it). Refused where it is made, naming the directory and step."""
    ckpt = Checkpointer(tmp_path, _linear())
    ckpt.save(5)
    ckpt.close()
    folder = tmp_path / "step-000000005"
    files = sorted(os.listdir(folder))
    for call in (lambda: Checkpointer(folder, _linear()), lambda: list_versions(folder)):
        with pytest.raises(ValueError, match=rf"is the folder of one version \(step 5\) of the checkpoint directory "
                                             rf"{tmp_path}: .*restore\(5\)"):
            call()
    assert sorted(os.listdir(folder)) == files
    assert Checkpointer(tmp_path, _linear()).restore(5).step == 5


def test_export_names_a_damaged_version_and_an_empty_directory(tmp_path: Path) -> None:
    """``export`` said "no complete checkpoint for step None" in a directory without versions, and
    "no complete checkpoint for step 2" for a version whose commit record is damaged, where
    ``restore`` names the damaged file."""
    ckpt = Checkpointer(tmp_path, _linear())
    with pytest.raises(CheckpointError, match=rf"^no complete checkpoint in {tmp_path}$"):
        ckpt.export(None, tmp_path / "w.safetensors")
    for step in (1, 2):
        ckpt.save(step)
        ckpt.wait()
    ckpt.close()
    (tmp_path / "step-000000002" / "manifest-rank0.json").write_text("{")
    for version in (None, 2):
        with pytest.raises(CorruptCheckpointError, match="step-000000002/manifest-rank0.json"):
            ckpt.export(version, tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError, match=r"no complete checkpoint for step 7 .*there are \[1\]"):
        ckpt.export(7, tmp_path / "w.safetensors")
    assert ckpt.export(1, tmp_path / "w.safetensors").is_file()


def test_ranks_without_a_process_group_are_waited_for_at_close(tmp_path: Path) -> None:
    """NOTE [every rank commits where this rank does] without a process group: ``world=2`` given in
    a process alone closed without a word, no version complete, and the next Checkpointer's cleanup
    deleted them all. ``close`` now waits for the other ranks' records on the files, warns that it
    waits, and raises naming the rank and what to do; two ranks that both save close quietly."""
    lone = Checkpointer(tmp_path / "lone", _linear(), rank=0, world=2, timeout_s=2.5)
    lone.save(1)
    with pytest.warns(UserWarning, match=r"close\(\) of rank 0 waits up to 2.5 s .* rank 1 of the version of step 1"), \
            pytest.raises(CheckpointError, match=r"no commit record of rank 1 \(rank 0 waited 2.5 s .*give world=1"):
        lone.close()
    ranks = [Checkpointer(tmp_path / "two", _linear(), rank=r, world=2, timeout_s=30) for r in range(2)]
    for ckpt in ranks:
        ckpt.save(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ckpt in ranks:
            ckpt.close()
    assert _steps(tmp_path / "two") == [1]


def test_a_list_of_schedulers_is_told_how_to_save_them(tmp_path: Path) -> None:
    """``scheduler=[warmup, cosine]`` was refused as arguments in the wrong order."""
    model = _linear()
    opt = torch.optim.AdamW(model.parameters())
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, 1), torch.optim.lr_scheduler.StepLR(opt, 2)]
    with pytest.raises(TypeError, match="one LR scheduler, got a list of 2: chain them into one .*SequentialLR"):
        Checkpointer(tmp_path, model, opt, scheduler=schedulers)


def test_a_version_of_another_directory_is_refused(tmp_path: Path) -> None:
    """``restore(v)`` with ``v`` from another directory's ``versions()`` loaded this directory's
    version of ``v.step``, without a word."""
    for name in ("a", "b"):
        ckpt = Checkpointer(tmp_path / name, _linear())
        ckpt.save(1)
        ckpt.close()
    reader = Checkpointer(tmp_path / "a", _linear(seed=1))
    elsewhere = list_versions(tmp_path / "b")[0]
    for call in (lambda: reader.restore(elsewhere), lambda: reader.export(elsewhere, tmp_path / "w.safetensors")):
        with pytest.raises(ValueError, match="not in this Checkpointer's directory"):
            call()
    assert reader.restore(reader.latest()).step == 1


def _groups(model: nn.Module, split: bool) -> list:
    """The model's parameters in one group, or split in two (weight decay on the first only)."""
    params = list(model.parameters())
    return [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}] if split else params


@pytest.mark.parametrize("saved_split", [False, True], ids=["one-group-saved", "two-groups-saved"])
def test_other_parameter_groups_are_refused_before_anything_is_loaded(tmp_path: Path, saved_split: bool) -> None:
    """An optimizer whose parameters are split into other groups than the saved one's: torch's
    ``load_state_dict`` raised its ValueError after the model's weights were loaded. Now a
    ``CheckpointError`` naming the groups comes first, and nothing is loaded."""
    model = _linear()
    opt = torch.optim.AdamW(_groups(model, saved_split), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    ckpt = Checkpointer(tmp_path, model, opt)
    ckpt.save(1)
    ckpt.wait()
    other = _linear(seed=1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match="parameter group"):
        Checkpointer(tmp_path, other, torch.optim.AdamW(_groups(other, not saved_split), lr=0.1)).restore()
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_extra_holds_its_values_at_save_while_the_loop_changes_them(tmp_path: Path) -> None:
    """``save`` returns before the writer serializes ``extra``; a set in it (ids of the samples
    seen) that the loop changes after ``save`` was written as it was by then, not as at the save."""
    seen = {1}
    ckpt = Checkpointer(tmp_path, _linear(), extra={"seen": seen})
    go = threading.Event()
    ckpt._hook = lambda point: point == f"write:{MODEL_FILE}" and go.wait(10)
    ckpt.save(1)
    seen.add(2)
    go.set()
    ckpt.wait()
    extra: dict = {}
    Checkpointer(tmp_path, _linear(), extra=extra).restore()
    assert extra == {"seen": {1}}


def test_a_namedtuple_in_extra_is_refused_by_name(tmp_path: Path) -> None:
    """A namedtuple in ``extra`` made ``save`` raise TypeError from inside its copy
    (``__new__() missing ... arguments``); it is copied, then refused as any value restore cannot
    read (NOTE [state files load with weights_only])."""
    ckpt = Checkpointer(tmp_path, _linear(), extra={"at": Point(1, 2)})
    ckpt.save(1)
    with pytest.raises(CheckpointError, match=r"weights_only.*\(in extra\)"):
        ckpt.wait()


def test_a_compiled_models_version_holds_the_plain_names(tmp_path: Path) -> None:
    """``torch.compile(model)`` (a supported way to run a wrapped model) names every tensor
    ``_orig_mod.<name>``: the version's model file, README's "load them into plain PyTorch or HF",
    did not load into the plain model, nor did the version restore into it (an evaluation script).
    The Checkpointer saves the compiled model's module, so either restores the other."""
    compiled = torch.compile(_linear())
    ckpt = Checkpointer(tmp_path, compiled)
    ckpt.save(1)
    ckpt.wait()
    plain = _linear(seed=1)
    plain.load_state_dict(safetensors.torch.load_file(ckpt.latest().path / MODEL_FILE))
    assert torch.equal(plain.weight, compiled.weight)
    other = _linear(seed=2)
    Checkpointer(tmp_path, other).restore()
    assert torch.equal(other.weight, compiled.weight)
    again = torch.compile(_linear(seed=3))
    Checkpointer(tmp_path, again).restore()
    assert torch.equal(again.weight, compiled.weight)


def _gpt_host(seed: int, **options: object):  # noqa: ANN202
    from dataclasses import replace

    from ooc.models.gpt import GPT, GPT_PRESETS
    from ooc.optim import HostAdamW

    torch.manual_seed(seed)
    model = GPT(replace(GPT_PRESETS["nano"], n_layer=2))
    return model, HostAdamW(model.parameters(), lr=1e-2, model=model, **options)


def _gpt_step(model: nn.Module, seed: int) -> None:
    x = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(x, x)[1].backward()


def _within(seconds: float, fn) -> None:  # noqa: ANN001
    """Run ``fn()`` on a daemon thread; fail if it has not returned within ``seconds`` (a hang)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: a hang"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("options", [{"rollback": True}, {}, {"max_grad_norm": 1.0}], ids=["rollback", "pipelined", "clip"])
def test_a_restore_after_a_step_that_raised_holds_the_version(tmp_path: Path, options: dict) -> None:
    """A step raised between ``backward()`` and ``step()`` (the moment a loop restores an earlier
    version), then ``restore`` and ``zero_grad()``: with ``rollback=True`` the reset of the open step
    put back the host state from before its updates over the state just restored, so training went
    on from neither. The restored state supersedes the open step: nothing of it is undone or
    reported, and the optimizer holds the version as a fresh one restored from it does. With
    ``max_grad_norm`` the restore hung: ``model.state_dict()`` waited in ``synchronize`` for the
    updates clipping holds until a ``step()`` that never comes."""
    model, opt = _gpt_host(0, **options)
    ckpt = Checkpointer(tmp_path, model, opt, keep=None)
    for step in (1, 2):
        _gpt_step(model, step)
        opt.step()
        opt.zero_grad()
        ckpt.save(step)
    ckpt.wait()
    _gpt_step(model, 3)  # the step that raised before opt.step()

    def restore() -> None:
        ckpt.restore(1)
        opt.zero_grad()
        opt.synchronize()

    _within(60, restore)
    fresh_model, fresh_opt = _gpt_host(5, **options)
    Checkpointer(tmp_path, fresh_model, fresh_opt).restore(1)
    try:
        assert all(torch.equal(v, fresh_model.state_dict()[k]) for k, v in model.state_dict().items())
        ours, theirs = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[i][f], theirs[i][f]) for i in ours for f in ours[i])
    finally:
        ckpt.close()
        opt.close()
        fresh_opt.close()


@pytest.mark.parametrize("backend", ["cpu", "chaos"])
def test_a_save_between_a_backward_and_a_clipped_step_holds_the_state_before_it(tmp_path: Path, backend: str) -> None:
    """With ``max_grad_norm`` the backward's updates wait for ``step()`` (their EXCHANGE has ended):
    a save between the two (it hung until the gate stopped waiting for them) took the buckets
    lazily, and no stage listener copied them aside before ``step()`` updated them while the writer
    read (held here at its first read): the version held the weights and moments after the step.
    Now those buckets are copied at ``save`` (NOTE [lazy snapshots])."""
    import copy

    model, opt = _gpt_host(0, max_grad_norm=1.0, backend=backend)
    ckpt = Checkpointer(tmp_path, model, opt, keep=None)
    _gpt_step(model, 1)
    opt.step()
    opt.zero_grad()
    _gpt_step(model, 2)
    opt.synchronize()
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()["state"])
    assert opt.held_buckets() == list(range(len(opt.buckets)))
    held, go = threading.Event(), threading.Event()
    ckpt._hook = lambda point: point == "snapshot" and (held.set(), go.wait(20))
    ckpt.save(1)
    assert held.wait(20)
    opt.step()
    opt.synchronize()
    assert opt.held_buckets() == []
    go.set()
    ckpt.wait()
    fresh, fresh_opt = _gpt_host(5, max_grad_norm=1.0, backend=backend)
    try:
        Checkpointer(tmp_path, fresh, fresh_opt).restore(1)
        assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in weights.items())
        theirs = fresh_opt.state_dict()["state"]
        assert all(torch.equal(state[i][f], theirs[i][f]) for i in state for f in state[i])
    finally:
        ckpt.close()
        opt.close()
        fresh_opt.close()


def test_a_host_adamw_of_other_options_loads_nothing(tmp_path: Path) -> None:
    """A version saved by a HostAdamW without ``delayed_update`` restored into one with it: the
    optimizer refused its state only after the model's weights had been loaded, leaving the model
    at the version and the optimizer not. Now nothing is loaded."""
    from ooc.errors import OocError

    model, opt = _gpt_host(0)
    ckpt = Checkpointer(tmp_path, model, opt)
    _gpt_step(model, 1)
    opt.step()
    opt.zero_grad()
    ckpt.save(1)
    ckpt.close()
    opt.close()
    other, other_opt = _gpt_host(7, delayed_update=True)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    try:
        with pytest.raises(OocError, match="delayed_update"):
            Checkpointer(tmp_path, other, other_opt).restore()
        assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    finally:
        other_opt.close()


@pytest.mark.parametrize("rollback", [True, False], ids=["rollback", "no-rollback"])
def test_a_save_between_a_backward_and_a_pipelined_step_is_refused(tmp_path: Path, rollback: bool) -> None:
    """A pipelined HostAdamW starts a step's updates in the backward: a save before ``step()`` (an
    emergency save in a loop's exception handler) wrote a version holding that uncommitted update,
    and with ``rollback=True`` the next ``zero_grad()`` undid it in the optimizer, so a resume went
    on from a state the run never did. Now the save is refused, writing nothing; after
    ``zero_grad()`` resets the step, a save holds the state the optimizer goes on from (NOTE [a
    version holds committed steps])."""
    import contextlib

    from ooc.optim.pipeline import UncommittedStepWarning

    model, opt = _gpt_host(0, rollback=rollback)
    ckpt = Checkpointer(tmp_path, model, opt, keep=None)
    try:
        _gpt_step(model, 1)
        opt.step()
        opt.zero_grad()
        ckpt.save(1)
        ckpt.wait()
        _gpt_step(model, 2)
        assert opt.uncommitted_buckets() == list(range(len(opt.buckets)))
        with pytest.raises(CheckpointError, match="between a backward and step"):
            ckpt.save(2)
        assert _steps(tmp_path) == [1]
        with pytest.warns(UncommittedStepWarning) if not rollback else contextlib.nullcontext():
            opt.zero_grad()  # with rollback: undone, without a word
        assert opt.uncommitted_buckets() == []
        ckpt.save(2)
        ckpt.wait()
        fresh, fresh_opt = _gpt_host(5, rollback=rollback)
        try:
            Checkpointer(tmp_path, fresh, fresh_opt).restore(2)
            assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in model.state_dict().items())
        finally:
            fresh_opt.close()
    finally:
        ckpt.close()
        opt.close()



class _WithExtraState(nn.Linear):
    """A module whose state dict holds a value of its own (``get_extra_state``), as torch allows."""

    def __init__(self) -> None:
        super().__init__(3, 2)
        self.calls = {"n": 0}

    def get_extra_state(self) -> dict:
        return dict(self.calls)

    def set_extra_state(self, state: dict) -> None:
        self.calls = dict(state)


def test_a_modules_extra_state_round_trips(tmp_path: Path) -> None:
    """A module's ``get_extra_state`` puts a non-tensor in ``model.state_dict()``: ``save`` failed
    with "'dict' object has no attribute 'detach'". It is saved in the state file (safetensors holds
    tensors only) and ``restore`` hands it to ``set_extra_state``; the weights file loads without ooc."""
    model = _WithExtraState()
    model.calls["n"] = 7
    ckpt = Checkpointer(tmp_path, model, torch.optim.AdamW(model.parameters()))
    ckpt.save(1)
    ckpt.close()
    other = _WithExtraState()
    Checkpointer(tmp_path, other, torch.optim.AdamW(other.parameters())).restore()
    assert other.calls == {"n": 7} and torch.equal(other.weight, model.weight)
    weights = safetensors.torch.load_file(list_versions(tmp_path)[0].path / MODEL_FILE)
    assert sorted(weights) == ["bias", "weight"]


def test_a_scheduler_of_another_type_loads_nothing(tmp_path: Path) -> None:
    """A version saved with a CosineAnnealingLR restored with a LambdaLR (a run resumed with another
    schedule): the scheduler's ``load_state_dict`` raised ``KeyError: 'lr_lambdas'`` after the model
    and the optimizer had been loaded, leaving them at the version and the rest not. The scheduler
    is loaded first now, and its refusal is a ``CheckpointError`` that names it."""
    from torch.optim import lr_scheduler

    model = _linear()
    opt = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(tmp_path, model, opt, scheduler=lr_scheduler.CosineAnnealingLR(opt, 10))
    ckpt.save(1)
    ckpt.close()
    other = _linear(seed=1)
    other_opt = torch.optim.AdamW(other.parameters())
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match="LambdaLR"):
        Checkpointer(tmp_path, other, other_opt, scheduler=lr_scheduler.LambdaLR(other_opt, lambda step: 1.0)).restore()
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    assert other_opt.state_dict()["state"] == {}


def test_an_optimizer_of_other_parameters_is_named_in_the_refusal(tmp_path: Path) -> None:
    """An optimizer built over the parameters in another order (or other ones of as many) was
    refused "(saved 2, now 2)", which tells nothing; the refusal names the first that differs."""
    model = _linear()
    ckpt = Checkpointer(tmp_path, model, torch.optim.AdamW(model.parameters()))
    ckpt.save(1)
    ckpt.close()
    other = _linear(seed=1)
    with pytest.raises(CheckpointError, match=r"'weight' saved, 'bias' now"):
        Checkpointer(tmp_path, other, torch.optim.AdamW([other.bias, other.weight])).restore()


def test_export_into_a_directory_writes_its_model_file_and_a_failure_leaves_no_copy(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """``export(step, "hf_dir")`` (a directory, as ``save_pretrained`` takes) failed with
    ``IsADirectoryError`` after writing the whole weights file beside it as ``.hf_dir.tmp``, which
    stayed. A directory now gets ``model.safetensors`` inside it (what HF's loaders read), and an
    export that fails removes its temporary file."""
    model = _linear()
    ckpt = Checkpointer(tmp_path / "ck", model)
    ckpt.save(1)
    ckpt.close()
    out = tmp_path / "hf_dir"
    out.mkdir()
    assert ckpt.export(1, out) == out / MODEL_FILE
    assert torch.equal(safetensors.torch.load_file(out / MODEL_FILE)["weight"], model.weight)

    def replace(src: object, dst: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="Read-only"):
        ckpt.export(1, tmp_path / "w.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf_dir"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_export_of_a_delayed_update_version_holds_the_newest_weights(tmp_path: Path, dtype: torch.dtype) -> None:
    """With ``delayed_update`` a version's ``model.safetensors`` holds the parameters one update
    behind the masters, as the delayed schedule has them (a restore needs them so: the masters go in
    at the next step's launch). ``export()`` wrote those, so the weights shipped lacked the last
    update; it now writes the masters (in the parameters' dtype, tied names alike: NOTE [a delayed
    version's newest weights]), and the version's own files stay as saved."""
    from ooc.optim import HostAdamW

    model, unused = _gpt_host(0)
    unused.close()  # one HostAdamW per model: this one's, built before the cast, is not used
    model.to(dtype)
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model, delayed_update=True)
    ckpt = Checkpointer(tmp_path / "ck", model, opt)
    try:
        for step in range(2):
            _gpt_step(model, step)
            opt.step()
            opt.zero_grad()
        ckpt.save(1)
        ckpt.wait()
        newest = {n: opt.state[p]["master"].to(dtype) for n, p in model.named_parameters(remove_duplicate=False)
                  if "master" in opt.state[p]}
        assert len(newest) == len(dict(model.named_parameters(remove_duplicate=False)))
        saved = safetensors.torch.load_file(ckpt.latest().path / MODEL_FILE)
        assert not all(torch.equal(saved[n], t) for n, t in newest.items())  # the version keeps the lag
        exported = safetensors.torch.load_file(ckpt.export(1, tmp_path / "w.safetensors"))
        assert exported.keys() == saved.keys()
        for name, t in exported.items():
            assert t.dtype == saved[name].dtype, name
            assert torch.equal(t, newest[name] if name in newest else saved[name]), name
        assert safetensors.torch.load_file(ckpt.latest().path / MODEL_FILE).keys() == saved.keys()
    finally:
        ckpt.close()
        opt.close()


def test_synchronize_save_and_export_mid_training_leave_the_delayed_schedule_alone(tmp_path: Path) -> None:
    """``delayed_update``: ``synchronize()``, a save and an export of the newest weights after a step
    must not put that step's update into the parameters (the next forward runs on the older weights):
    the run goes on bit for bit as one that never called them (NOTE [the last delayed update at the
    end] in ooc.optim.pipeline)."""
    runs = []
    for calls in (False, True):
        model, opt = _gpt_host(0, delayed_update=True)
        ckpt = Checkpointer(tmp_path / f"ck{calls}", model, opt)
        losses = []
        try:
            for step in range(4):
                x = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))
                loss = model(x, x)[1]
                loss.backward()
                losses.append(loss.item())
                opt.step()
                opt.zero_grad()
                if calls and step == 1:
                    opt.synchronize()
                    ckpt.save(step)
                    ckpt.wait()
                    ckpt.export(step, tmp_path / "w.safetensors")
            opt.synchronize()
            masters = [opt.state[p]["master"].clone() for p in model.parameters()]
            runs.append((losses, [p.detach().clone() for p in model.parameters()], masters))
        finally:
            ckpt.close()
            opt.close()
    (losses, params, masters), (expected, plain_params, plain_masters) = runs
    assert losses == expected
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
    assert all(torch.equal(a, b) for a, b in zip(masters, plain_masters))


def test_arguments_in_the_wrong_order_or_a_file_for_the_directory_are_refused_at_once(tmp_path: Path) -> None:
    """``Checkpointer(d, opt, model)``, ``Checkpointer(d, model, model)`` or a scheduler passed as the
    optimizer were taken, and the first ``save`` (a training step later) raised an AttributeError
    ("'AdamW' object has no attribute 'named_parameters'"); a directory that is a file, a bare
    FileExistsError there. Each is refused where it is made, naming the expected order."""
    model = _linear()
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    for args, kwargs, message in (
        ((opt, model), {}, r"model must be an nn.Module, got AdamW: the order is Checkpointer\(directory, model, optimizer"),
        (("model", opt), {}, "model must be an nn.Module, got str"),
        ((model, model), {}, "optimizer must be a torch optimizer .* got Linear"),
        ((model, sched), {}, "optimizer must be a torch optimizer .* got StepLR"),
        ((model, opt), {"scheduler": opt}, "scheduler must be an LR scheduler .* got AdamW"),
    ):
        with pytest.raises(TypeError, match=message):
            Checkpointer(tmp_path / "ckpt", *args, **kwargs)
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        Checkpointer(afile, model, opt)
    ckpt = Checkpointer(tmp_path / "ckpt", model, opt, scheduler=sched)  # the right order still works
    ckpt.save(0)
    ckpt.close()
    assert _steps(tmp_path / "ckpt") == [0]


def test_a_version_of_the_same_optimizer_class_saved_before_it_gained_a_hyperparameter_restores(tmp_path: Path) -> None:
    """NOTE [an optimizer of another kind]: a version saved by an older torch lacks the hyperparameters
    the class gained since (Adam's ``decoupled_weight_decay``, SGD's ``fused``), which its own
    ``load_state_dict`` fills in; the refusal took it for another kind of optimizer."""
    model = _linear()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    ckpt = Checkpointer(tmp_path, model, opt)
    ckpt.save(1)
    ckpt.close()
    other = _linear(seed=1)
    newer = torch.optim.AdamW(other.parameters())
    newer.defaults["gained_since"] = False  # this torch's AdamW has a hyperparameter the saver's had not
    Checkpointer(tmp_path, other, newer).restore()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
