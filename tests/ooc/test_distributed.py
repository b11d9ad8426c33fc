"""Data-parallel training over gloo with two ranks on this CPU, through ``ooc train``.

Every rank runs one thread (as torchrun sets it), and so does the single-process reference, so
both compute each micro-batch's gradient with the same kernels. Two ranks then sum the same two
gradients a single process accumulates, and halve the sum exactly (a power of two): the weights
must be equal bit for bit. Training on the concatenated batch in one backward reduces in another
order; there the test states its tolerance.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.ooc.dp_runs import COMMON, STEPS, free_port, losses_of, run_ranks, single, start, version, weights_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runs of this file's tests (the option variants' are in test_distributed_variants_*.py)."""
    root = tmp_path_factory.mktemp("dp")
    both = lambda extra: [COMMON + extra, COMMON + extra]  # noqa: E731
    run_ranks(both(["--out", "two.json", "--save", "two"]), root)
    run_ranks(both(["--shard", "--out", "sharded.json", "--save", "sharded"]), root)
    half = ["--steps", str(STEPS // 2)]
    run_ranks(both(["--shard", *half, "--save", "first-half"]), root)
    run_ranks(both(["--shard", *half, "--resume", "first-half", "--out", "resumed.json", "--save", "resumed"]), root)
    single(COMMON + ["--accumulate", "2", "--out", "one.json", "--save", "one"], root)
    single(COMMON + ["--accumulate", "2", "--dropout", "0", "--out", "one-nodrop.json", "--save", "one-nodrop"], root)
    single(COMMON + ["--batch-size", "8", "--dropout", "0", "--out", "concat.json", "--save", "concat"], root)
    return root


def test_two_ranks_equal_one_process_accumulating_the_same_micro_batches(runs: Path) -> None:
    assert losses_of(runs / "two.json") == losses_of(runs / "one.json")
    two, one = weights_of(runs / "two"), weights_of(runs / "one")
    assert all(torch.equal(two[k], one[k]) for k in one)


def test_one_process_on_the_concatenated_batch_within_fp32_reduction_tolerance(runs: Path) -> None:
    """One backward over 8 sequences sums per-sequence terms in another order than two backwards
    over 4, so gradients differ by fp32 rounding. The losses of 20 steps agree to 1e-5 relative
    (observed 1.5e-7). Adam divides each gradient by its running RMS, so where a gradient is near
    zero a rounding difference can move that weight by a good part of one step (at most about
    lr = 3e-3); the weights agree to 1e-3 absolute (observed: 86% of them differ in some bit, the
    worst by 8.2e-5)."""
    concat, split = weights_of(runs / "concat"), weights_of(runs / "one-nodrop")
    assert max(float((concat[k] - split[k]).abs().max()) for k in concat) < 1e-3
    losses, reference = losses_of(runs / "concat.json"), losses_of(runs / "one-nodrop.json")
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) < 1e-5


def test_sharded_equals_unsharded(runs: Path) -> None:
    assert losses_of(runs / "sharded.json") == losses_of(runs / "two.json")
    sharded, two = weights_of(runs / "sharded"), weights_of(runs / "two")
    assert all(torch.equal(sharded[k], two[k]) for k in two)


def test_sharded_state_is_split_across_ranks(runs: Path) -> None:
    import safetensors.torch

    states = [safetensors.torch.load_file(version(runs / "sharded") / f"optimizer-rank{r}.safetensors") for r in range(2)]
    full = safetensors.torch.load_file(version(runs / "two") / "optimizer-rank0.safetensors")
    numel = lambda state: sum(v.numel() for k, v in state.items() if k.endswith(".exp_avg"))  # noqa: E731
    assert set(states[0]).isdisjoint(states[1]) and set(states[0]) | set(states[1]) == set(full)
    assert max(numel(s) for s in states) < 0.6 * numel(full)  # each rank holds about half


def test_resume_from_a_checkpoint_continues_identically(runs: Path) -> None:
    assert losses_of(runs / "resumed.json") == losses_of(runs / "sharded.json")[STEPS // 2:]
    resumed, straight = weights_of(runs / "resumed"), weights_of(runs / "sharded")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_a_sharded_checkpoint_resumes_on_one_process(runs: Path) -> None:
    """Two sharded ranks' version, resumed by one process accumulating both ranks' micro-batches:
    it reads both ranks' optimizer shares and goes on exactly as the two ranks did."""
    single([*COMMON, "--steps", str(STEPS // 2), "--accumulate", "2", "--resume", str(runs / "first-half"),
             "--out", "one-resumed.json", "--save", "one-resumed"], runs)
    assert losses_of(runs / "one-resumed.json") == losses_of(runs / "sharded.json")[STEPS // 2:]
    resumed, straight = weights_of(runs / "one-resumed"), weights_of(runs / "sharded")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_lost_rank_makes_the_survivor_exit_within_the_timeout(tmp_path: Path, how: signal.Signals) -> None:
    timeout = 10
    args = ["--preset", "nano", "--steps", "100000", "--no-progress", "--timeout", str(timeout)]
    procs = start([args, args], tmp_path)
    try:
        survivor, victim = procs
        line = ""
        while "step     3" not in line:
            line = survivor.stdout.readline()
            assert line or survivor.poll() is None, survivor.stderr.read()
        victim.send_signal(how)
        lost_at = time.monotonic()
        _, err = survivor.communicate(timeout=timeout + 50)
        elapsed = time.monotonic() - lost_at
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert survivor.returncode != 0
    assert elapsed < timeout + 5
    assert "rank 0 lost the other ranks" in err


@pytest.mark.parametrize("rank1, topic", [
    (["--dtype", "bfloat16"], "parameter dtypes"),
    (["--plan", "keep"], "plan"),
    (["--preset", "tiny"], "parameter names and shapes"),
    (["--lr", "0.1"], "optimizer options"),
], ids=["dtype", "plan", "model", "options"])
def test_mismatched_ranks_fail_at_start_up(tmp_path: Path, rank1: list[str], topic: str) -> None:
    base = ["--preset", "nano", "--steps", "3", "--no-progress", "--plan", "swap"]
    procs = start([base, [*base, *rank1]], tmp_path)
    errors = []
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0
        errors.append(err)
    assert all(f"rank 1 differs from rank 0 in: {topic}" in err for err in errors), errors


@pytest.mark.parametrize("launch", [
    ["--standalone", "--nproc_per_node=2"],
    ["--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:{port}"],
], ids=["standalone", "rendezvous"])
def test_torchrun_launches_it(tmp_path: Path, launch: list[str]) -> None:
    """The README's commands, as a user runs them (the multi-node form with one node here)."""
    launch = [arg.format(port=free_port()) for arg in launch]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "ooc", "train",
         "--preset", "nano", "--steps", "3", "--no-progress"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240, env={**os.environ, "OOC_CHECK_ORDER": "1"},  # as _env's ranks
    )
    assert done.returncode == 0, done.stderr
    assert "on 2 rank(s)" in done.stdout and "step     2" in done.stdout
