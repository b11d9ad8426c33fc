"""ooc.checkpoint and the process around it (issue 14): a relative directory and ``os.chdir``, two
jobs saving into one directory (NOTE [one job per directory])."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from ooc.checkpoint import Checkpointer, list_versions


def _linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def _steps(directory: Path) -> list[int]:
    return [v.step for v in list_versions(directory)]


def test_a_relative_directory_stays_where_it_was_when_the_process_changes_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Checkpointer("ckpt", ...)`` then ``os.chdir``: the next save went into the new working
    directory's ``ckpt`` (and a chdir on the training thread while the writer thread wrote a version
    split its files between two folders, failing it). The directory is made absolute once, when the
    Checkpointer is made."""
    monkeypatch.chdir(tmp_path)
    model = _linear()
    ckpt = Checkpointer("ckpt", model, torch.optim.AdamW(model.parameters()), keep=None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chdir(elsewhere)
    ckpt.save(1)
    ckpt.wait()
    # On the writer thread, between two files of a version.
    ckpt._hook = lambda point: point == "write:model.safetensors.index.json" and os.chdir(tmp_path)
    ckpt.save(2)
    ckpt.wait()
    ckpt.close()
    assert _steps(tmp_path / "ckpt") == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "elsewhere"]
    assert list(elsewhere.iterdir()) == []
    os.chdir(elsewhere)
    fresh = _linear(seed=1)
    assert Checkpointer(tmp_path / "ckpt", fresh, torch.optim.AdamW(fresh.parameters())).restore().step == 2
    assert torch.equal(fresh.weight, model.weight)
