"""``ooc train --save/--save-every/--resume auto`` and ``ooc checkpoints list``, including runs killed
with SIGKILL at random moments, on one rank and on two: every resume continues exactly as the run that
was never stopped (the runs and trials: tests/ooc/train_runs.py; twenty two-rank trials:
test_checkpoint_kill_many.py, a file of their own so that the slow lane's two workers share the
trials)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ooc.checkpoint import list_versions
from tests.ooc.train_runs import (
    STEPS,
    check_resumed,
    kill_trials,
    reference_run,
    reference_two_run,
    run,
    train_cmd,
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[float]]:  # noqa: ANN001
    return reference_run(tmp_path_factory.mktemp("ref"))


@pytest.fixture(scope="module")
def reference_two(tmp_path_factory) -> tuple[Path, list[float]]:  # noqa: ANN001
    return reference_two_run(tmp_path_factory.mktemp("ref2"))


def test_half_then_resume_auto_matches_the_full_run(tmp_path: Path, reference) -> None:  # noqa: ANN001
    half = STEPS // 2
    run(train_cmd("--steps", str(half), "--save", "ckpt", "--save-every", "2", "--keep", "2"), tmp_path)
    assert [v.step for v in list_versions(tmp_path / "ckpt")] == [2, 3]
    run(train_cmd("--steps", str(STEPS - half), "--save", "ckpt", "--resume", "auto", "--out", "rest.json"), tmp_path)
    check_resumed(tmp_path / "ckpt", tmp_path / "rest.json", half, reference)
    listed = subprocess.run([sys.executable, "-m", "ooc", "checkpoints", "list", "ckpt"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert [line.split()[1] for line in lines] == ["2", "3", str(STEPS)]  # --keep 3 (the default)
    assert '"loss"' in lines[-1]


def test_resume_auto_without_a_version_starts_fresh(tmp_path: Path, reference) -> None:  # noqa: ANN001
    run(train_cmd("--steps", str(STEPS), "--save", "ckpt", "--resume", "auto", "--out", "all.json"), tmp_path)
    check_resumed(tmp_path / "ckpt", tmp_path / "all.json", 0, reference)


def test_resume_auto_with_only_a_damaged_version_says_so(tmp_path: Path) -> None:
    """NOTE [damaged records] in ooc.checkpoint: ``--resume auto`` on a directory whose one version
    has a damaged commit record started afresh without a word (the version was not listed), and
    the run then failed at that version's step ('already committed'). It now stops at the start,
    naming the record."""
    run(train_cmd("--steps", "1", "--save", "ckpt"), tmp_path)
    record = tmp_path / "ckpt" / "step-000000001" / "manifest-rank0.json"
    record.write_bytes(record.read_bytes()[:-1])
    done = subprocess.run(train_cmd("--steps", "1", "--save", "ckpt", "--resume", "auto"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "manifest-rank0.json" in done.stderr, done.stderr[-3000:]


def test_checkpoints_list_shows_a_damaged_version(tmp_path: Path) -> None:
    """A version whose commit record is damaged is no complete version, but not a crash's leftover
    either (NOTE [damaged records]): the list, which left it out, names it and why."""
    from ooc.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path / "ckpt", torch.nn.Linear(2, 2))
    for step in (1, 2):
        ckpt.save(step)
    ckpt.close()
    record = tmp_path / "ckpt" / "step-000000002" / "manifest-rank0.json"
    record.write_bytes(b"")
    listed = subprocess.run([sys.executable, "-m", "ooc", "checkpoints", "list", "ckpt"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert len(lines) == 2 and lines[0].split()[:2] == ["step", "1"]
    assert lines[1].split()[:3] == ["step", "2", "DAMAGED"] and "manifest-rank0.json" in lines[1]


def test_checkpoints_list_shows_a_version_moved_aside(tmp_path: Path) -> None:
    """A damaged version a save moved out of the way (NOTE [damaged versions moved aside]) is kept for
    its owner, under a name no listing reads: the list, which left it out, names it."""
    import warnings

    from ooc.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path / "ckpt", torch.nn.Linear(2, 2))
    for step in (1, 2):
        ckpt.save(step)
    ckpt.close()
    (tmp_path / "ckpt" / "step-000000002" / "manifest-rank0.json").write_bytes(b"")
    ckpt = Checkpointer(tmp_path / "ckpt", torch.nn.Linear(2, 2))
    assert ckpt.restore(fallback=True).step == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the move's own warning
        ckpt.save(2)
    ckpt.close()
    listed = subprocess.run([sys.executable, "-m", "ooc", "checkpoints", "list", "ckpt"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:2]] == [["step", "1"], ["step", "2"]]
    assert len(lines) == 3 and lines[2].startswith("moved aside  step-000000002.damaged-"), lines


def test_resume_from_an_older_version_into_newer_ones_says_so_before_training(tmp_path: Path) -> None:
    """``--resume OLD --save DIR`` where DIR holds newer versions than OLD's: the run trained, then
    its first version was retired at once by retention (or, kept, never resumed from), without a
    word (NOTE [saves go forward] in ooc.checkpoint). It now stops before training, saying how to
    branch."""
    import shutil

    run(train_cmd("--steps", "3", "--save", "ckpt", "--save-every", "1"), tmp_path)
    shutil.copytree(tmp_path / "ckpt" / "step-000000001", tmp_path / "old" / "step-000000001")
    done = subprocess.run(train_cmd("--steps", "1", "--save", "ckpt", "--resume", "old"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0, done.stdout[-3000:]
    assert "step 2 is below the newest version (step 3)" in done.stderr and "--save NEW_DIR" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "loss" not in done.stdout
    assert [v.step for v in list_versions(tmp_path / "ckpt")] == [1, 2, 3]


@pytest.mark.parametrize("damage", ["file", "record"])
def test_resume_auto_onto_a_damaged_newest_version_continues_from_the_one_before(tmp_path: Path, reference,  # noqa: ANN001
                                                                               damage: str) -> None:
    """The newest version's model file (or commit record) is damaged: ``--resume auto`` stopped before
    training, saying to move the folder out of the directory and run again, which then resumed from
    the version before it (a requeued job failed until someone did). It now does that itself (NOTE
    [resume auto falls back past damaged versions] in ooc.apps.train): it says which version it
    skipped, continues from the one before exactly as the run that never stopped, and its first
    save moves the damaged folder aside, kept. ``--resume DIR`` from another directory still stops."""
    run(train_cmd("--steps", "3", "--save", "ckpt", "--save-every", "1"), tmp_path)
    damaged = tmp_path / "ckpt" / "step-000000003"
    if damage == "record":
        (damaged / "manifest-rank0.json").write_text("{")
    else:
        data = bytearray((damaged / "model.safetensors").read_bytes())
        data[-1] ^= 0x01
        (damaged / "model.safetensors").write_bytes(bytes(data))
    done = subprocess.run(train_cmd("--steps", "1", "--save", "other", "--resume", "ckpt"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "newest version is damaged" in done.stderr and "Move its folder out of ckpt" in done.stderr, done.stderr
    resumed = run(train_cmd("--steps", str(STEPS - 2), "--save", "ckpt", "--save-every", "1", "--resume", "auto",
                        "--out", "rest.json"), tmp_path).stdout
    assert "--resume auto: ckpt/step-000000003 is damaged" in resumed and "moves the damaged versions" in resumed
    assert "resumed from ckpt/step-000000002 (step 2)" in resumed
    check_resumed(tmp_path / "ckpt", tmp_path / "rest.json", 2, reference)
    assert [v.step for v in list_versions(tmp_path / "ckpt")] == [4, 5, 6]
    aside = [p.name for p in (tmp_path / "ckpt").iterdir() if ".damaged-" in p.name]
    assert len(aside) == 1 and aside[0].startswith("step-000000003.damaged-"), aside


def test_resume_auto_onto_only_damaged_versions_stops_naming_them(tmp_path: Path) -> None:
    """Every version damaged: ``--resume auto`` does not start afresh (it would throw the run away),
    it stops before training, naming each one, and moves nothing."""
    run(train_cmd("--steps", "2", "--save", "ckpt", "--save-every", "1"), tmp_path)
    for step in (1, 2):
        model = tmp_path / "ckpt" / f"step-00000000{step}" / "model.safetensors"
        model.write_bytes(model.read_bytes()[:-1])
    done = subprocess.run(train_cmd("--steps", "1", "--save", "ckpt", "--resume", "auto"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "no version there is intact" in done.stderr and "step-000000001/model.safetensors" in done.stderr
    assert "step-000000002/model.safetensors" in done.stderr and "restore(" not in done.stderr, done.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000000001", "step-000000002"]


def test_kill_9_then_resume_is_exact(tmp_path: Path, reference) -> None:  # noqa: ANN001
    kill_trials(tmp_path, reference, trials=3, seed=0)


def test_kill_9_of_two_ranks_then_resume_is_exact(tmp_path: Path, reference_two) -> None:  # noqa: ANN001
    kill_trials(tmp_path, reference_two, trials=1, seed=0, world=2)


@pytest.mark.slow
def test_kill_9_then_resume_is_exact_many(tmp_path: Path, reference) -> None:  # noqa: ANN001
    kill_trials(tmp_path, reference, trials=20, seed=1)
