"""The step-time bound of any per-tensor keep/swap/recompute plan (NOTE [any plan's reach]): by hand on
one block, below every plan the planners make, and monotone in the budget."""

import random
from dataclasses import replace
from pathlib import Path

import pytest

from ooc.scheduler import BlockProfile, Plan, Profile, build_schedule, preset
from ooc.scheduler.planners import PLANNERS
from ooc.scheduler.profile import OpProfile
from ooc.scheduler.reach import any_plan_step_bound, block_choices
from ooc.scheduler.simulate import predict
from tests.scheduler.test_oplevel import synthetic

PROFILES = Path(__file__).resolve().parents[2] / "profiles"


def _one_block() -> Profile:
    """A matmul (1 ms, 100 B saved) and a ReLU (0.1 ms, 1000 B saved) after it; 10 B of input."""
    ops = (OpProfile("mm", 1e-3, 100, 100, reads=()), OpProfile("relu", 1e-4, 1000, 1000, reads=(0,)))
    return Profile((BlockProfile("b", 1.1e-3, 2.2e-3, 1110, 1110, 10, 10, 10, 0, 0, ops=ops),))


def _link(bytes_per_s: float):
    return replace(preset("h100-sxm"), h2d=bytes_per_s, d2h=bytes_per_s, h2d_duplex=bytes_per_s, d2h_duplex=bytes_per_s)


def test_one_block_by_hand():
    prof = _one_block()
    # KEEP; a plain re-run; the matmul cached (the re-run runs the ReLU alone); the ReLU cached; both.
    assert sorted(block_choices(prof.blocks[0])) == sorted([(1110, 0.0), (10, pytest.approx(1.1e-3)), (110, pytest.approx(1e-4)),
                                                            (1010, pytest.approx(1e-3)), (1110, pytest.approx(0.0))])
    no_link = _link(1e-9)
    compute = 3.3e-3
    assert any_plan_step_bound(prof, no_link, 2000) == pytest.approx(compute)
    assert any_plan_step_bound(prof, no_link, 110) == pytest.approx(compute + 1e-4)
    # Half of the blocks' worth caching the matmul, half re-running plainly (the LP relaxation).
    assert any_plan_step_bound(prof, no_link, 60) == pytest.approx(compute + 0.5 * 1.1e-3 + 0.5 * 1e-4)
    assert any_plan_step_bound(prof, no_link, 5) is None  # not even the input fits
    # 1 MB/s moves 1100 B in the 1.1 ms forward: everything kept, 1100 B swapped out.
    link = _link(1e6)
    assert any_plan_step_bound(prof, link, 10) == pytest.approx(compute)
    # 5 B more than the link moves in the forward: a stall costs 1 us a byte, caching the matmul alone
    # 0.1 us a byte (1000 B for 0.1 ms), so 0.5% of the block does that.
    assert any_plan_step_bound(prof, link, 5) == pytest.approx(compute + 0.005 * 1e-4)
    # 0.1 MB/s moves 110 B in the forward: 1% of the block kept whole (1110 B held) and 99% caching
    # the matmul alone (110 B) hold 120 B, 10 more than the link moves.
    slow = _link(1e5)
    assert any_plan_step_bound(prof, slow, 10) == pytest.approx(compute + 0.99 * 1e-4)


def test_a_block_without_op_detail_or_with_too_many_ops_gives_no_bound():
    prof = _one_block()
    plain = Profile((replace(prof.blocks[0], ops=()),))
    assert any_plan_step_bound(plain, preset("h100-sxm"), 10**9) is None
    assert any_plan_step_bound(prof, preset("h100-sxm"), 10**9, max_candidates=1) is None


def _fitting_plans(prof: Profile, hw, budget: int) -> list[tuple[str, Plan]]:
    plans = []
    for name, planner in PLANNERS.items():
        try:
            plan = planner(prof, hw, budget)
        except ValueError:
            continue
        if build_schedule(plan, prof).peak_bytes <= budget:
            plans.append((name, plan))
    return plans


@pytest.mark.parametrize("model", ["gpt2-xl-s1024", "gpt2-xl-s1024-flash", "decoder-7b-s4096", "wrn-28-10-b512"])
def test_no_planner_beats_the_bound_on_the_presets(model):
    hw = preset("h100-sxm")
    prof = Profile.load(PROFILES / f"analytic-h100-sxm-{model}.json")
    keep_peak = build_schedule(Plan.uniform("keep", len(prof)), prof).peak_bytes
    for fraction in (1.0, 0.5, 0.25, 0.1):
        budget = int(keep_peak * fraction)
        bound = any_plan_step_bound(prof, hw, budget)
        plans = _fitting_plans(prof, hw, budget)
        if bound is None:
            assert not plans, [name for name, _ in plans]
            continue
        for name, plan in plans:
            assert predict(plan, prof, hw).step_time_s >= bound * (1 - 1e-9), (model, fraction, name)
        if fraction == 1.0:
            assert predict(Plan.uniform("keep", len(prof)), prof, hw).step_time_s == pytest.approx(bound, rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_no_planner_beats_the_bound_on_random_chains(seed):
    prof = synthetic(5, 9, seed)
    hw = preset(random.Random(seed).choice(["h100-sxm", "v100-16gb"]))
    keep_peak = build_schedule(Plan.uniform("keep", len(prof)), prof).peak_bytes
    last = None
    for fraction in (0.9, 0.6, 0.4, 0.25):
        budget = int(keep_peak * fraction)
        bound = any_plan_step_bound(prof, hw, budget)
        for name, plan in _fitting_plans(prof, hw, budget):
            assert bound is not None and predict(plan, prof, hw).step_time_s >= bound * (1 - 1e-9), (seed, fraction, name)
        if bound is not None and last is not None:
            assert bound >= last * (1 - 1e-12)  # less memory never makes the bound lower
        last = bound


@pytest.mark.parametrize("link", ["cpu", "none"])
def test_no_plan_beats_the_bound_on_a_measured_resnet_with_shared_storages(link):
    """A measured op-level profile (each ResNet block saves the input the block before returned:
    storages shared between blocks, counted once by the schedule); the planners' plans and random
    per-op plans at the budgets they reach. Without a link no swap makes room: counted per block,
    the shared storages put keep-all's own peak out of its reach."""
    from tests.helpers import image_op_profile, random_selective_plan, small_resnet

    prof = image_op_profile(small_resnet())
    assert any(block.shared for block in prof.blocks)
    hw = preset("cpu")
    if link == "none":
        hw = replace(hw, h2d=1e-9, d2h=1e-9, h2d_duplex=1e-9, d2h_duplex=1e-9)
    rng = random.Random(0)
    plans = [plan for _, plan in _fitting_plans(prof, hw, 10**12)]
    plans += [random_selective_plan(prof, rng) for _ in range(40)]
    for plan in plans:
        peak = build_schedule(plan, prof).peak_bytes
        bound = any_plan_step_bound(prof, hw, peak)
        assert bound is not None and predict(plan, prof, hw).step_time_s >= bound * (1 - 1e-9), plan
