"""Twenty two-rank runs killed with SIGKILL at random moments, each resumed (tests/ooc/train_runs.py
``kill_trials``): in a file of their own, beside the one-rank trials of test_checkpoint_cli.py, so
that the slow lane's two workers (``--dist loadfile``) each take one set."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ooc.train_runs import kill_trials, reference_two_run


@pytest.fixture(scope="module")
def reference_two(tmp_path_factory) -> tuple[Path, list[float]]:  # noqa: ANN001
    return reference_two_run(tmp_path_factory.mktemp("ref2"))


@pytest.mark.slow
def test_kill_9_of_two_ranks_then_resume_is_exact_many(tmp_path: Path, reference_two) -> None:  # noqa: ANN001
    kill_trials(tmp_path, reference_two, trials=20, seed=1, world=2)
