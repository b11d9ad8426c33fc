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
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int | None, world: int, port: int) -> dict[str, str]:
    # The ranks check stream order (the exchange thread's gather of own-master gradients is a blocking
    # copy: NOTE [a blocking torch copy waits for compute] in ooc.backend.order); the one-process
    # references, which exchange nothing, do not: the checker's Python call per op costs them time only.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OOC_CHECK_ORDER": "0"}
    if rank is not None:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OOC_CHECK_ORDER="1")
    return env


def _start(args_per_rank: list[list[str]], cwd: Path) -> list[subprocess.Popen]:
    port = _free_port()
    world = len(args_per_rank)
    return [
        subprocess.Popen([sys.executable, "-m", "ooc", "train", *args], cwd=cwd, env=_env(rank, world, port),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank, args in enumerate(args_per_rank)
    ]


def _run(args_per_rank: list[list[str]], cwd: Path, timeout: float = 240) -> list[str]:
    procs = _start(args_per_rank, cwd)
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"rank failed ({proc.returncode}):\n{out}\n{err}"
        outputs.append(out + err)
    return outputs


def _single(args: list[str], cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "ooc", "train", *args], cwd=cwd, env=_env(None, 1, 0),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _version(directory: Path) -> Path:
    """The newest complete version's folder in an ``ooc train --save`` directory."""
    from ooc.checkpoint import list_versions

    return list_versions(directory)[-1].path


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    import safetensors.torch

    return safetensors.torch.load_file(_version(directory) / "model.safetensors")


def _losses(path: Path) -> list[float]:
    import json

    return json.loads(path.read_text())["losses"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dp")
    both = lambda extra: [COMMON + extra, COMMON + extra]  # noqa: E731
    _run(both(["--out", "two.json", "--save", "two"]), root)
    _run(both(["--shard", "--out", "sharded.json", "--save", "sharded"]), root)
    half = ["--steps", str(STEPS // 2)]
    _run(both(["--shard", *half, "--save", "first-half"]), root)
    _run(both(["--shard", *half, "--resume", "first-half", "--out", "resumed.json", "--save", "resumed"]), root)
    _single(COMMON + ["--accumulate", "2", "--out", "one.json", "--save", "one"], root)
    _single(COMMON + ["--accumulate", "2", "--dropout", "0", "--out", "one-nodrop.json", "--save", "one-nodrop"], root)
    _single(COMMON + ["--batch-size", "8", "--dropout", "0", "--out", "concat.json", "--save", "concat"], root)
    for name, (extra, micro) in VARIANTS.items():
        _run(both([*extra, "--out", f"{name}.json", "--save", name]), root)
        _run(both([*extra, "--shard", "--out", f"{name}-sharded.json", "--save", f"{name}-sharded"]), root)
        _single(COMMON + [*extra, "--accumulate", str(micro), "--out", f"{name}-one.json", "--save", f"{name}-one"], root)
    return root


def test_two_ranks_equal_one_process_accumulating_the_same_micro_batches(runs: Path) -> None:
    assert _losses(runs / "two.json") == _losses(runs / "one.json")
    two, one = _weights(runs / "two"), _weights(runs / "one")
    assert all(torch.equal(two[k], one[k]) for k in one)


def test_one_process_on_the_concatenated_batch_within_fp32_reduction_tolerance(runs: Path) -> None:
    """One backward over 8 sequences sums per-sequence terms in another order than two backwards
    over 4, so gradients differ by fp32 rounding. The losses of 20 steps agree to 1e-5 relative
    (observed 1.5e-7). Adam divides each gradient by its running RMS, so where a gradient is near
    zero a rounding difference can move that weight by a good part of one step (at most about
    lr = 3e-3); the weights agree to 1e-3 absolute (observed: 86% of them differ in some bit, the
    worst by 8.2e-5)."""
    concat, split = _weights(runs / "concat"), _weights(runs / "one-nodrop")
    assert max(float((concat[k] - split[k]).abs().max()) for k in concat) < 1e-3
    losses, reference = _losses(runs / "concat.json"), _losses(runs / "one-nodrop.json")
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) < 1e-5


def test_sharded_equals_unsharded(runs: Path) -> None:
    assert _losses(runs / "sharded.json") == _losses(runs / "two.json")
    sharded, two = _weights(runs / "sharded"), _weights(runs / "two")
    assert all(torch.equal(sharded[k], two[k]) for k in two)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "accumulate"])
def test_options_keep_two_ranks_sharded_or_not_equal_to_one_process(runs: Path, variant: str) -> None:
    """Clipping (the sharded norm is summed across owners), bf16 parameters (fp32 masters, staging
    buffers, broadcasts in bf16), summing before the host copy, one-step-delayed updates, small
    parameters on a device optimizer, and the whole update in step() (one bucket, no pipeline)."""
    reference = _losses(runs / f"{variant}-one.json")
    assert _losses(runs / f"{variant}.json") == reference
    assert _losses(runs / f"{variant}-sharded.json") == reference
    one = _weights(runs / f"{variant}-one")
    for name in (variant, f"{variant}-sharded"):
        two = _weights(runs / name)
        assert all(torch.equal(two[k], one[k]) for k in one)
    if variant == "device-sum":  # where the sum happens changes nothing in the numbers
        assert reference == _losses(runs / "one.json")
    elif variant in ("small-on-device", "in-step"):  # nor which optimizer or when (the same fused kernel)
        assert reference == _losses(runs / "one.json")
    else:  # the option really changed the run
        assert reference != _losses(runs / "one.json")


def test_delayed_update_versions_export_the_newest_weights_alike(runs: Path) -> None:
    """``delayed_update``: a version's model file holds the parameters one update behind the masters
    (a resume needs them so); ``export()`` writes the masters, assembled from every rank's share when
    sharded, and gives two ranks, sharded or not, the weights of one process (NOTE [a delayed
    version's newest weights] in ooc.checkpoint)."""
    from dataclasses import replace

    import safetensors.torch

    from ooc.apps.demo import CharData, load_text
    from ooc.checkpoint import Checkpointer
    from ooc.models.gpt import GPT, GPT_PRESETS

    model = GPT(replace(GPT_PRESETS["nano"], vocab_size=len(CharData.from_text(load_text()).chars)))
    exported = {name: safetensors.torch.load_file(Checkpointer(runs / name, model).export(None, runs / f"{name}-export/"))
                for name in ("delayed-one", "delayed", "delayed-sharded")}
    saved = _weights(runs / "delayed-one")
    one = exported["delayed-one"]
    assert one.keys() == saved.keys()
    assert all(not torch.equal(one[k], saved[k]) for k in saved)  # every weight took the last update
    for name in ("delayed", "delayed-sharded"):
        assert all(torch.equal(exported[name][k], one[k]) for k in one), name


def test_accumulation_on_each_rank(runs: Path) -> None:
    """Two ranks accumulating two micro-batches each sum as (a + b) + (c + d); one process
    accumulating four sums ((a + b) + c) + d: the same gradients up to fp32 rounding. Sharded and
    unsharded runs sum alike, so they agree exactly; against one process the losses agree to 1e-5
    relative and the weights to 1e-3 absolute, as in the concatenated-batch test above."""
    two, sharded = _weights(runs / "accumulate"), _weights(runs / "accumulate-sharded")
    assert _losses(runs / "accumulate.json") == _losses(runs / "accumulate-sharded.json")
    assert all(torch.equal(two[k], sharded[k]) for k in two)
    one = _weights(runs / "accumulate-one")
    assert max(float((two[k] - one[k]).abs().max()) for k in one) < 1e-3
    losses, reference = _losses(runs / "accumulate.json"), _losses(runs / "accumulate-one.json")
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) < 1e-5


def test_sharded_state_is_split_across_ranks(runs: Path) -> None:
    import safetensors.torch

    states = [safetensors.torch.load_file(_version(runs / "sharded") / f"optimizer-rank{r}.safetensors") for r in range(2)]
    full = safetensors.torch.load_file(_version(runs / "two") / "optimizer-rank0.safetensors")
    numel = lambda state: sum(v.numel() for k, v in state.items() if k.endswith(".exp_avg"))  # noqa: E731
    assert set(states[0]).isdisjoint(states[1]) and set(states[0]) | set(states[1]) == set(full)
    assert max(numel(s) for s in states) < 0.6 * numel(full)  # each rank holds about half


def test_resume_from_a_checkpoint_continues_identically(runs: Path) -> None:
    assert _losses(runs / "resumed.json") == _losses(runs / "sharded.json")[STEPS // 2:]
    resumed, straight = _weights(runs / "resumed"), _weights(runs / "sharded")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_a_sharded_checkpoint_resumes_on_one_process(runs: Path) -> None:
    """Two sharded ranks' version, resumed by one process accumulating both ranks' micro-batches:
    it reads both ranks' optimizer shares and goes on exactly as the two ranks did."""
    _single([*COMMON, "--steps", str(STEPS // 2), "--accumulate", "2", "--resume", str(runs / "first-half"),
             "--out", "one-resumed.json", "--save", "one-resumed"], runs)
    assert _losses(runs / "one-resumed.json") == _losses(runs / "sharded.json")[STEPS // 2:]
    resumed, straight = _weights(runs / "one-resumed"), _weights(runs / "sharded")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_lost_rank_makes_the_survivor_exit_within_the_timeout(tmp_path: Path, how: signal.Signals) -> None:
    timeout = 10
    args = ["--preset", "nano", "--steps", "100000", "--no-progress", "--timeout", str(timeout)]
    procs = _start([args, args], tmp_path)
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
    procs = _start([base, [*base, *rank1]], tmp_path)
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
    launch = [arg.format(port=_free_port()) for arg in launch]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "ooc", "train",
         "--preset", "nano", "--steps", "3", "--no-progress"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240, env={**os.environ, "OOC_CHECK_ORDER": "1"},  # as _env's ranks
    )
    assert done.returncode == 0, done.stderr
    assert "on 2 rank(s)" in done.stdout and "step     2" in done.stdout
