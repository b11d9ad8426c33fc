"""``ooc doctor`` on this GPU-less machine: both report files, every GPU step skipped with its
reason, exit code 0; and the scan for torch version gates finds one when there is one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ooc.apps import doctor

GPU_STEPS = [s.name for s in doctor.STEPS if s.needs_gpu]


def _check_report(out: Path, ran: set[str]) -> dict:
    report = json.loads((out / "doctor.json").read_text())
    markdown = (out / "doctor.md").read_text()
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == [s.name for s in doctor.STEPS]
    assert report["ok"] and report["counts"]["fail"] == 0
    for name, step in steps.items():
        if name in ran:
            assert step["status"] == "pass", step
            assert step["checks"] and all(c["ok"] for c in step["checks"])
            assert step["elapsed_s"] > 0
        else:
            assert step["status"] == "skip" and step["reason"], step
        assert f"| {name} | {step['status'].upper()} |" in markdown
    for name in GPU_STEPS:
        assert steps[name]["reason"].startswith("no CUDA device")
        assert steps[name]["reason"] in markdown
    return steps


def test_doctor_environment_only(tmp_path: Path) -> None:
    assert doctor.main(["--out", str(tmp_path), "--only", "environment"]) == 0
    steps = _check_report(tmp_path, {"environment"})
    assert steps["offline-install"]["reason"] == "not selected (--only environment)"
    assert steps["environment"]["figures"]["cuda_available"] is False


@pytest.mark.slow
def test_doctor_whole_on_the_cpu(tmp_path: Path) -> None:
    """The command the GPU machine runs, end to end here: the CPU steps pass, the GPU steps skip."""
    assert doctor.main(["--out", str(tmp_path)]) == 0
    steps = _check_report(tmp_path, {"environment", "offline-install", "compile-lane"})
    assert steps["offline-install"]["figures"]["torch_version_gates"] == []
    assert steps["compile-lane"]["figures"]["counts"]["passed"] >= 1
    assert (tmp_path / "compile-lane.log").is_file()


def test_version_gates_are_found(tmp_path: Path) -> None:
    (tmp_path / "ooc").mkdir()
    (tmp_path / "ooc" / "a.py").write_text('import torch\nif torch.__version__ < "2.12":\n    raise ImportError\n')
    (tmp_path / "ooc" / "b.py").write_text("from packaging import version\nok = version.parse(torch.__version__)\n")
    (tmp_path / "ooc" / "c.py").write_text('meta = {"torch": torch.__version__}\n')
    assert doctor.version_gates(tmp_path) == ["ooc/a.py:2", "ooc/b.py:2"]


def test_unknown_step_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no step gpt3"):
        doctor.main(["--out", str(tmp_path), "--only", "gpt3"])


def test_a_step_past_its_cap_is_stopped_and_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget caps a step: its process (and the pytest it started) is killed, the step fails
    with the reason, the other steps still report, and the exit code is 1."""
    # 2 s: less than the compile lane's start-up alone (importing torch and Triton, then pytest).
    monkeypatch.setattr(doctor, "MIN_STEP_S", 1.0)
    assert doctor.main(["--out", str(tmp_path), "--only", "compile-lane", "--budget-s", "2"]) == 1
    report = json.loads((tmp_path / "doctor.json").read_text())
    step = next(s for s in report["steps"] if s["name"] == "compile-lane")
    assert step["status"] == "fail" and step["reason"].startswith("timed out after 2 s")
    assert not report["ok"] and report["counts"]["fail"] == 1


def test_run_capped_stops_the_command_and_what_it_started() -> None:
    """The cap kills the whole session: a child that outlives its parent's kill would keep a GPU busy."""
    import sys
    import time

    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              "print(p.pid, flush=True); time.sleep(60)")
    started = time.monotonic()
    code, output = doctor.run_capped([sys.executable, "-c", script], 3, session=True)
    assert code is None and time.monotonic() - started < 30
    child = int(output.split()[0])
    time.sleep(0.5)
    stat = Path(f"/proc/{child}/stat")
    # Gone, or a zombie waiting for a container's init to reap it: either way no longer running.
    assert not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z"


def test_a_failed_offline_install_names_its_cause_first() -> None:
    """doctor.md's table showed pip's last line, `╰─> [14 lines of output]`, for a venv whose setuptools
    (65.5, as `python -m venv` installs on Python 3.11) cannot build an editable install without `wheel`."""
    output = ("Obtaining file:///src\n  error: subprocess-exited-with-error\n  Checking if build backend supports build_editable: started\n"
              "  × Preparing editable metadata (pyproject.toml) did not run successfully.\n"
              "      running dist_info\n      error: invalid command 'bdist_wheel'\n      [end of output]\n"
              "error: metadata-generation-failed\n╰─> See above for output.\n")
    first, _, rest = doctor.pip_failure(output).partition("\n")
    assert first.startswith("error: invalid command 'bdist_wheel'; --no-build-isolation builds with this "
                            "environment's setuptools") and "`wheel`" in first
    assert rest == output
