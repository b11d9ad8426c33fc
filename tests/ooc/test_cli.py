"""The command line: profile -> plan -> simulate, pictures and traces, and clear errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import ooc
from ooc.apps.cli import main
from ooc.models import GPT
from ooc.scheduler import Plan, Profile, ProfileError
from tests.helpers import gpt_batch


def test_profile_plan_simulate(tmp_path, capsys) -> None:
    prof, plan, png, trace = (tmp_path / n for n in ("p.json", "q.json", "t.png", "t.json"))
    assert main(["profile", "--model", "gpt:nano", "--batch", "4", "--seq", "32", "--reps", "1", "--out", str(prof)]) == 0
    assert Profile.load(prof).names == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert main(["plan", "--profile", str(prof), "--budget", "900KiB", "--out", str(plan)]) == 0
    out = capsys.readouterr().out
    for planner in ("keep-all", "recompute-all", "swap-all", "sqrt-checkpoint", "karma", "optimal"):
        assert planner in out
    assert len(Plan.from_json(plan.read_text())) == 4
    assert main(["simulate", "--profile", str(prof), "--plan", str(plan), "--timeline", str(png), "--trace", str(trace)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert "forward/0" in names and "backward/3" in names
    assert any(e["ph"] == "C" for e in events)


def test_profile_ops_feeds_the_op_level_planner(tmp_path, capsys) -> None:
    prof = tmp_path / "p.json"
    assert main(["profile", "--model", "gpt:nano", "--batch", "2", "--seq", "16", "--reps", "1", "--ops", "--out", str(prof)]) == 0
    blocks = Profile.load(prof).blocks
    assert all(b.ops for b in blocks) and any(op.cacheable for op in blocks[0].ops)
    budget = sum(b.saved_bytes for b in blocks) // 2
    assert main(["plan", "--profile", str(prof), "--budget", str(budget), "--planner", "op-level"]) == 0
    assert "op-level" in capsys.readouterr().out


def test_analytic_profile(tmp_path) -> None:
    out = tmp_path / "a.json"
    assert main(["profile", "--analytic", "gpt2-xl", "--seq", "1024", "--batch", "8", "--hardware", "h100-sxm", "--out", str(out)]) == 0
    prof = Profile.load(out)
    assert len(prof) == 48
    # Korthikanti et al.: s*b*h*(34 + 5*a*s/h) bytes per layer
    assert prof.blocks[0].saved_bytes == int(1024 * 8 * 1600 * (34 + 5 * 25 * 1024 / 1600))


def test_errors_are_one_line_with_exit_code_2(tmp_path, capsys) -> None:
    assert main(["plan", "--profile", str(tmp_path / "missing.json"), "--budget", "1GiB"]) == 2
    assert "ooc profile --out" in capsys.readouterr().err
    prof = tmp_path / "p.json"
    main(["profile", "--model", "gpt:nano", "--batch", "2", "--seq", "16", "--reps", "1", "--out", str(prof)])
    assert main(["plan", "--profile", str(prof), "--budget", "1KiB"]) == 2
    assert "smallest peak any plan reaches" in capsys.readouterr().err
    assert main(["plan", "--profile", str(prof), "--budget", "lots"]) == 2
    assert main(["simulate", "--profile", str(prof)]) == 2
    assert main(["profile", "--model", "transformer"]) == 2


def test_wrap_with_a_profile_checks_it_matches(tmp_path) -> None:
    torch.manual_seed(0)
    model = GPT("nano")
    batch = gpt_batch(batch=2, seq=16)
    prof = ooc.profile(model, batch, reps=1)
    ooc.wrap(model, budget=prof.blocks[0].saved_bytes * 2, profile=prof, backend="cpu")
    model(*batch)[1].backward()
    assert ooc.memory_report(model).peak_bytes <= prof.blocks[0].saved_bytes * 2
    ooc.unwrap(model)
    other = Profile(prof.blocks[:3], machine=prof.machine)
    with pytest.raises(ProfileError, match="profile this model again"):
        ooc.wrap(model, budget="1GiB", profile=other, backend="cpu")
    assert not ooc.is_wrapped(model)
    # Another model whose chain has the same names (blocks.0 ... blocks.3): its blocks hold other parameters.
    wider = GPT(replace(model.config, n_embd=64))
    with pytest.raises(ProfileError, match="the profile is of another model .* block blocks.0 holds"):
        ooc.wrap(wider, budget="1GiB", profile=prof, backend="cpu")
    assert not ooc.is_wrapped(wider)


def test_profile_and_calibrate_are_measured_by_the_runtime() -> None:
    import types

    import ooc.calibrate
    import ooc.scheduler

    hw = ooc.calibrate.calibrate("cpu", nbytes=1 << 16, reps=1)
    assert hw.h2d > 0 and hw.copy_issue_s >= 0 and hw.host_contention >= 0
    assert hw.op_intercept_s >= 0  # a difference of step times, never below 0 (its arithmetic: next test)
    assert len(ooc.profile(GPT("nano"), gpt_batch(batch=2, seq=8), reps=1)) == 4
    # The scheduler does not reach up into the runtime: its ``profile`` is the module of that name.
    assert isinstance(ooc.scheduler.profile, types.ModuleType) and not hasattr(ooc.scheduler, "calibrate")


def test_op_intercept_is_a_selective_steps_extra_time_per_op(monkeypatch) -> None:  # noqa: ANN001
    """``_op_intercept_seconds``: (selective step - plain step + what caching skips) / ops, never
    below 0, where each block caches its cheapest op; both steps run for real, the selective one
    through its cache. The step times are set here (the calibration's wall-clock figures are noise
    on a loaded machine)."""
    import ooc.calibrate
    from ooc.backend import resolve_backend
    from ooc.op_profile import ForwardCache
    from ooc.scheduler.oplevel import rerun_saved_s

    extra, ran, profiles, cached = [0.0], [], [], []
    profile = ooc.profile

    def timed(fn, reps: int, *, warmup: int = 1) -> float:  # noqa: ANN001
        fn()
        ran.append(fn)
        return 0.010 + (extra[0] if len(ran) % 2 == 0 else 0.0)  # plain first, then selective

    def finish(self: ForwardCache, out) -> None:  # noqa: ANN001
        cached.append(tuple(self.cached))
        finish_before(self, out)

    finish_before = ForwardCache.finish
    monkeypatch.setattr(ooc.calibrate, "median_seconds", timed)
    monkeypatch.setattr(ooc, "profile", lambda *a, **k: profiles.append(profile(*a, **k)) or profiles[-1])
    monkeypatch.setattr(ForwardCache, "finish", finish)
    backend = resolve_backend("cpu", torch.nn.Linear(1, 1))
    for extra[0], at_least in ((3e-3, 0.0), (-1.0, 0.0)):
        figure = ooc.calibrate._op_intercept_seconds(backend, reps=1)
        blocks = profiles[-1].blocks
        # A re-run dispatches only the ops before its last save (``replayed``): the cheapest op a
        # cache can skip is the cheapest of those, and what caching it skips is the cost model's
        # price of it. (Choosing among every cacheable op failed under load, when an op after the
        # last save happened to time cheapest.)
        cheapest = [min((k for k, op in enumerate(b.ops) if op.cacheable and op.replayed), key=lambda k: b.ops[k].forward_s)
                    for b in blocks]
        skipped = sum(rerun_saved_s(b.ops, (k,)) for b, k in zip(blocks, cheapest))
        assert figure == pytest.approx(max(at_least, (extra[0] + skipped) / sum(len(b.ops) for b in blocks)), rel=1e-9)
        assert cached[-len(blocks):] == [(k,) for k in cheapest]  # the selective step ran through its cache
    assert len(ran) == 4 and figure == 0.0


def test_calibration_check_peaks_are_exact() -> None:
    """`ooc simulate --check` on the demo GPT; step times are reported, not asserted (wall clock)."""
    from ooc.apps.check import calibration_check, format_check
    from ooc.scheduler import preset

    shown = []
    rows = calibration_check(reps=1, backend="cpu", hardware=preset("cpu"), show=shown.append)
    assert [r.plan for r in rows] == ["keep-all", "swap-all", "recompute-all", "optimal@50%"]
    # minutes on a loaded CPU: each stage says it has begun (it printed nothing until the table)
    assert shown == ["profiling the demo GPT's 6 blocks on cpu", *(f"plan {k}/4, {r.plan}: 3 steps" for k, r in enumerate(rows, 1))]
    assert all(r.measured_peak == r.predicted_peak for r in rows)
    assert "peaks within 1% + 1 MiB: yes" in format_check(rows)


def test_train_single_process_with_a_budget_plan(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    code = main(["train", "--preset", "nano", "--steps", "3", "--batch-size", "4", "--seq", "32", "--no-progress",
                 "--plan", "budget:0.5", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "on 1 rank(s)" in text and "step     2" in text
    losses = json.loads(out.read_text())["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_include_params_plan_from_the_command_line(tmp_path, capsys) -> None:
    out = tmp_path / "q.json"
    profile = Path(__file__).resolve().parents[2] / "profiles" / "analytic-v100-16gb-decoder-7b-s2048.json"
    code = main(["plan", "--profile", str(profile), "--hardware", "v100-16gb",
                 "--budget", "12GiB", "--include-params", "--out", str(out)])
    assert code == 0
    assert "blocks stream their parameters" in capsys.readouterr().out
    assert any(b.streamed for b in Plan.from_json(out.read_text()).blocks)


@pytest.mark.parametrize("argv, message", [
    (["--preset", "huge"], "no GPT preset 'huge'"),
    (["--plan", "nowhere.json"], "--plan 'nowhere.json': no plan file nowhere.json; make one with `ooc plan --profile "
                                 "P.json --budget ... --out nowhere.json`, or give keep, swap, recompute"),
    (["--plan", "keepall"], "--plan 'keepall': give keep, swap, recompute, budget:<fraction> or a plan file"),
    (["--reduce-on", "nic"], "reduce_on must be"),
    (["--timeout", "inf"], "--timeout must be a finite number of seconds > 0"),
    (["--timeout", "nan"], "--timeout must be a finite number of seconds > 0"),
    (["--plan", "budget:half"], "needs a fraction of the keep-all peak in (0, 1], got 'half'"),
    (["--save-every", "2"], "--save-every saves into --save's directory: give --save DIR too"),  # nothing was saved
    (["--keep", "2"], "--keep applies to --save's directory: give --save DIR too"),
])
def test_train_rejects_bad_options(argv, message, capsys) -> None:
    assert main(["train", "--steps", "1", "--no-progress", *argv]) != 0
    assert message in capsys.readouterr().err


def test_the_demo_runs_and_keeps_its_promises() -> None:
    """The README's first command, shortened: a mixed plan, the measured peak equal to the
    prediction and within the budget, the loss going down."""
    from ooc.apps.demo import run_demo

    lines: list[str] = []
    torch.set_num_threads(2)  # the autouse fixture puts its own count back after the test
    result = run_demo(steps=12, batch_size=4, show=lines.append, progress=False, threads=1)
    assert len(set(result.policies)) >= 2
    assert result.measured_peak_bytes == result.predicted_peak_bytes <= result.budget_bytes
    assert result.last_loss < result.first_loss
    assert any("HostAdamW" in line for line in lines) and "(1 torch thread)" in lines[0]
    assert torch.get_num_threads() == 2  # the demo's thread count is the demo's alone


@pytest.mark.parametrize(("requested", "device", "load", "expected"), [
    (None, "cpu", 1.2, 2),   # cores free: torch's default
    (None, "cpu", 2.0, 1),   # the load average fills both cores (NOTE [the demo's threads])
    (None, "cpu", 8.1, 1),
    (None, "cuda", 8.1, 2),  # on a GPU the threads only issue kernels
    (3, "cpu", 8.1, 3),      # --threads decides
])
def test_the_demo_runs_on_one_thread_where_the_load_fills_the_cores(monkeypatch, requested, device, load, expected) -> None:
    from ooc.apps.demo import demo_threads

    monkeypatch.setattr("os.getloadavg", lambda: (load, load, load))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    torch.set_num_threads(2)
    count, why = demo_threads(requested, torch.device(device))
    assert count == expected
    assert ("load average" in why) == (requested is None and device == "cpu" and expected == 1), why
    with pytest.raises(ValueError, match="threads must be at least 1"):
        demo_threads(0, torch.device("cpu"))


def test_plan_table_has_an_op_level_row(tmp_path, capsys) -> None:
    profile = Path(__file__).resolve().parents[2] / "profiles" / "analytic-h100-sxm-gpt2-xl-s1024.json"
    out = tmp_path / "p.json"
    assert main(["plan", "--profile", str(profile), "--budget", "35GiB", "--planner", "op-level", "--out", str(out)]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["op-level"][-1] == "yes" and float(rows["op-level"][2]) < float(rows["optimal"][2])
    assert any(b.cached_ops for b in Plan.from_json(out.read_text()).blocks)


def test_train_in_float16_scales_the_loss_in_the_optimizer(tmp_path, capsys) -> None:  # noqa: ANN001
    """``--dtype float16``: fp16 weights, the loss scaled by HostAdamW (GradScaler's defaults start at
    2**16, which the nano GPT's first gradients overflow: that step is skipped and the scale halves)."""
    out = tmp_path / "r.json"
    code = main(["train", "--preset", "nano", "--steps", "6", "--batch-size", "4", "--seq", "32", "--no-progress",
                 "--dtype", "float16", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "float16" in text and "step(s) skipped, their gradients over the loss scale (now 32768)" in text
    losses = json.loads(out.read_text())["losses"]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


SPINNER = '''
import os, threading
if os.environ.get("OOC_TEST_SPIN") == "1":
    import torch
    a = torch.randn(256, 256)
    def spin():
        while True:
            torch.mm(a, a)
    threading.Thread(target=spin, daemon=True).start()
'''


def test_the_command_ends_without_an_abort_while_a_daemon_thread_runs_a_torch_call(tmp_path) -> None:
    """NOTE [the command leaves without teardown]: a daemon thread inside a torch call when the
    interpreter finalizes aborts a process (SIGABRT, "terminate called without an active exception");
    the command leaves before that, with its own exit code and output."""
    (tmp_path / "sitecustomize.py").write_text(SPINNER)  # starts the thread in the command's process
    (tmp_path / "versions").mkdir()
    env = {**os.environ, "OOC_TEST_SPIN": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    for _ in range(3):
        done = subprocess.run([sys.executable, "-m", "ooc", "checkpoints", "list", str(tmp_path / "versions")],
                              env=env, capture_output=True, text=True, timeout=120)
        assert "terminate called" not in done.stderr
        assert done.returncode == 1 and "no complete checkpoint" in done.stdout
