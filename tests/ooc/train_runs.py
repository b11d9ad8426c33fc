"""Runs of ``ooc train`` for the checkpoint tests (tests/ooc/test_checkpoint_cli.py and
test_checkpoint_kill_many.py): the command, one rank or several (gloo), the reference runs a resume
must equal, and the kill-9 trials. Two ranks (gloo, one thread each, as in
tests/ooc/test_distributed.py) train on the micro-batches one process accumulating two of them trains
on, with the same gradients bit for bit: that process's run is the two-rank runs' reference."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import safetensors.torch
import torch

from ooc.checkpoint import list_versions

STEPS = 6
COMMON = ["--preset", "nano", "--batch-size", "2", "--seq", "16", "--plan", "keep", "--no-progress"]


def train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ooc", "train", *COMMON, *args]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(args: list[str], cwd: Path, world: int) -> list[subprocess.Popen]:
    """``ooc train args`` on ``world`` ranks (one: a plain process); rank 0's stdout is piped (it
    prints the step lines)."""
    port = free_port()
    procs = []
    for rank in range(world):
        # The ranks check stream order, as test_distributed's.
        env = dict(os.environ) if world == 1 else {
            **os.environ, "OMP_NUM_THREADS": "1", "OOC_CHECK_ORDER": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen(args, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                      stderr=subprocess.PIPE))
    return procs


def run_ranks(args: list[str], cwd: Path, world: int) -> None:
    procs = start_ranks(args, cwd, world)
    for rank, proc in enumerate(procs):
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"rank {rank}: {err[-3000:]}"


def final_weights(directory: Path) -> dict[str, torch.Tensor]:
    latest = list_versions(directory)[-1]
    return safetensors.torch.load_file(latest.path / "model.safetensors")

def reference_run(root: Path) -> tuple[Path, list[float]]:
    """The run every one-rank resume must equal: ``STEPS`` steps in one go, saved at the end. Returns
    its checkpoint directory and losses."""
    run(train_cmd("--steps", str(STEPS), "--save", "ckpt", "--out", "ref.json"), root)
    result = json.loads((root / "ref.json").read_text())
    assert result["start_step"] == 0 and len(result["losses"]) == STEPS
    return root / "ckpt", result["losses"]


def reference_two_run(root: Path) -> tuple[Path, list[float]]:
    """What two ranks compute: one process on one thread accumulating both ranks' micro-batches."""
    done = subprocess.run(train_cmd("--steps", str(STEPS), "--accumulate", "2", "--save", "ckpt", "--out", "ref.json"),
                          cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "ckpt", json.loads((root / "ref.json").read_text())["losses"]


def check_resumed(directory: Path, out: Path, start: int, reference: tuple[Path, list[float]]) -> None:
    result = json.loads(out.read_text())
    ref_dir, ref_losses = reference
    assert result["start_step"] == start
    assert result["losses"] == ref_losses[start:]
    ours, theirs = final_weights(directory), final_weights(ref_dir)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)



def kill_trials(tmp_path: Path, reference, trials: int, seed: int, world: int = 1) -> None:  # noqa: ANN001
    """Each trial: a run saving every step, killed with SIGKILL after a random number of steps and a
    random fraction of one, resumed from its newest complete version. With two ranks the victim is
    rank 0, rank 1 or both (a lost rank makes the other exit within --timeout), and the killed and
    the resumed runs each shard the optimizer state or not, at random (the sharded and unsharded
    runs are equal bit for bit, test_distributed)."""
    rng = random.Random(seed)
    save = ["--save", "ckpt", "--save-every", "1", "--keep", "2"]
    for trial in range(trials):
        root = tmp_path / f"trial{trial}"
        root.mkdir()
        shard = ["--shard"] if world > 1 and rng.random() < 0.5 else []
        # A short --timeout: the survivor of a lost rank exits soon (one that times out early on a busy
        # machine only stops the doomed run sooner).
        procs = start_ranks(train_cmd("--steps", str(STEPS), *save, *shard, "--timeout", "5"), root, world)
        victims = [procs[0]] if world == 1 else rng.choice([[procs[0]], [procs[1]], procs])
        at_line = rng.randrange(STEPS)  # kill after this many step lines, then a random fraction of a step
        for _ in range(at_line):
            if not procs[0].stdout.readline():
                break
        time.sleep(rng.uniform(0.0, 0.15))
        for proc in victims:
            os.kill(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.communicate(timeout=120)  # the survivor, if any, fails its next collective and exits
        found = list_versions(root / "ckpt")
        start = found[-1].step if found else 0  # the resume checks every file of this version's checksums
        if start == STEPS:  # killed after its last save: the run is complete, its weights the reference's
            ours, theirs = final_weights(root / "ckpt"), final_weights(reference[0])
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
            continue
        shard = ["--shard"] if world > 1 and rng.random() < 0.5 else []
        run_ranks(train_cmd("--steps", str(STEPS - start), *save, *shard, "--resume", "auto", "--out", "rest.json"), root, world)
        check_resumed(root / "ckpt", root / "rest.json", start, reference)
