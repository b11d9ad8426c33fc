"""Two ranks, sharded or not, equal one process under HostAdamW's options (tests/ooc/dp_runs.py):
small parameters on a device optimizer (with clipping), the update in step(), accumulation on each rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.ooc.dp_runs import assert_variant_equals_one_process, losses_of, variant_runs, weights_of

pytestmark = pytest.mark.slow

NAMES = ["small-on-device", "clip-small-on-device", "in-step", "accumulate"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dp-variants")
    variant_runs(root, NAMES)
    return root


@pytest.mark.parametrize("variant", [v for v in NAMES if v != "accumulate"])
def test_options_keep_two_ranks_sharded_or_not_equal_to_one_process(runs: Path, variant: str) -> None:
    """Small parameters on a device optimizer (alone, and clipped: their norms count), and the whole
    update in step() (one bucket, no pipeline)."""
    assert_variant_equals_one_process(runs, variant)


def test_accumulation_on_each_rank(runs: Path) -> None:
    """Two ranks accumulating two micro-batches each sum as (a + b) + (c + d); one process
    accumulating four sums ((a + b) + c) + d: the same gradients up to fp32 rounding. Sharded and
    unsharded runs sum alike, so they agree exactly; against one process the losses agree to 1e-5
    relative and the weights to 1e-3 absolute, as in the concatenated-batch test above."""
    two, sharded = weights_of(runs / "accumulate"), weights_of(runs / "accumulate-sharded")
    assert losses_of(runs / "accumulate.json") == losses_of(runs / "accumulate-sharded.json")
    assert all(torch.equal(two[k], sharded[k]) for k in two)
    one = weights_of(runs / "accumulate-one")
    assert max(float((two[k] - one[k]).abs().max()) for k in one) < 1e-3
    losses, reference = losses_of(runs / "accumulate.json"), losses_of(runs / "accumulate-one.json")
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) < 1e-5
