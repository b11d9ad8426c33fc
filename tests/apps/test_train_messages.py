"""What ``ooc train`` tells a user about where it starts."""

from __future__ import annotations

import re
from pathlib import Path

from ooc.apps.cli import main


def test_resume_auto_in_an_empty_directory_says_it_starts_fresh(tmp_path: Path, capsys) -> None:
    save = tmp_path / "ck"
    code = main(["train", "--preset", "nano", "--steps", "1", "--batch-size", "2", "--seq", "16", "--no-progress",
                 "--save", str(save), "--resume", "auto"])
    assert code == 0
    assert f"--resume auto: no version in {save} yet; starting from step 0" in capsys.readouterr().out


def test_a_run_that_saves_ends_naming_its_newest_version(tmp_path: Path, capsys) -> None:
    """It ended with the loss and step time, and the user had to look for what it wrote."""
    save = tmp_path / "ck"
    assert main(["train", "--preset", "nano", "--steps", "2", "--batch-size", "2", "--seq", "16", "--no-progress",
                 "--save", str(save)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (f"saved {save / 'step-000000002'} (`ooc checkpoints list {save}`; continue with --save {save} "
                    "--resume auto)")


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


def test_a_budget_fraction_nothing_fits_says_which_fraction_does(capsys) -> None:
    """`--plan budget:0.01` said "Raise the budget to at least 96.75 KiB": a size the option does not take
    (it takes a fraction of the keep-all peak), left for the user to divide."""
    args = ["train", "--preset", "nano", "--steps", "1", "--batch-size", "2", "--seq", "16", "--no-progress"]
    assert main([*args, "--plan", "budget:0.01"]) == 1
    err = capsys.readouterr().err
    assert "no plan fits a budget of 3.39 KiB" in err
    found = re.search(r"\(--plan budget:<fraction> takes a fraction of the keep-all peak, ([0-9.]+ KiB): the smallest "
                      r"that fits here is --plan budget:([0-9.]+)\)$", err)
    assert found and found.group(1) == "339.00 KiB", err
    fraction = float(found.group(2))
    assert 0.01 < fraction <= 1
    # The smallest peak moves by some bytes from profile to profile (the swaps' timing): a little above it.
    assert main([*args, "--plan", f"budget:{min(1.0, fraction + 0.02):g}"]) == 0


def test_a_demo_budget_fraction_nothing_fits_says_which_fraction_does(capsys) -> None:
    """`ooc demo --budget-fraction 0.01` said "Raise the budget to at least 13.52 MiB", a size it does not take."""
    assert main(["demo", "--steps", "10", "--budget-fraction", "0.01", "--no-progress"]) == 2
    err = capsys.readouterr().err
    found = re.search(r"\(--budget-fraction <fraction> takes a fraction of the keep-all peak, [0-9.]+ MiB: the smallest "
                      r"that fits here is --budget-fraction ([0-9.]+)\)$", err.strip())
    assert found and 0.01 < float(found.group(1)) <= 1, err


def test_a_seq_above_the_presets_block_size_is_refused_naming_the_maximum(capsys) -> None:
    """`--preset nano --seq 64` trained on sequences of 32 characters; only the header line's "x 32" showed it."""
    args = ["train", "--preset", "nano", "--steps", "1", "--batch-size", "2", "--no-progress"]
    assert main([*args, "--seq", "64"]) == 2
    assert capsys.readouterr().err == (
        "ooc train: error: --seq 64 is longer than GPT preset nano's sequences of at most 32 characters (its block_size); "
        "pass --seq 32 or less, or a preset whose sequences hold 64 (tiny: 64, gpt2: 1024, gpt2-medium: 1024, "
        "gpt2-large: 1024, gpt2-xl: 1024)\n")
    assert main([*args, "--preset", "tiny", "--seq", "2000"]) == 2
    assert capsys.readouterr().err.endswith("pass --seq 64 or less\n")


def test_without_seq_a_run_takes_64_or_the_presets_block_size(capsys) -> None:
    """The default stays what it was: 64 characters, nano's 32 where its sequences are shorter."""
    assert main(["train", "--preset", "nano", "--steps", "1", "--batch-size", "2", "--no-progress", "--plan", "keep"]) == 0
    assert "global batch 2 x 32," in capsys.readouterr().out
