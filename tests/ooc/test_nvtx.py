from __future__ import annotations

import torch

import ooc
from ooc import nvtx
from ooc.models import GPT
from tests.helpers import NANO, gpt_batch


def test_one_step_has_the_expected_ranges_and_nesting() -> None:
    torch.manual_seed(0)
    model = GPT(NANO)
    plan = ooc.Plan.of(["swap", "recompute", "keep", "swap"], min_swap_bytes=1024, prefetch=1)
    ooc.wrap(model, plan, backend="cpu")
    try:
        with nvtx.record() as rec:
            model(*gpt_batch())[1].backward()
    finally:
        ooc.unwrap(model)
    names = rec.names()
    for i in range(4):
        assert f"ooc/fwd/blocks.{i}" in names
        assert f"ooc/bwd/blocks.{i}" in names
    assert "ooc/recompute/blocks.1" in names
    assert "ooc/swap_out/blocks.0" in names and "ooc/swap_out/blocks.3" in names
    assert "ooc/swap_in/blocks.0" in names and "ooc/swap_in/blocks.3" in names
    parents = {(r.name, r.parent) for r in rec.ranges}
    assert ("ooc/swap_out/blocks.0", "ooc/fwd/blocks.0") in parents
    assert ("ooc/recompute/blocks.1", "ooc/bwd/blocks.1") in parents
    # prefetch=1: block 0 comes back when block 1's backward starts
    assert ("ooc/swap_in/blocks.0", "ooc/bwd/blocks.1") in parents
    # backward ranges run from the last block to the first, none left open
    bwd = [r for r in rec.ranges if r.name.startswith("ooc/bwd/")]
    assert [r.name for r in bwd] == [f"ooc/bwd/blocks.{i}" for i in (3, 2, 1, 0)]
    assert all(r.end is not None for r in rec.ranges)
    assert all(a.end <= b.start for a, b in zip(bwd, bwd[1:]))


def test_ranges_work_without_a_recorder() -> None:
    with nvtx.range("ooc/test"):
        pass
    nvtx.start("ooc/test2").end()
