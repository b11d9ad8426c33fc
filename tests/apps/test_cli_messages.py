"""What the `ooc` commands tell a new user: every option explained in --help, a line before long work, errors that say what is wrong."""

from __future__ import annotations

import argparse
from pathlib import Path

from ooc.apps.cli import build_parser
from ooc.scheduler.hardware import PRESETS
from ooc.scheduler.planners import PLANNERS


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = {}
    for name, command in sub.choices.items():
        found[name] = command
        for action in command._actions:  # ooc checkpoints list
            if isinstance(action, argparse._SubParsersAction):
                found.update({f"{name} {n}": c for n, c in action.choices.items()})
    return found


def test_every_option_has_a_help_text() -> None:
    bare = [f"ooc {name} {' '.join(action.option_strings) or action.dest}"
            for name, command in _commands().items() for action in command._actions
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and not action.help]
    assert not bare, f"options without a help text: {bare}"


def test_planner_and_hardware_help_name_the_choices() -> None:
    commands = _commands()
    planner = commands["plan"].format_help()
    hardware = commands["simulate"].format_help()
    assert all(name in " ".join(planner.split()).replace("- ", "-") for name in PLANNERS), planner
    assert all(name in " ".join(hardware.split()).replace("- ", "-") for name in PRESETS), hardware


def test_profile_and_calibrate_say_what_they_measure_before_they_start(tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    """Both ran a minute or more on a loaded 2-core machine without a line of output."""
    from ooc.apps.cli import main
    from ooc.scheduler.profile import Profile

    said = []

    def stub(result):  # noqa: ANN001, ANN202
        def measure(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
            said.append(capsys.readouterr().err)  # what was printed before the measurement began
            return result
        return measure

    analytic = Profile.load(Path(__file__).resolve().parents[2] / "profiles" / "analytic-h100-sxm-gpt2-xl-s1024.json")
    monkeypatch.setattr("ooc.profile", stub(analytic))
    monkeypatch.setattr("ooc.calibrate.calibrate", stub(PRESETS["cpu"]))
    assert main(["profile", "--model", "mlp", "--batch", "4"]) == 0
    assert main(["calibrate"]) == 0
    assert said[0] == "profiling mlp, input 4 x 32: each block timed over 3 steps\n"
    assert said[1].startswith("measuring copies each way")


def test_checkpoints_list_of_a_directory_that_is_not_there_says_so(tmp_path, capsys) -> None:  # noqa: ANN001
    """It answered 'no complete checkpoint in DIR', as for an empty directory: a typo read as a lost run."""
    from ooc.apps.cli import main

    assert main(["checkpoints", "list", str(tmp_path / "ckpt")]) == 2
    assert capsys.readouterr().err.startswith(f"ooc checkpoints: error: no directory {tmp_path / 'ckpt'} ")
    assert main(["checkpoints", "list", str(tmp_path)]) == 1
    assert capsys.readouterr().out == f"no complete checkpoint in {tmp_path}\n"


def test_profile_prints_sizes_as_the_plan_table_does(capsys) -> None:  # noqa: ANN001
    """`saved 2988441600 B` beside `ooc plan`'s `2.78 GiB` for the same block."""
    from ooc.apps.cli import main

    assert main(["profile", "--analytic", "gpt2-xl", "--seq", "1024", "--hardware", "h100-sxm"]) == 0
    assert "  layers.0: fwd 2.350 ms, bwd 4.700 ms, saved 2.78 GiB, input 50.00 MiB\n" in capsys.readouterr().out


def test_an_output_file_in_a_missing_folder_is_refused_before_the_work(tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    """`ooc profile --out`, `ooc plan --out`, `ooc simulate --timeline/--trace` and `ooc train --out` did
    their work (a whole training run for `train`) and then failed on the folder, `profile` naming its
    `.tmp` file; `ooc calibrate --out` and `ooc partition --gantt/--placement` alike."""
    import pytest

    from ooc.apps.cli import main

    def never(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the work started")

    monkeypatch.setattr("ooc.profile", never)
    monkeypatch.setattr("ooc.calibrate.calibrate", never)
    monkeypatch.setattr("ooc.apps.train.main", never)
    monkeypatch.setattr("ooc.apps.partition.run_partition", never)
    profile = str(Path(__file__).resolve().parents[2] / "profiles" / "analytic-h100-sxm-gpt2-xl-s1024.json")
    missing = tmp_path / "no-such-folder" / "x.json"
    for argv in (["profile", "--model", "mlp", "--out", str(missing)],
                 ["plan", "--profile", profile, "--budget", "20GiB", "--out", str(missing)],
                 ["simulate", "--profile", profile, "--plan", profile, "--timeline", str(missing)],
                 ["simulate", "--profile", profile, "--plan", profile, "--trace", str(missing)],
                 ["train", "--steps", "1", "--out", str(missing)],
                 ["calibrate", "--out", str(missing)],
                 ["partition", "--gantt", str(missing)],
                 ["partition", "--placement", str(missing)]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2, argv
        assert f"no directory {missing.parent} to write x.json into; create it first" in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        main(["plan", "--profile", profile, "--budget", "20GiB", "--out", str(tmp_path)])
    assert f"{tmp_path} is a directory; give a file name in it" in capsys.readouterr().err
    assert main(["plan", "--profile", profile, "--budget", "20GiB", "--out", str(tmp_path / "q.json")]) == 0
    assert (tmp_path / "q.json").is_file()


def test_simulate_check_fails_when_a_step_time_misses(monkeypatch, capsys) -> None:
    """`ooc simulate --check` printed "step times within 20%: NO" and exited 0: only the peaks decided its status."""
    from ooc.apps import check
    from ooc.apps.cli import main

    rows = [check.CheckRow("keep-all", 1000, 1000, 0.010, 0.0101),
            check.CheckRow("swap-all", 1000, 1000, 0.010, 0.020)]
    monkeypatch.setattr(check, "calibration_check", lambda **_: rows)
    assert main(["simulate", "--check", "--hardware", "cpu"]) == 1
    out, err = capsys.readouterr()
    assert "step times within 20%: NO" in out
    assert err.splitlines()[0] == ("ooc simulate --check: plan swap-all: step measured 20.0 ms, predicted 10.0 ms: off by "
                                   "50.0% of the measured step, more than 20%")
    assert "run again with more --reps" in err
    monkeypatch.setattr(check, "calibration_check", lambda **_: rows[:1])
    assert main(["simulate", "--check", "--hardware", "cpu"]) == 0
    assert capsys.readouterr().err == ""


def test_simulate_check_names_a_missed_peak(monkeypatch, capsys) -> None:
    from ooc.apps import check
    from ooc.apps.cli import main

    rows = [check.CheckRow("recompute-all", 2**20, 3 * 2**20, 0.010, 0.010)]
    monkeypatch.setattr(check, "calibration_check", lambda **_: rows)
    assert main(["simulate", "--check", "--hardware", "cpu"]) == 1
    assert capsys.readouterr().err.splitlines()[0] == (
        "ooc simulate --check: plan recompute-all: peak measured 3.00 MiB, predicted 1.00 MiB: off by 2.00 MiB "
        "(200.00%), more than 1% + 1 MiB")


def test_profile_and_partition_refuse_a_seq_above_the_gpts_block_size(capsys) -> None:
    """`ooc profile --model gpt:nano --seq 64` profiled sequences of 32 tokens: only the input shape on
    stderr showed it (`ooc partition --graph gpt:nano` took the same path)."""
    from ooc.apps.cli import main

    assert main(["profile", "--model", "gpt:nano", "--seq", "64"]) == 2
    assert capsys.readouterr().err == ("ooc profile: error: --seq 64 is longer than gpt:nano's sequences of at most 32 "
                                       "tokens (its block_size); pass --seq 32 or less\n")
    assert main(["partition", "--graph", "gpt:nano", "--seq", "33"]) == 2
    assert "pass --seq 32 or less" in capsys.readouterr().err


def test_reference_gpt_without_seq_takes_64_or_its_block_size() -> None:
    from ooc.apps.cli import reference_model

    assert reference_model("gpt:nano", 2)[1][0].shape == (2, 32)
    assert reference_model("gpt:tiny", 2)[1][0].shape == (2, 64)
    assert reference_model("gpt:tiny", 2, 16)[1][0].shape == (2, 16)
