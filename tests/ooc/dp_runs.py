"""Data-parallel runs of ``ooc train`` over gloo for tests/ooc/test_distributed*.py: the command,
two ranks or one process, their losses and weights. The runs are split over three test files (the
base runs, and two halves of the option variants), each computing only the runs its tests read, so
that the slow lane's two workers share them (one file's runs took half the lane before).

Every rank runs one thread (as torchrun sets it), and so does the single-process reference, so
both compute each micro-batch's gradient with the same kernels. Two ranks then sum the same two
gradients a single process accumulates, and halve the sum exactly (a power of two): the weights
must be equal bit for bit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

STEPS = 20
COMMON = ["--preset", "nano", "--steps", str(STEPS), "--batch-size", "4", "--seq", "32", "--no-progress",
          "--plan", "swap"]


VARIANTS = {  # name: (options of every run, micro-batches per step of the one-process reference)
    "clip": (["--max-grad-norm", "0.05"], 2),  # small enough that every step clips
    "bf16": (["--dtype", "bfloat16"], 2),
    "device-sum": (["--reduce-on", "device"], 2),
    "delayed": (["--delayed-update"], 2),
    "small-on-device": (["--device-params-below", "1000"], 2),
    "clip-small-on-device": (["--max-grad-norm", "0.05", "--device-params-below", "1000"], 2),  # their norms count
    "in-step": (["--no-pipeline"], 2),
    "accumulate": (["--accumulate", "2"], 4),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(rank: int | None, world: int, port: int) -> dict[str, str]:
    # The ranks check stream order (the exchange thread's gather of own-master gradients is a blocking
    # copy: NOTE [a blocking torch copy waits for compute] in ooc.backend.order); the one-process
    # references, which exchange nothing, do not: the checker's Python call per op costs them time only.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OOC_CHECK_ORDER": "0"}
    if rank is not None:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OOC_CHECK_ORDER="1")
    return env


def start(args_per_rank: list[list[str]], cwd: Path) -> list[subprocess.Popen]:
    port = free_port()
    world = len(args_per_rank)
    return [
        subprocess.Popen([sys.executable, "-m", "ooc", "train", *args], cwd=cwd, env=env_for(rank, world, port),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank, args in enumerate(args_per_rank)
    ]


def run_ranks(args_per_rank: list[list[str]], cwd: Path, timeout: float = 240) -> list[str]:
    procs = start(args_per_rank, cwd)
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"rank failed ({proc.returncode}):\n{out}\n{err}"
        outputs.append(out + err)
    return outputs


def single(args: list[str], cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "ooc", "train", *args], cwd=cwd, env=env_for(None, 1, 0),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def version(directory: Path) -> Path:
    """The newest complete version's folder in an ``ooc train --save`` directory."""
    from ooc.checkpoint import list_versions

    return list_versions(directory)[-1].path


def weights_of(directory: Path) -> dict[str, torch.Tensor]:
    import safetensors.torch

    return safetensors.torch.load_file(version(directory) / "model.safetensors")


def losses_of(path: Path) -> list[float]:
    import json

    return json.loads(path.read_text())["losses"]




def variant_runs(root: Path, names: list[str]) -> None:
    """For each option variant: two ranks, two sharded ranks, and one process accumulating their
    micro-batches; and the plain one-process run (``one``) the variants are told apart from."""
    single(COMMON + ["--accumulate", "2", "--out", "one.json", "--save", "one"], root)
    both = lambda extra: [COMMON + extra, COMMON + extra]  # noqa: E731
    for name in names:
        extra, micro = VARIANTS[name]
        run_ranks(both([*extra, "--out", f"{name}.json", "--save", name]), root)
        run_ranks(both([*extra, "--shard", "--out", f"{name}-sharded.json", "--save", f"{name}-sharded"]), root)
        single(COMMON + [*extra, "--accumulate", str(micro), "--out", f"{name}-one.json", "--save", f"{name}-one"], root)


def assert_variant_equals_one_process(runs: Path, variant: str) -> None:
    """Two ranks and two sharded ranks under ``variant``'s options equal one process accumulating their
    micro-batches, bit for bit; and the option changed the run where it should (``variant_runs``)."""
    reference = losses_of(runs / f"{variant}-one.json")
    assert losses_of(runs / f"{variant}.json") == reference
    assert losses_of(runs / f"{variant}-sharded.json") == reference
    one = weights_of(runs / f"{variant}-one")
    for name in (variant, f"{variant}-sharded"):
        two = weights_of(runs / name)
        assert all(torch.equal(two[k], one[k]) for k in one)
    if variant == "device-sum":  # where the sum happens changes nothing in the numbers
        assert reference == losses_of(runs / "one.json")
    elif variant in ("small-on-device", "in-step"):  # nor which optimizer or when (the same fused kernel)
        assert reference == losses_of(runs / "one.json")
    else:  # the option really changed the run
        assert reference != losses_of(runs / "one.json")
