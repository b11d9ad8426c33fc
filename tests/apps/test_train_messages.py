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


def test_resume_with_another_preset_names_the_preset_it_was_saved_with(tmp_path: Path, capsys) -> None:
    """It failed with checkpoint.py's list of every tensor of the model, two shapes each."""
    save = tmp_path / "ck"
    args = ["train", "--steps", "1", "--batch-size", "2", "--seq", "16", "--no-progress", "--save", str(save)]
    assert main([*args, "--preset", "nano"]) == 0
    capsys.readouterr()
    assert main([*args, "--preset", "tiny", "--resume", "auto"]) == 1
    assert capsys.readouterr().err == (
        f"ooc train: rank 0: error: --resume {save}: its newest version (step 1) is of --preset nano, this run builds "
        "--preset tiny; run with --preset nano, or --save into another directory to train a new model\n")
