"""``ooc <command> --help`` explains every option: a new user reads it before the README."""

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
