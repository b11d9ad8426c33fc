from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from ooc.checkpoint import Checkpointer, CheckpointError, damaged_versions, list_versions
from tests.ooc.test_checkpoint_users import _damage, _linear, _moved_aside, _saved, _steps


def test_restore_older_then_save_next(tmp_path: Path):
    _saved(tmp_path, (3, 4, 5)).close()
    ckpt = Checkpointer(tmp_path, _linear(seed=1), keep=3)
    assert ckpt.restore(3).step == 3
    with pytest.raises(CheckpointError, match=r"step 4 is below the newest version \(step 5\)"):
        ckpt.save(4)
    assert _steps(tmp_path) == [3, 4, 5]


@pytest.mark.parametrize("damage", ["file", "record"])
def test_fallback_keep1(tmp_path: Path, damage):
    _saved(tmp_path, (1, 2, 3), keep=None).close()
    _damage(tmp_path / "step-000000003" / ("model.safetensors" if damage == "file" else "manifest-rank0.json"))
    ckpt = Checkpointer(tmp_path, _linear(seed=1), keep=1)
    assert ckpt.restore(fallback=True).step == 2
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for s in (3, 4, 5):
            ckpt.save(s)
            ckpt.wait()
    ckpt.close()
    assert _steps(tmp_path) == [5]
    assert _moved_aside(tmp_path) == ["step-000000003"]
    print(sorted(os.listdir(tmp_path)))


def test_fallback_everything_corrupt_keep1(tmp_path: Path):
    _saved(tmp_path, (1,), keep=1).close()
    _damage(tmp_path / "step-000000001" / "model.safetensors")
    ckpt = Checkpointer(tmp_path, _linear(seed=1), keep=1)
    with pytest.raises(CheckpointError, match="every checkpoint"):
        ckpt.restore(fallback=True)
    with pytest.warns(UserWarning, match="damaged"):
        ckpt.save(1)
    ckpt.wait()
    assert _steps(tmp_path) == [1]


def test_two_checkpointers(tmp_path: Path):
    a = _saved(tmp_path, (1, 2))
    b = Checkpointer(tmp_path, _linear(seed=1), keep=3)
    a.save(3)
    a.wait()
    b.save(3)
    with pytest.raises(CheckpointError, match="already committed"):
        b.wait()
    b.save(4)
    b.wait()
    a.save(4)
    with pytest.raises(CheckpointError, match="already committed"):
        a.wait()
    assert _steps(tmp_path) == [2, 3, 4]
    a.save(5)
    a.wait()
    assert _steps(tmp_path) == [3, 4, 5]
