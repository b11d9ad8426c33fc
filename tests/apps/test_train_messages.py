"""What ``ooc train`` tells a user about where it starts."""

from __future__ import annotations

from pathlib import Path

from ooc.apps.cli import main


def test_resume_auto_in_an_empty_directory_says_it_starts_fresh(tmp_path: Path, capsys) -> None:
    save = tmp_path / "ck"
    code = main(["train", "--preset", "nano", "--steps", "1", "--batch-size", "2", "--seq", "16", "--no-progress",
                 "--save", str(save), "--resume", "auto"])
    assert code == 0
    assert f"--resume auto: no version in {save} yet; starting from step 0" in capsys.readouterr().out
