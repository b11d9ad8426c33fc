"""The simulator against timelines worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from ooc.scheduler import BlockProfile, Plan, Profile, build_schedule, preset
from ooc.scheduler.schedule import Op, OpKind, Resource, Schedule
from ooc.scheduler.simulate import simulate

GB = 10**9
HW = dataclasses.replace(preset("v100-16gb"), copy_latency_s=0.0, h2d=1 * GB, d2h=1 * GB, h2d_duplex=0.5 * GB, d2h_duplex=0.5 * GB)


def chain(n: int, fwd: float, bwd: float, saved: int, outside: float = 0.0) -> Profile:
    return Profile(tuple(BlockProfile(f"b{i}", fwd, bwd, saved, saved, saved // 10, saved // 10, 0, 0, 0) for i in range(n)),
                   outside_forward_s=outside)


def test_keep_all_is_the_sum_of_compute() -> None:
    prof = chain(4, 0.01, 0.02, 10**6, outside=0.005)
    result = simulate(build_schedule(Plan.uniform("keep", 4), prof, HW), HW)
    assert result.step_time_s == pytest.approx(4 * 0.03 + 0.005, rel=1e-12)
    assert result.compute_stall_s == 0.0
    assert result.peak_bytes == 4 * 10**6


def test_recompute_adds_one_forward_per_block() -> None:
    prof = chain(3, 0.01, 0.02, 10**6)
    result = simulate(build_schedule(Plan.uniform("recompute", 3), prof, HW), HW)
    assert result.step_time_s == pytest.approx(3 * 0.04, rel=1e-12)


def test_a_copy_longer_than_the_next_forward_is_exposed() -> None:
    # Block 0 swaps 30 MB at 1 GB/s = 30 ms; block 1's forward hides 10 ms of it; the release after
    # block 1 waits 20 ms. In the backward its copy back (30 ms) is issued when block 2's backward
    # starts (prefetch 2) and hides under blocks 2 and 1 (2 x 20 ms): nothing exposed.
    prof = chain(3, 0.01, 0.02, 30 * 10**6)
    plan = Plan.of(["swap", "keep", "keep"], prefetch=2)
    result = simulate(build_schedule(plan, prof, HW), HW)
    assert result.step_time_s == pytest.approx(3 * 0.03 + 0.020, rel=1e-9)
    assert result.compute_stall_s == pytest.approx(0.020, rel=1e-9)


def test_no_prefetch_exposes_the_whole_copy_back() -> None:
    prof = chain(3, 0.01, 0.02, 10 * 10**6)
    plan = Plan.of(["swap", "keep", "keep"], prefetch=0)
    result = simulate(build_schedule(plan, prof, HW), HW)
    # copy out 10 ms hides under block 1's forward; copy back 10 ms waits in full
    assert result.step_time_s == pytest.approx(3 * 0.03 + 0.010, rel=1e-9)


def _manual(ops: tuple[Op, ...]) -> Schedule:
    return Schedule(ops=ops, plan=Plan.uniform("keep", 1), releases_after_forward=((),), releases_before_backward=(),
                    swap_ins_before_backward=((),))


def test_duplex_copies_share_the_link() -> None:
    # In one step's schedule the copies out end before the copies back start; the host optimizer's
    # traffic (gradients out, weights in) is where both directions run at once.
    both = _manual((
        Op(0, OpKind.SWAP_OUT, 0, Resource.D2H, bytes_moved=10 * 10**6),
        Op(1, OpKind.SWAP_IN, 0, Resource.H2D, bytes_moved=10 * 10**6),
    ))
    # 10 MB each way at the 0.5 GB/s duplex rate: 20 ms, not the 10 ms of one direction alone.
    assert simulate(both, HW).step_time_s == pytest.approx(0.020, rel=1e-9)
    staggered = _manual((
        Op(0, OpKind.SWAP_OUT, 0, Resource.D2H, bytes_moved=10 * 10**6),
        Op(1, OpKind.SWAP_IN, 0, Resource.H2D, deps=(0,), bytes_moved=5 * 10**6),
    ))
    assert simulate(staggered, HW).step_time_s == pytest.approx(0.015, rel=1e-9)


def test_compute_slows_while_copies_move_bytes() -> None:
    prof = chain(3, 0.01, 0.02, 5 * 10**6)
    sched = build_schedule(Plan.of(["swap", "keep", "keep"]), prof, HW)
    base = simulate(sched, HW)
    contended = simulate(sched, dataclasses.replace(HW, compute_slowdown=1.0))
    # The 5 ms copy out runs under block 1's forward, which meanwhile does 2.5 ms of its work: 2.5 ms
    # lost; the same for the 5 ms copy back under the backward.
    assert contended.step_time_s == pytest.approx(base.step_time_s + 0.005, rel=1e-9)


def test_timeline_and_memory_curve() -> None:
    prof = chain(3, 0.01, 0.02, 10 * 10**6)
    result = simulate(build_schedule(Plan.of(["swap", "recompute", "keep"]), prof, HW), HW)
    labels = [iv.label for iv in result.timeline]
    assert "swap_out/0" in labels and "swap_in/0" in labels and "recompute/1" in labels
    assert all(iv.end >= iv.start for iv in result.timeline)
    assert max(b for _, b in result.memory) <= result.peak_bytes
    assert result.memory[-1][1] == 0


def test_a_cycle_is_reported() -> None:
    ops = (
        Op(0, OpKind.FORWARD, 0, Resource.COMPUTE, deps=(1,), duration_s=1.0),
        Op(1, OpKind.SWAP_OUT, 0, Resource.D2H, deps=(0,), bytes_moved=10),
    )
    with pytest.raises(ValueError, match="deadlock"):
        simulate(_manual(ops), HW)
