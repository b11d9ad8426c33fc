"""``ooc train --save/--save-every/--resume auto`` and ``ooc checkpoints list``, including runs killed
with SIGKILL at random moments: every resume continues exactly as the run that was never stopped."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from ooc.checkpoint import list_versions

STEPS = 6
COMMON = ["--preset", "nano", "--batch-size", "2", "--seq", "16", "--plan", "keep", "--no-progress"]


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ooc", "train", *COMMON, *args]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _final_weights(directory: Path) -> dict[str, torch.Tensor]:
    latest = list_versions(directory)[-1]
    return safetensors.torch.load_file(latest.path / "model.safetensors")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[float]]:  # noqa: ANN001
    root = tmp_path_factory.mktemp("ref")
    _run(_cmd("--steps", str(STEPS), "--save", "ckpt", "--out", "ref.json"), root)
    result = json.loads((root / "ref.json").read_text())
    assert result["start_step"] == 0 and len(result["losses"]) == STEPS
    return root / "ckpt", result["losses"]


def _check_resumed(directory: Path, out: Path, start: int, reference: tuple[Path, list[float]]) -> None:
    result = json.loads(out.read_text())
    ref_dir, ref_losses = reference
    assert result["start_step"] == start
    assert result["losses"] == ref_losses[start:]
    ours, theirs = _final_weights(directory), _final_weights(ref_dir)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_half_then_resume_auto_matches_the_full_run(tmp_path: Path, reference) -> None:  # noqa: ANN001
    half = STEPS // 2
    _run(_cmd("--steps", str(half), "--save", "ckpt", "--save-every", "2", "--keep", "2"), tmp_path)
    assert [v.step for v in list_versions(tmp_path / "ckpt")] == [2, 3]
    _run(_cmd("--steps", str(STEPS - half), "--save", "ckpt", "--resume", "auto", "--out", "rest.json"), tmp_path)
    _check_resumed(tmp_path / "ckpt", tmp_path / "rest.json", half, reference)
    listed = subprocess.run([sys.executable, "-m", "ooc", "checkpoints", "list", "ckpt"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert [line.split()[1] for line in lines] == ["2", "3", str(STEPS)]  # --keep 3 (the default)
    assert '"loss"' in lines[-1]


def test_resume_auto_without_a_version_starts_fresh(tmp_path: Path, reference) -> None:  # noqa: ANN001
    _run(_cmd("--steps", str(STEPS), "--save", "ckpt", "--resume", "auto", "--out", "all.json"), tmp_path)
    _check_resumed(tmp_path / "ckpt", tmp_path / "all.json", 0, reference)


def _kill_trials(tmp_path: Path, reference, trials: int, seed: int) -> None:  # noqa: ANN001
    rng = random.Random(seed)
    for trial in range(trials):
        root = tmp_path / f"trial{trial}"
        root.mkdir()
        proc = subprocess.Popen(_cmd("--steps", str(STEPS), "--save", "ckpt", "--save-every", "1", "--keep", "2"),
                                cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        at_line = rng.randrange(STEPS)  # kill after this many step lines, then a random fraction of a step
        for _ in range(at_line):
            if not proc.stdout.readline():
                break
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        found = list_versions(root / "ckpt")
        start = found[-1].step if found else 0  # the resume checks every file of this version's checksums
        if start == STEPS:  # killed after its last save: the run is complete, its weights the reference's
            ours, theirs = _final_weights(root / "ckpt"), _final_weights(reference[0])
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
            continue
        _run(_cmd("--steps", str(STEPS - start), "--save", "ckpt", "--save-every", "1", "--keep", "2",
                  "--resume", "auto", "--out", "rest.json"), root)
        _check_resumed(root / "ckpt", root / "rest.json", start, reference)


def test_kill_9_then_resume_is_exact(tmp_path: Path, reference) -> None:  # noqa: ANN001
    _kill_trials(tmp_path, reference, trials=3, seed=0)


@pytest.mark.slow
def test_kill_9_then_resume_is_exact_many(tmp_path: Path, reference) -> None:  # noqa: ANN001
    _kill_trials(tmp_path, reference, trials=20, seed=1)
