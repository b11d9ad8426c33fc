"""``ooc <command> --help`` explains every option: a new user reads it before the README."""

from __future__ import annotations

import argparse

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
