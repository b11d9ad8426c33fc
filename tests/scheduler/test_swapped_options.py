"""Per-tensor swaps in the op-level planner (NOTE [window swaps] in ``ooc.scheduler.oplevel``,
NOTE [swapped cached ops] in ``ooc.scheduler.schedule``): which cached outputs to swap, the
options the chain planner is handed, the plans it makes, and the MILP and LP bound over them."""

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ooc.scheduler import BlockPlan, BlockProfile, Plan, Profile, build_schedule, preset
from ooc.scheduler import optimal as optimal_module
from ooc.scheduler.costmodel import build_options, model_cost, model_peak
from ooc.scheduler.milp import lower_bound, solve_milp
from ooc.scheduler.oplevel import selective_sets, swapped_sets, window_swaps
from ooc.scheduler.plan import Policy
from ooc.scheduler.planners import annotate, op_level
from ooc.scheduler.profile import OpProfile
from ooc.scheduler.schedule import OpKind, block_bytes
from ooc.scheduler.simulate import predict

MiB = 2**20
GB = 1e9
GPT2 = Path(__file__).resolve().parents[2] / "profiles" / "analytic-h100-sxm-gpt2-xl-s1024.json"


def _op(name: str, seconds: float, mib: int, saved: bool = True, cacheable: bool = True) -> OpProfile:
    return OpProfile(name, seconds, mib * MiB, mib * MiB if saved else 0, cacheable)


def synthetic(n: int, ops_per_block: int, seed: int = 0) -> Profile:
    """Blocks of ops that add up to them, with forwards long enough for some outputs to fit the
    window of a ~50 GB/s link and too short for all of them."""
    r, blocks = random.Random(seed), []
    for i in range(n):
        ops = []
        for k in range(ops_per_block):
            out = r.choice([0, r.randint(1, 40), r.randint(1, 40)]) * MiB
            ops.append(OpProfile(f"op{k}", r.choice([0.0, r.uniform(1e-5, 6e-4)]), out, out if r.random() < 0.5 else 0,
                                 r.random() > 0.15))
        saved, inp = sum(o.saved_bytes for o in ops), r.randint(2, 10) * MiB
        fwd = sum(o.forward_s for o in ops) + 1e-5
        blocks.append(BlockProfile(f"b{i}", fwd, 2 * fwd, saved, saved, inp, inp, inp, 0, 0, ops=tuple(ops)))
    return Profile(tuple(blocks), outside_forward_s=2e-3)


def _keep_peak(prof: Profile) -> int:
    return build_schedule(Plan.uniform("keep", len(prof)), prof).peak_bytes


def _budgets(prof: Profile, *shares: float) -> list[int]:
    """Budgets at ``shares`` of the way from the least peak any block-level plan reaches to keep-all's."""
    least = optimal_module.minimum_peak(build_options(prof, preset("h100-sxm")), 2)
    return [int(least + share * (_keep_peak(prof) - least)) for share in shares]


# --- the window rule -------------------------------------------------------------------------


def test_window_takes_the_most_seconds_per_byte_first_and_fits_the_rest_first_fit():
    # At 1 GB/s a 10 ms window moves 10 MB (~9.5 MiB): 4 MiB (3 s/GB... the best per byte), then
    # 8 MiB no longer fits, 5 MiB does; op 4 is the block's output.
    ops = (_op("a", 2e-4, 8), _op("b", 4e-4, 4), _op("c", 1e-4, 5), _op("d", 1e-5, 1), _op("out", 1.0, 1))
    chosen = window_swaps(ops, (0, 1, 2, 3), window_s=10e-3, bandwidth=1 * GB)
    assert chosen == (1, 2)
    # The link's latency and what the block already moves (its input) come off the window first.
    assert window_swaps(ops, (0, 1, 2, 3), window_s=10e-3, bandwidth=1 * GB, taken_s=5e-3) == (1,)
    assert window_swaps(ops, (0, 1, 2, 3), window_s=10e-3, bandwidth=1 * GB, latency_s=9e-3) == ()
    # Only cached ops are candidates.
    assert window_swaps(ops, (0, 3), window_s=10e-3, bandwidth=1 * GB) == (0, 3)


def test_an_op_slower_to_rerun_than_to_copy_is_swapped_past_the_window():
    # 8 MiB takes 8.4 ms each way at 1 GB/s: an op of 20 ms is worth the exposed copies, one of 10 ms not.
    ops = (_op("slow", 20e-3, 8), _op("fast", 10e-3, 8), _op("out", 0.0, 1))
    assert window_swaps(ops, (0, 1), window_s=0.0, bandwidth=1 * GB) == (0,)


def test_the_blocks_last_op_and_ops_without_storage_are_never_swapped():
    ops = (_op("view", 1e-3, 0), _op("mm", 1e-3, 1), _op("out", 1.0, 1))
    assert window_swaps(ops, (0, 1, 2), window_s=1.0, bandwidth=1 * GB) == (1,)
    # Over random blocks, no variant the planner is handed swaps a block's last op.
    prof, hw = synthetic(30, 12, seed=4), preset("h100-sxm")
    opts = build_options(prof, hw, selective=4, selective_swaps=3)
    swapped = [(i, opts.choice(i, k)) for i in range(opts.n) for k in range(opts.m) if opts.allows(i, k)]
    assert any(c.swapped_ops for _, c in swapped)
    for i, c in swapped:
        assert len(prof.blocks[i].ops) - 1 not in c.swapped_ops
        assert set(c.swapped_ops) <= set(c.cached_ops)


def test_ops_a_measured_profile_marks_returned_are_never_swapped_and_the_last_op_may_be():
    """A measured profile marks the ops whose outputs the block returns (``OpProfile.returned``):
    the window skips those instead of the last op (a block returning a view of an earlier op's
    output ends with the view)."""
    ops = (_op("mm", 1e-3, 1), _op("out", 1e-3, 2), _op("tail", 1e-3, 1))
    returned = tuple(OpProfile(o.name, o.forward_s, o.output_bytes, o.saved_bytes, o.cacheable, returned=(k == 1))
                     for k, o in enumerate(ops))
    assert window_swaps(ops, (0, 1, 2), window_s=1.0, bandwidth=1 * GB) == (0, 1)
    assert window_swaps(returned, (0, 1, 2), window_s=1.0, bandwidth=1 * GB) == (0, 2)
    prof = Profile.from_dict(Profile((BlockProfile("b", 3e-3, 6e-3, 4 * MiB, 4 * MiB, MiB, MiB, MiB, 0, 0, ops=returned),),
                                     ).to_dict())
    assert [op.returned for op in prof.blocks[0].ops] == [False, True, False]



def test_without_marks_the_last_op_that_creates_a_storage_is_taken_as_returned():
    """A profile measured before ``OpProfile.returned`` (or hand-written) of a block that returns a
    view of its residual add: the view creates no storage, so the add is the output the runtime
    would refuse to swap."""
    ops = (_op("mm", 1e-3, 1), _op("add", 1e-3, 1), OpProfile("view", 1e-6, 0, 0, cacheable=False))
    assert window_swaps(ops, (0, 1), window_s=1.0, bandwidth=1 * GB) == (0,)
    sets = selective_sets(ops, 4)
    assert all(1 not in v.swapped for v in swapped_sets(ops, sets, 3, window_s=1.0, bandwidth=1 * GB))


def test_swapped_sets_beat_the_unswapped_points_holding_as_little():
    r = random.Random(3)
    for _ in range(20):
        ops = tuple(_op(f"op{k}", r.uniform(1e-5, 5e-4), r.randint(1, 40), r.random() < 0.5) for k in range(15))
        sets = selective_sets(ops, 4)
        variants = swapped_sets(ops, sets, 3, window_s=2e-3, bandwidth=25 * GB)
        assert len(variants) <= 3
        assert [v.resident for v in variants] == sorted({v.resident for v in variants})
        plain = [(0, 0.0)] + [(s.bytes, s.saved_s) for s in sets]
        for v in variants:
            assert v.resident == v.cached.bytes - sum(ops[k].output_bytes for k in v.swapped)
            assert v.cached.saved_s > max(s for b, s in plain if b <= v.resident)


# --- the options agree with the schedule -----------------------------------------------------


@pytest.mark.parametrize("seed, intercept", [(0, 0.0), (1, 0.0), (2, 0.0), (0, 3e-5), (1, 3e-5)])
def test_each_option_is_what_the_schedule_makes_of_its_single_block_plan(seed, intercept):
    """Every option of every block, as the one non-KEEP block of a plan: the model's peak is the
    schedule's, its bytes are ``block_bytes``'s, its copy times the SWAP_OUT/SWAP_IN durations,
    and the compute it adds is what the schedule's compute ops add over keep-all (with what
    recording and replaying a selective block's ops costs, ``op_intercept_s``, or without)."""
    prof, hw = synthetic(6, 10, seed=seed), replace(preset("h100-sxm"), op_intercept_s=intercept)
    opts = build_options(prof, hw, selective=4)
    keep_compute = sum(op.duration_s for op in build_schedule(Plan.uniform("keep", 6), prof, hw).ops
                       if op.resource.value == "compute")
    checked = 0
    for i in range(opts.n):
        for k in range(opts.m):
            if not opts.allows(i, k):
                continue
            picks = [0] * opts.n
            picks[i] = k
            plan = opts.plan(picks, prefetch=2, min_swap_bytes=prof.min_swap_bytes, name="x")
            schedule = build_schedule(plan, prof, hw)
            assert model_peak(opts, picks, 2) == schedule.peak_bytes
            b = block_bytes(plan.blocks[i], prof.blocks[i])
            assert (opts.A[i, k], opts.X[i, k], opts.backward_extra[i, k]) == (b.forward_alloc, b.swapped, b.recompute_alloc)
            ops = {op.kind: op for op in schedule.ops if op.block == i}
            assert opts.t_out[i, k] == pytest.approx(ops[OpKind.SWAP_OUT].duration_s if OpKind.SWAP_OUT in ops else 0.0, rel=1e-12)
            assert opts.t_in[i, k] == pytest.approx(ops[OpKind.SWAP_IN].duration_s if OpKind.SWAP_IN in ops else 0.0, rel=1e-12)
            compute = sum(op.duration_s for op in schedule.ops if op.resource.value == "compute")
            assert opts.recompute_s[i, k] == pytest.approx(compute - keep_compute, rel=1e-9, abs=1e-15)
            checked += bool(plan.blocks[i].swapped_ops)
    assert checked >= 3  # the swapped variants were among them


def test_random_plans_with_swapped_options_peak_where_the_model_says():
    prof, hw = synthetic(14, 12, seed=8), preset("h100-sxm")
    opts = build_options(prof, hw, selective=4, selective_swaps=3)
    r = np.random.default_rng(1)
    for _ in range(30):
        picks = [int(r.choice(np.flatnonzero(opts.allowed[i]))) for i in range(opts.n)]
        plan = opts.plan(picks, prefetch=2, min_swap_bytes=prof.min_swap_bytes, name="x")
        assert model_peak(opts, picks, 2) == build_schedule(plan, prof).peak_bytes == predict(plan, prof, hw).peak_bytes
        assert opts.picks_of(plan) == picks


def test_no_swapped_variants_without_a_window_or_when_asked_for_none():
    prof, hw = synthetic(5, 10, seed=2), preset("h100-sxm")
    with_swaps = build_options(prof, hw, selective=4, selective_swaps=2)
    assert with_swaps.m == 4 + 8 + 4
    assert build_options(prof, hw, selective=4, selective_swaps=0).m == 4 + 8
    assert build_options(prof, None, selective=4).m == 4 + 8  # bytes only: no time to hide copies in


# --- plans -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_op_level_plans_with_swapped_options_fit_under_the_simulator(seed):
    prof, hw = synthetic(16, 14, seed=20 + seed), preset("h100-sxm")
    for budget in _budgets(prof, 0.5, 0.2, 0.02):
        plan = op_level(prof, hw, budget)
        assert predict(plan, prof, hw).peak_bytes <= budget
        assert build_schedule(plan, prof).peak_bytes <= budget


def test_when_the_dp_cannot_fit_the_lagrangian_plan_does(monkeypatch):
    """The DP's bucketed budget (NOTE [bucketed budget]) made to miss every time: ``solve_options`` falls
    back to the Lagrangian plan, which meets the exact peak, instead of giving up."""
    prof, hw = synthetic(10, 12, seed=5), preset("h100-sxm")
    opts = build_options(prof, hw, selective=4)
    (budget,) = _budgets(prof, 0.5)  # (the Lagrangian plan prices resident bytes only: it cannot reach the least peak)
    monkeypatch.setattr(optimal_module, "solve_dp", lambda opts, target, prefetch, buckets: [0] * opts.n)
    picks = optimal_module.solve_options(opts, budget, 2, exact_blocks=200)
    assert picks is not None and model_peak(opts, picks, 2) <= budget


def test_planned_swapped_ops_survive_json_and_show_in_the_label():
    prof, hw = Profile.load(GPT2), preset("h100-sxm")
    plan = annotate(op_level(prof, hw, int(_keep_peak(prof) * 0.1)), prof)
    swapped = [b for b in plan.blocks if b.swapped_ops]
    assert len(swapped) >= len(plan) // 4
    assert Plan.from_json(plan.to_json()) == plan
    b = swapped[0]
    assert f"cache {len(b.cached_ops)} ops, swap {len(b.swapped_ops)}" in b.label()


def test_annotate_takes_swapped_outputs_off_the_device_bytes():
    ops = (_op("mm", 6e-4, 2), _op("gelu", 1e-4, 3, saved=False), _op("out", 1e-4, 1))
    prof = Profile((BlockProfile("b", 1e-3, 2e-3, 6 * MiB, 6 * MiB, MiB, MiB, MiB, 0, 0, ops=ops),) * 2)
    cached = BlockPlan(Policy.RECOMPUTE, cached_ops=(0, 1))
    swapped = BlockPlan(Policy.RECOMPUTE, cached_ops=(0, 1), swapped_ops=(1,))
    both = BlockPlan(Policy.RECOMPUTE, swap_input=True, cached_ops=(0, 1), swapped_ops=(0, 1))
    device = [annotate(Plan.of([c, "keep"]), prof).blocks[0].device_bytes for c in (cached, swapped, both)]
    assert device == [MiB + 5 * MiB, MiB + 2 * MiB, 0]


# --- exact solvers ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_dp_matches_the_milp_with_swapped_options(seed):
    prof, hw = synthetic(8, 10, seed=40 + seed), preset("h100-sxm")
    opts = build_options(prof, hw, selective=3, selective_swaps=2)
    for budget in _budgets(prof, 0.5, 0.2, 0.05):
        picks = optimal_module.solve_options(opts, budget, 2, exact_blocks=200)
        milp_picks, milp_cost = solve_milp(opts, budget, 2)
        assert model_peak(opts, milp_picks, 2) <= budget
        assert model_cost(opts, milp_picks, 2) == pytest.approx(milp_cost, rel=1e-6, abs=1e-12)
        assert model_peak(opts, picks, 2) <= budget
        assert model_cost(opts, picks, 2) <= milp_cost * 1.01 + 1e-9


@pytest.mark.parametrize("seed", range(3))
def test_lp_bound_is_below_the_milp_optimum_and_every_plan(seed):
    prof, hw = synthetic(8, 10, seed=60 + seed), preset("h100-sxm")
    opts = build_options(prof, hw, selective=3, selective_swaps=2)
    for budget in _budgets(prof, 0.5, 0.2, 0.05):
        bound = lower_bound(opts, budget, 2)
        _, milp_cost = solve_milp(opts, budget, 2)
        assert bound is not None and 0.0 <= bound <= milp_cost + 1e-12
        plan = op_level(prof, hw, budget, options_per_block=3)
        assert bound <= model_cost(opts, opts.picks_of(plan), 2) + 1e-12
    assert lower_bound(opts, 1, 2) is None  # not even a fraction of a plan fits 1 byte


def test_swaps_move_the_gpt2_xl_plan_toward_its_bound_at_10_percent():
    """The figures of ``benchmarks/bench_oplevel.py``: at 10% of the keep-all activations the
    swapped cached outputs take the op-level plan from 1.215x to 1.205x the in-core step, within
    0.1% of the LP bound (1.204x) on any plan over these options."""
    prof, hw = Profile.load(GPT2), preset("h100-sxm")
    keep = Plan.uniform("keep", len(prof))
    ideal = predict(keep, prof, hw).step_time_s
    budget = int(_keep_peak(prof) * 0.1)
    without = predict(op_level(prof, hw, budget, swapped_per_block=0), prof, hw).step_time_s / ideal
    plan = op_level(prof, hw, budget)
    ratio = predict(plan, prof, hw).step_time_s / ideal
    bound = 1 + lower_bound(build_options(prof, hw, selective=4), budget, 2) / ideal
    assert ratio < without - 0.005
    assert bound <= ratio <= bound * 1.002


def test_columns_no_block_may_take_leave_the_dps_answer_unchanged():
    """7B flash blocks fill fewer selective slots than there are: the DP runs without those columns
    (a smaller state) and gives the plan it gives with them, in the full options' numbering."""
    prof = Profile.load(GPT2.parent / "analytic-h100-sxm-decoder-7b-s4096-flash.json")
    opts = build_options(prof, preset("h100-sxm"), selective=4)
    assert not opts.allowed.any(axis=0).all()
    budget = int(_keep_peak(prof) * 0.25)
    picks = optimal_module.solve_options(opts, budget, 2, exact_blocks=200)
    assert picks == optimal_module._solve_all(opts, budget, 2, exact_blocks=200)
    assert all(opts.allows(i, k) for i, k in enumerate(picks))
