"""Review checks: the planner's selective options are priced as the schedule prices their plans."""

from dataclasses import replace

import pytest

from ooc.scheduler import Profile, preset
from ooc.scheduler.analytic import gpt2_xl
from ooc.scheduler.costmodel import build_options
from ooc.scheduler.oplevel import rerun_saved_s, rerun_skipped

HW = preset("h100-sxm")


def test_blocks_that_differ_only_in_what_their_ops_read_get_their_own_options():
    """Two blocks with the same op numbers, one whose profile records no ``reads`` (its forward ran
    a kernel no dispatch showed): the second's options are its own, not the first's (whose re-run
    would skip ops the second's does not), and priced as the schedule prices them."""
    b = gpt2_xl(1024, 8, HW).blocks[1]
    blind = replace(b, name="blind", ops=tuple(replace(op, reads=None) for op in b.ops))
    prof = Profile((b, blind), outside_forward_s=1e-3)
    opts = build_options(prof, HW, selective=4)
    checked = 0
    for i, block in enumerate(prof.blocks):
        for k in range(len(opts.choices), opts.m):
            if not opts.allows(i, k):
                continue
            c = opts.choice(i, k)
            skipped = rerun_saved_s(block.ops, c.cached_ops)
            assert opts.comp[i, k] == pytest.approx(block.backward_s + max(0.0, block.forward_s - skipped), rel=1e-12), \
                (block.name, c.cached_ops)
            checked += 1
    assert checked
    # Not vacuous: the first block's options rely on skipping.
    assert any(rerun_skipped(b.ops, opts.choice(0, k).cached_ops) for k in range(len(opts.choices), opts.m)
               if opts.allows(0, k))
