"""Ctrl-C in ``ooc train`` (and any other command) ends with one line and exit status 130, not a
traceback through torch's internals, and leaves the checkpoint directory as a finished run leaves it."""

from __future__ import annotations

from pathlib import Path

import pytest

import ooc.apps.train as train_app
from ooc.apps.cli import main
from ooc.checkpoint import scan_versions


class _CtrlCAtStep(train_app.HostAdamW):
    """HostAdamW whose ``step()`` is interrupted as Ctrl-C would interrupt it, at its ``at``-th call."""

    at = 4

    def step(self, closure=None):  # noqa: ANN001, ANN201
        type(self).calls += 1
        if type(self).calls == self.at:
            raise KeyboardInterrupt
        return super().step(closure)


def test_ctrl_c_in_train_says_where_to_go_on_and_leaves_no_partial_state(tmp_path: Path, capsys, monkeypatch) -> None:
    _CtrlCAtStep.calls = 0
    monkeypatch.setattr(train_app, "HostAdamW", _CtrlCAtStep)
    save = tmp_path / "ck"
    try:
        code = main(["train", "--preset", "nano", "--steps", "20", "--batch-size", "2", "--seq", "16", "--no-progress",
                     "--save", str(save), "--save-every", "1", "--keep", "1"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C in `ooc train` escaped as a KeyboardInterrupt (a traceback for the user)")
    assert code == 130
    err = capsys.readouterr().err
    assert err.strip() == (f"ooc train: rank 0: interrupted; the newest complete version in {save} is step 3: "
                           f"continue with --save {save} --resume auto"), err
    found, damaged = scan_versions(save)
    assert [v.step for v in found] == [3] and not damaged
    # Closed as at the end of a run: the retired version's spare folder and the writer's lock are gone.
    assert sorted(p.name for p in save.iterdir()) == ["step-000000003"]


def test_ctrl_c_in_any_command_is_one_line(capsys, monkeypatch) -> None:  # noqa: ANN001
    def interrupted(*_args, **_kwargs) -> None:  # noqa: ANN002, ANN003
        raise KeyboardInterrupt

    monkeypatch.setattr("ooc.apps.demo.run_demo", interrupted)
    try:
        code = main(["demo", "--steps", "10"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C in `ooc demo` escaped as a KeyboardInterrupt (a traceback for the user)")
    assert code == 130 and capsys.readouterr().err == "ooc demo: interrupted\n"
