"""Op-level planning (NOTE [op-level options]): the exact frontier, the options it hands the chain
planner, and the schedule, cost model and ``op-level`` planner that use them."""

import itertools
import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ooc.scheduler import BlockPlan, BlockProfile, Plan, Profile, build_schedule, preset
from ooc.scheduler.costmodel import build_options, model_cost, model_peak
from ooc.scheduler.errors import HardwareError, InfeasibleBudget, PlanError
from ooc.scheduler.hardware import Hardware
from ooc.scheduler.milp import solve_milp
from ooc.scheduler.oplevel import hull_prefixes, pareto_frontier, selective_sets, upper_hull
from ooc.scheduler.plan import Policy
from ooc.scheduler.planners import PLANNERS, annotate, op_level, optimal
from ooc.scheduler.profile import OpProfile
from ooc.scheduler.schedule import OpKind
from ooc.scheduler.simulate import predict

MiB = 2**20
GPT2 = Path(__file__).resolve().parents[2] / "profiles" / "analytic-h100-sxm-gpt2-xl-s1024.json"


def _ops(r: random.Random, k: int) -> tuple[OpProfile, ...]:
    ops = []
    for j in range(k):
        out = r.choice([0, r.randint(1, 40) * MiB, r.randint(1, 40) * MiB])
        saved = out if r.random() < 0.5 else 0
        ops.append(OpProfile(f"op{j}", r.choice([0.0, r.uniform(1e-6, 1e-4)]), out, saved, r.random() > 0.15))
    return tuple(ops)


def synthetic(n: int, ops_per_block: int, seed: int = 0) -> Profile:
    """Blocks whose ops add up to them (saved bytes, forward time), all different."""
    r, blocks = random.Random(seed), []
    for i in range(n):
        ops = _ops(r, ops_per_block)
        saved, inp = sum(o.saved_bytes for o in ops), r.randint(2, 10) * MiB
        fwd = sum(o.forward_s for o in ops) + 1e-5
        blocks.append(BlockProfile(f"b{i}", fwd, 2 * fwd, saved, saved, inp, inp, inp, 0, 0, ops=ops))
    return Profile(tuple(blocks), outside_forward_s=2e-3)


@pytest.mark.parametrize("seed", range(8))
def test_frontier_is_the_brute_force_pareto_set(seed):
    ops = _ops(random.Random(seed), 11)
    subsets = [c for k in range(len(ops) + 1) for c in itertools.combinations(range(len(ops)), k)
               if all(ops[j].cacheable for j in c)]
    points = {(sum(ops[j].output_bytes for j in c), round(sum(ops[j].forward_s for j in c), 15)) for c in subsets}
    pareto = sorted(p for p in points if not any(q != p and q[0] <= p[0] and q[1] >= p[1] for q in points))
    frontier = pareto_frontier(ops)
    assert [(p.bytes, round(p.saved_s, 15)) for p in frontier] == pareto
    for p in frontier:
        assert p.bytes == sum(ops[j].output_bytes for j in p.ops)
        assert p.saved_s == pytest.approx(sum(ops[j].forward_s for j in p.ops), rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_sorted_prefixes_are_the_frontiers_hull(seed):
    ops = _ops(random.Random(100 + seed), 24)
    exact = upper_hull(pareto_frontier(ops))
    assert [(p.bytes, p.ops) for p in upper_hull(hull_prefixes(ops))] == [(p.bytes, p.ops) for p in exact]


def test_selective_sets_are_few_cacheable_and_spread():
    ops = _ops(random.Random(7), 50)
    sets = selective_sets(ops, 4)
    assert 1 <= len(sets) <= 4
    assert all(s.ops and all(ops[j].cacheable for j in s.ops) for s in sets)
    assert [s.bytes for s in sets] == sorted({s.bytes for s in sets})
    free = {j for j, op in enumerate(ops) if op.cacheable and op.output_bytes == 0 and op.forward_s > 0}
    assert all(free <= set(s.ops) for s in sets)
    assert selective_sets((OpProfile("dropout", 1e-4, MiB, 0, cacheable=False),), 4) == ()


def _block(ops):
    return BlockProfile("b", 1e-3, 2e-3, 6 * MiB, 6 * MiB, MiB, MiB, MiB, 0, 0, ops=ops)


OPS = (OpProfile("mm", 6e-4, 2 * MiB, 2 * MiB), OpProfile("gelu", 1e-4, 3 * MiB, 0),
       OpProfile("dropout", 3e-4, 4 * MiB, 4 * MiB, cacheable=False))


def test_schedule_models_a_selective_recompute_as_the_contract_says():
    prof = Profile((_block(OPS),) * 2)
    hw = preset("h100-sxm")
    plain = build_schedule(Plan.of(["recompute", "keep"]), prof, hw)
    cached = build_schedule(Plan.of([BlockPlan(Policy.RECOMPUTE, cached_ops=(0, 1)), "keep"]), prof, hw)
    first = lambda s, kind: next(op for op in s.ops if op.kind is kind and op.block == 0)  # noqa: E731
    # Held from the forward: the input plus the cached outputs; the re-run allocates the saved bytes
    # less the cached outputs autograd saves; at backward: input + saved + cached-but-unsaved.
    assert first(cached, OpKind.FORWARD).alloc_bytes == MiB + 5 * MiB
    assert first(cached, OpKind.RECOMPUTE).alloc_bytes == 6 * MiB - 2 * MiB
    assert first(cached, OpKind.BACKWARD).free_bytes == MiB + 6 * MiB + 3 * MiB
    assert first(plain, OpKind.RECOMPUTE).duration_s == pytest.approx(1e-3)
    assert first(cached, OpKind.RECOMPUTE).duration_s == pytest.approx(1e-3 - 7e-4)
    at_rerun = lambda s: s.memory_after_op[first(s, OpKind.RECOMPUTE).index]  # noqa: E731
    assert at_rerun(plain) == MiB + 6 * MiB
    assert at_rerun(cached) == MiB + 6 * MiB + 3 * MiB  # the cached outputs autograd does not save stay
    assert cached.peak_bytes == MiB + 5 * MiB + 6 * MiB  # block 0's input and cache, block 1 kept
    annotated = annotate(cached.plan, prof)
    assert annotated.blocks[0].device_bytes == MiB + 5 * MiB


@pytest.mark.parametrize("cached, message", [((3,), "not among its 3"), ((2,), "cannot be cached")])
def test_a_cached_op_the_profile_does_not_allow_is_a_plan_error(cached, message):
    with pytest.raises(PlanError, match=message):
        build_schedule(Plan.of([BlockPlan(Policy.RECOMPUTE, cached_ops=cached)]), Profile((_block(OPS),)))


def test_cost_model_follows_the_schedule_for_selective_options():
    prof, hw = synthetic(12, 20, seed=3), preset("h100-sxm")
    opts = build_options(prof, hw, selective=4)
    assert opts.m == 4 + 8 + 4 and opts.selective is not None  # 4: swapped variants (selective_swaps=2, with and without the input)
    r = np.random.default_rng(0)
    for _ in range(20):
        picks = [int(r.choice(np.flatnonzero(opts.allowed[i]))) for i in range(opts.n)]
        plan = opts.plan(picks, prefetch=2, min_swap_bytes=prof.min_swap_bytes, name="x")
        assert model_peak(opts, picks, 2) == build_schedule(plan, prof).peak_bytes
        assert opts.picks_of(plan) == picks
        incore = predict(Plan.uniform("keep", len(prof)), prof, hw).step_time_s
        # The additive model charges the re-run exactly what the schedule runs (no copies to hide here
        # when nothing swaps).
        if not any(b.swaps_anything for b in plan.blocks):
            assert incore + model_cost(opts, picks, 2) == pytest.approx(predict(plan, prof, hw).step_time_s, rel=1e-9)


@pytest.mark.parametrize("intercept, issue", [(3e-5, 0.0), (3e-5, 1e-5), (1e-4, 2e-6), (3e-6, 5e-5)])
def test_cost_model_follows_the_schedule_where_the_host_runs_ahead(intercept, issue):
    """NOTE [host time under the kernels]: ``Hardware.intercept_s`` is not additive in the ops (a
    max against the block's kernels, which depend on the ops the re-run skips); the planner's arrays
    and the schedule's RECOMPUTE still price every selective block alike, plans of many at once."""
    prof = synthetic(12, 20, seed=3)
    hw = replace(preset("h100-sxm"), op_intercept_s=intercept, op_issue_s=issue)
    assert hw.host_runs_ahead
    opts = build_options(prof, hw, selective=4, selective_swaps=0)
    base = [int(np.flatnonzero(opts.allowed[i])[0]) for i in range(opts.n)]

    def swaps_nothing(i: int, k: int) -> bool:  # the additive model is exact where no copy is hidden
        picks = base[:i] + [k] + base[i + 1:]
        return not opts.plan(picks, prefetch=2, min_swap_bytes=prof.min_swap_bytes, name="x").blocks[i].swaps_anything

    choices = [[int(k) for k in np.flatnonzero(opts.allowed[i]) if swaps_nothing(i, int(k))] for i in range(opts.n)]
    incore = predict(Plan.uniform("keep", len(prof)), prof, hw).step_time_s
    r = np.random.default_rng(0)
    for _ in range(20):
        picks = [int(r.choice(choices[i])) for i in range(opts.n)]
        plan = opts.plan(picks, prefetch=2, min_swap_bytes=prof.min_swap_bytes, name="x")
        assert sum(bool(b.cached_ops) for b in plan.blocks) >= 2
        assert incore + model_cost(opts, picks, 2) == pytest.approx(predict(plan, prof, hw).step_time_s, rel=1e-9)


def test_hardware_json_written_before_the_host_fields_loads_as_the_cpu_model():
    """A description saved before ``op_issue_s`` and ``host_runs_ahead`` existed loads with them off
    (then the whole interception counts, as the model did; GPU ones had ``op_intercept_s`` 0)."""
    data = json.loads(preset("h100-sxm").to_json())
    for name in ("op_issue_s", "host_runs_ahead"):
        del data[name]
    hw = Hardware.from_dict(data)
    assert (hw.op_issue_s, hw.host_runs_ahead) == (0.0, False)
    assert replace(hw, op_intercept_s=1e-5).intercept_s(10, 1.0) == pytest.approx(1e-4, rel=1e-12)


def test_op_level_without_op_detail_is_optimal(make_profile):
    prof, hw = make_profile(10, seed=1), preset("h100-sxm")
    keep = build_schedule(Plan.uniform("keep", 10), prof).peak_bytes
    assert op_level(prof, hw, keep // 3).blocks == optimal(prof, hw, keep // 3).blocks


def test_op_level_dp_matches_the_milp():
    prof, hw = synthetic(10, 12, seed=5), preset("h100-sxm")
    opts = build_options(prof, hw, selective=4)
    keep = build_schedule(Plan.uniform("keep", 10), prof).peak_bytes
    for fraction in (0.6, 0.3):
        budget = int(keep * fraction)
        plan = op_level(prof, hw, budget)
        assert build_schedule(plan, prof).peak_bytes <= budget
        _, milp_cost = solve_milp(opts, budget, 2)
        dp_cost = model_cost(opts, opts.picks_of(plan), 2)
        assert dp_cost <= milp_cost * 1.01 + 1e-6


def _gpt2_ratios(fraction):
    prof, hw = Profile.load(GPT2), preset("h100-sxm")
    keep = build_schedule(Plan.uniform("keep", len(prof)), prof).peak_bytes
    ideal = predict(Plan.uniform("keep", len(prof)), prof, hw).step_time_s
    budget = int(keep * fraction)
    out = {}
    for name in ("optimal", "op-level"):
        plan = PLANNERS[name](prof, hw, budget)
        assert build_schedule(plan, prof).peak_bytes <= budget
        out[name] = (plan, predict(plan, prof, hw).step_time_s / ideal)
    return out


@pytest.mark.parametrize("fraction, block_level, op_level_at_most", [(0.5, 1.158, 1.10), (0.25, 1.237, 1.15), (0.1, 1.288, 1.25)])
def test_op_level_beats_block_level_on_gpt2_xl(fraction, block_level, op_level_at_most):
    """Block-level ``optimal`` on the enriched profile: the issue's 1.160, 1.240 (and 1.291 at 10%)
    less what a re-run no longer pays for the block's last add, which it never reaches (NOTE [a
    re-run stops at the last save]); the op-level plan caches ops in most blocks and is faster
    under the same budget."""
    out = _gpt2_ratios(fraction)
    assert round(out["optimal"][1], 3) == block_level
    plan, ratio = out["op-level"]
    assert ratio <= op_level_at_most
    assert sum(bool(b.cached_ops) for b in plan.blocks) >= len(plan) // 2
    assert Plan.from_json(plan.to_json()) == plan


def test_op_level_plans_a_thousand_blocks_of_fifty_ops():
    # Interception free: the synthetic ops are short, so priced they would not pay for it; here the
    # planner's search at that size is what is tested.
    prof, hw = synthetic(1000, 50, seed=9), replace(preset("h100-sxm"), op_intercept_s=0.0)
    keep = build_schedule(Plan.uniform("keep", 1000), prof).peak_bytes
    plan = op_level(prof, hw, keep // 4)
    assert build_schedule(plan, prof).peak_bytes <= keep // 4
    assert any(b.cached_ops for b in plan.blocks)
    assert replace(plan, name="optimal").blocks != optimal(prof, hw, keep // 4).blocks


def test_selective_sets_keep_the_frontiers_bends():
    """Of a hull with a sharp bend after three cheap ops and a softer one after two more, two
    options are those two bends; the last op, which keeping the block beats at every price, is none."""
    sizes = [(1, 10.0), (1, 9.9), (1, 9.8), (10, 5.0), (10, 4.9), (10, 0.1)]
    ops = tuple(OpProfile(f"op{k}", s, b * MiB) for k, (b, s) in enumerate(sizes))
    sets = selective_sets(ops, 2, keep=(100 * MiB, 50.0))
    assert [s.ops for s in sets] == [(0, 1, 2), (0, 1, 2, 3, 4)]
    assert [s.ops for s in selective_sets(ops, 6, keep=(100 * MiB, 50.0))][-1] == (0, 1, 2, 3, 4, 5)


def test_op_level_refuses_what_optimal_refuses_with_the_same_least_peak():
    prof, hw = synthetic(8, 12, seed=11), preset("h100-sxm")
    with pytest.raises(InfeasibleBudget) as block_level:
        optimal(prof, hw, 1)
    with pytest.raises(InfeasibleBudget) as ours:
        op_level(prof, hw, 1)
    assert ours.value.minimum_bytes == block_level.value.minimum_bytes
    assert build_schedule(op_level(prof, hw, ours.value.minimum_bytes), prof).peak_bytes <= ours.value.minimum_bytes


def test_selective_options_follow_the_plain_recomputes_offered():
    prof, hw = synthetic(4, 10, seed=2), preset("h100-sxm")
    only_keep = build_options(prof, hw, (BlockPlan(Policy.KEEP),), selective=4)
    assert only_keep.m == 1 and only_keep.selective is None
    no_swap = build_options(prof, hw, (BlockPlan(Policy.KEEP), BlockPlan(Policy.RECOMPUTE)), selective=3)
    assert no_swap.m == 2 + 3
    assert all(not no_swap.choice(i, k).swaps_anything for i in range(4) for k in range(no_swap.m) if no_swap.allows(i, k))


def test_an_output_no_op_reads_is_not_left_out_of_a_rerun():
    """NOTE [ops a re-run skips]: an op read by a cached op is left out, through a view too; one that
    only a view op reads, or nothing, is not (what reads it is not seen), nor is anything with
    nothing cached."""
    from ooc.scheduler.oplevel import dead_ops

    # 0 -> 1 (cached); 2 -> 3 (a view nothing reads); 4 (unread); 5 -> 6 (a view) and 5 -> 7 (cached, through the view)
    readers = [[1], [], [3], [], [], [6, 7], [], []]
    skippable = [True, False, True, False, True, True, False, False]
    passive = [False, False, False, True, False, False, True, False]
    assert dead_ops(frozenset({1, 7}), readers, skippable, passive) == {0, 5}
    assert dead_ops(frozenset(), readers, skippable, passive) == frozenset()


def test_op_level_prices_recording_and_replaying_the_ops():
    """``Hardware.op_intercept_s``: a selective block's ops cost that much each (forward and re-run
    together). Where it exceeds what caching skips, the planner recomputes the block plainly, and
    the simulator agrees that this is faster."""
    ops = (OpProfile("mm", 60e-6, MiB, MiB),) + tuple(
        OpProfile(f"op{k}", 1e-6, MiB, MiB if k % 2 else 0, cacheable=k != 39) for k in range(1, 40))
    saved = sum(op.saved_bytes for op in ops) + MiB
    block = BlockProfile("b", sum(op.forward_s for op in ops), 2e-4, saved, saved, MiB, MiB, MiB, 0, 0, ops=ops)
    prof = Profile(tuple(replace(block, name=f"b{i}") for i in range(6)), outside_forward_s=1e-4)
    budget = build_schedule(Plan.uniform("keep", 6), prof).peak_bytes // 2
    free = replace(preset("h100-sxm"), op_intercept_s=0.0, host_runs_ahead=False)  # the host computes: all of it counts
    costly = replace(free, op_intercept_s=20e-6)
    assert any(b.cached_ops for b in op_level(prof, free, budget).blocks)
    plan = op_level(prof, costly, budget)
    assert not any(b.cached_ops for b in plan.blocks)
    selective = op_level(prof, free, budget)
    assert predict(plan, prof, costly).step_time_s < predict(selective, prof, costly).step_time_s
    # The schedule charges it to the re-run: per op of the block, once.
    cached = Plan.of([BlockPlan(Policy.RECOMPUTE, cached_ops=(0,))] + ["keep"] * 5)
    rerun = lambda hw: next(op.duration_s for op in build_schedule(cached, prof, hw).ops if op.kind is OpKind.RECOMPUTE)  # noqa: E731
    assert rerun(costly) - rerun(free) == pytest.approx(40 * 20e-6, rel=1e-9)


def test_on_a_gpu_only_host_time_beyond_the_kernels_is_charged():
    """NOTE [host time under the kernels]: where the host runs ahead, a selective block pays the
    interception's host time only where it outlasts the block's forward and re-run kernels; the
    schedule and the op-level planner's arrays price it alike."""
    ops = (OpProfile("mm", 60e-6, MiB, MiB),) + tuple(
        OpProfile(f"op{k}", 1e-6, MiB, MiB if k % 2 else 0, cacheable=k != 39) for k in range(1, 40))
    saved = sum(op.saved_bytes for op in ops) + MiB
    block = BlockProfile("b", sum(op.forward_s for op in ops), 2e-4, saved, saved, MiB, MiB, MiB, 0, 0, ops=ops)
    prof = Profile(tuple(replace(block, name=f"b{i}") for i in range(6)), outside_forward_s=1e-4)
    cached = Plan.of([BlockPlan(Policy.RECOMPUTE, cached_ops=(0,))] + ["keep"] * 5)
    rerun = lambda hw: next(op.duration_s for op in build_schedule(cached, prof, hw).ops if op.kind is OpKind.RECOMPUTE)  # noqa: E731
    gpu = replace(preset("h100-sxm"), op_intercept_s=0.0, op_issue_s=0.0)
    assert gpu.host_runs_ahead
    plain_rerun = rerun(gpu)
    kernels = block.forward_s + plain_rerun
    hidden = replace(gpu, op_intercept_s=0.5 * kernels / 40)
    assert rerun(hidden) == plain_rerun  # the kernels outlast the host: nothing added
    exposed = replace(gpu, op_intercept_s=3 * kernels / 40)
    assert rerun(exposed) - plain_rerun == pytest.approx(2 * kernels, rel=1e-9)
    assert exposed.intercept_s(40, kernels) == pytest.approx(2 * kernels, rel=1e-9)
    assert replace(exposed, host_runs_ahead=False).intercept_s(40, kernels) == pytest.approx(3 * kernels, rel=1e-9)
    # Where plain PyTorch's issue alone keeps the host as busy as the kernels, all of it shows.
    busy = replace(hidden, op_issue_s=kernels / 80)
    assert busy.intercept_s(40, kernels) == pytest.approx(40 * hidden.op_intercept_s, rel=1e-9)
    half = replace(hidden, op_issue_s=kernels / 160)  # issue half the kernels: the interception fills the rest
    assert half.intercept_s(40, kernels) == pytest.approx(40 * hidden.op_intercept_s - kernels / 2, rel=1e-9)
    budget = build_schedule(Plan.uniform("keep", 6), prof).peak_bytes // 2
    assert any(b.cached_ops for b in op_level(prof, hidden, budget).blocks)
    plan = op_level(prof, exposed, budget)
    assert not any(b.cached_ops for b in plan.blocks)
    assert predict(plan, prof, exposed).step_time_s < predict(op_level(prof, hidden, budget), prof, exposed).step_time_s


def test_host_runs_ahead_is_a_bool_and_round_trips():
    hw = replace(preset("cpu"), host_runs_ahead=True)
    assert Hardware.from_dict(json.loads(hw.to_json())).host_runs_ahead is True
    with pytest.raises(HardwareError, match="host_runs_ahead must be true or false"):
        replace(hw, host_runs_ahead=1)


def test_the_cpu_preset_carries_an_op_intercept():
    assert preset("cpu").op_intercept_s > 0
    assert not preset("cpu").host_runs_ahead
    assert all(preset(name).host_runs_ahead for name in ("v100-16gb", "a100-40gb", "h100-sxm", "h200"))
    assert preset("h100-sxm").op_intercept_s > preset("h100-sxm").op_issue_s > 0  # an H200 host's, measured
