"""Claim (issue 15): op-level planning (selective recompute: per block, which op outputs to cache,
and which of those to swap to the host under the next block's forward, NOTE [window swaps]) beats the block-level ``optimal`` under the same budget: predicted step time / in-core ideal on the
analytic GPT-2 XL s1024 H100 profile <= 1.05 at 50% of the keep-all activations, <= 1.12 at 25%,
<= 1.25 at 10%; the same table for the 7B decoder, WRN-28-10 and ResNet-1001 (H100 and V100,
with the flash-attention variants of the transformers); and plans 1,000 blocks of 50 ops in <= 2 s.
The LP bound column says how close the plan is to the best any plan over the same options can do;
the "any plan" column bounds every per-tensor keep/swap/recompute plan, swaps in any window included
(NOTE [any plan's reach]): a goal below it is out of reach of the option space the issue names.
And (issue 15) the op-level DP is no slower than the HiGHS MILP on the same options and budgets,
with a plan of the DP's own quality (its model cost beside the MILP's; the MILP is exact in bytes,
the DP buckets them, NOTE [bucketed budget]).

Profiles: ``profiles/analytic-*.json`` (op-level detail per NOTE [analytic ops]). Ideal: keep-all
with unlimited memory. "-": no plan fits. Run: ``python benchmarks/bench_oplevel.py [--quick]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import interleaved_medians, machine_header, table  # noqa: E402
from ooc.scheduler import BlockProfile, Plan, Profile, build_schedule, preset  # noqa: E402
from ooc.scheduler.costmodel import build_options, model_cost  # noqa: E402
from ooc.scheduler.milp import lower_bound, solve_milp  # noqa: E402
from ooc.scheduler.optimal import solve_options  # noqa: E402
from ooc.scheduler.planners import op_level, optimal  # noqa: E402
from ooc.scheduler.profile import OpProfile  # noqa: E402
from ooc.scheduler.reach import any_plan_step_bound  # noqa: E402
from ooc.scheduler.simulate import predict  # noqa: E402

PROFILES = Path(__file__).resolve().parents[1] / "profiles"
FRACTIONS = (0.5, 0.25, 0.1)
GOALS = {("h100-sxm", "gpt2-xl-s1024"): {0.5: 1.05, 0.25: 1.12, 0.1: 1.25}}
"""The issue's goals (op-level / ideal) where it sets them; block-level ``optimal`` was 1.160 at 50%
and 1.240 at 25% on that profile when the issue was written."""
BOUND_BLOCKS = 64
"""The LP bound is computed for chains up to this long (its rows grow with n^2 x options)."""
MODELS = ("gpt2-xl-s1024", "gpt2-xl-s1024-flash", "decoder-7b-s4096", "decoder-7b-s4096-flash", "wrn-28-10-b512",
          "resnet-1001-b256")


def _ratio(planner, prof: Profile, hw, budget: int, ideal: float) -> tuple[float | None, float, Plan | None]:
    start = time.perf_counter()
    try:
        plan = planner(prof, hw, budget, prefetch=2)
    except ValueError:
        return None, time.perf_counter() - start, None
    seconds = time.perf_counter() - start
    if build_schedule(plan, prof).peak_bytes > budget:
        return None, seconds, plan
    return predict(plan, prof, hw).step_time_s / ideal, seconds, plan


def _cached_only(prof: Profile, hw, budget: int, prefetch: int = 2) -> Plan:
    """The op-level planner without per-tensor swaps (selective recompute alone)."""
    return op_level(prof, hw, budget, prefetch=prefetch, swapped_per_block=0)


def quality(quick: bool) -> None:
    rows = [["hardware", "model", "budget", "optimal", "cache only", "op-level", "free interception", "LP bound",
             "any plan", "goal",
             "op/opt", "cached/swapped blocks", "op-level s"]]
    for hw_name in ("h100-sxm",) if quick else ("h100-sxm", "v100-16gb"):
        hw = preset(hw_name)
        free = replace(hw, op_intercept_s=0.0)
        for model in MODELS:
            prof = Profile.load(PROFILES / f"analytic-{hw_name}-{model}.json")
            n = len(prof)
            keep_peak = build_schedule(Plan.uniform("keep", n), prof).peak_bytes
            ideal = predict(Plan.uniform("keep", n), prof, hw).step_time_s
            opts = build_options(prof, hw, selective=4) if n <= BOUND_BLOCKS else None  # op_level's own options
            for fraction in FRACTIONS:
                budget = int(keep_peak * fraction)
                base, _, _ = _ratio(optimal, prof, hw, budget, ideal)
                cached_only, _, _ = _ratio(_cached_only, prof, hw, budget, ideal)
                ours, seconds, plan = _ratio(op_level, prof, hw, budget, ideal)
                unpriced, _, _ = _ratio(op_level, prof, free, budget, predict(Plan.uniform("keep", n), prof, free).step_time_s)
                bound = lower_bound(opts, budget, 2) if opts is not None else None
                reach = any_plan_step_bound(prof, hw, budget)
                goal = GOALS.get((hw_name, model), {}).get(fraction)
                cached = sum(bool(b.cached_ops) for b in plan.blocks) if plan is not None else 0
                swapped = sum(bool(b.swapped_ops) for b in plan.blocks) if plan is not None else 0
                rows.append([
                    hw_name, model, f"{fraction:.0%}",
                    f"{base:.3f}" if base else "-", f"{cached_only:.3f}" if cached_only else "-",
                    f"{ours:.3f}" if ours else "-", f"{unpriced:.3f}" if unpriced else "-",
                    f"{1 + bound / ideal:.3f}" if bound is not None else "-",
                    f"{reach / ideal:.3f}" if reach is not None else "-",
                    f"<= {goal:.2f}" + ("" if ours and ours <= goal else " MISSED") if goal else "",
                    f"{ours / base:.3f}" if ours and base else "-",
                    f"{cached}/{swapped}/{n}", f"{seconds:.2f}",
                ])
    print(table(rows))
    print("columns: predicted step time / ideal (keep-all, unlimited memory) of block-level optimal (baseline), "
          "the op-level planner with selective recompute alone (cache only) and with the cached outputs the link "
          "hides swapped (op-level, the figure, with the hardware's per-op interception cost, Hardware.op_intercept_s); "
          "free interception: op-level if recording and replaying the ops cost nothing (the option space's own reach); LP bound: 1 + the LP relaxation's optimum of the cost model over "
          f"op-level's options / ideal, a lower bound on any plan in that option space (chains <= {BOUND_BLOCKS} "
          "blocks; the model's cost, which the simulator's step matches within rounding on these profiles); "
          "any plan: a lower bound on the step / ideal of every plan that keeps, swaps or recomputes each op output, "
          "with swaps in any window, limited only by the link's bandwidth over the forward and the backward "
          "(scheduler/reach.py, NOTE [any plan's reach]); "
          "op/opt: op-level / optimal; budget: share of the keep-all activation peak")


def _timed_solves(opts, budget: int, reps: int) -> tuple[dict[str, float], list[int] | None, tuple | None]:
    """Median seconds of the DP's search and of the MILP on ``opts`` at ``budget``, and their answers."""
    out = {}
    seconds = interleaved_medians({
        "dp": lambda: out.__setitem__("dp", solve_options(opts, budget, 2, exact_blocks=200)),
        "milp": lambda: out.__setitem__("milp", solve_milp(opts, budget, 2)),
    }, reps, warmup=1)
    return seconds, out["dp"], out["milp"]


def solve_times(quick: bool) -> None:
    """The op-level DP's search (``solve_options``: the DP with its bucket search, what ``op_level``
    runs between building the options and polishing the plan) against ``solve_milp`` on the same
    options and budgets, medians of runs taken in turns."""
    rows = [["hardware", "model", "blocks", "budget", "DP s", "MILP s", "MILP/DP", "goal", "DP cost/MILP cost",
             "DP plan fits"]]
    reps = 3
    for hw_name in ("h100-sxm",) if quick else ("h100-sxm", "v100-16gb"):
        hw = preset(hw_name)
        for model in MODELS:
            prof = Profile.load(PROFILES / f"analytic-{hw_name}-{model}.json")
            n = len(prof)
            if n > BOUND_BLOCKS:
                continue  # the Lagrangian DP's chains; HiGHS takes minutes on them
            keep_peak = build_schedule(Plan.uniform("keep", n), prof).peak_bytes
            opts = build_options(prof, hw, selective=4)  # op_level's own options
            for fraction in FRACTIONS:
                budget = int(keep_peak * fraction)
                seconds, dp, milp = _timed_solves(opts, budget, reps)
                fits = dp is not None and build_schedule(opts.plan(dp, prefetch=2, min_swap_bytes=prof.min_swap_bytes,
                                                                   name="dp"), prof).peak_bytes <= budget
                both = dp is not None and milp is not None and milp[1] > 0
                quality = (f"{model_cost(opts, dp, 2) / milp[1]:.4f}" if both
                           else "-" if dp is None and milp is None else "DP none" if dp is None else "MILP none")
                rows.append([hw_name, model, str(n), f"{fraction:.0%}", f"{seconds['dp']:.3f}",
                             f"{seconds['milp']:.3f}", f"{seconds['milp'] / seconds['dp']:.1f}",
                             "DP <= MILP" + ("" if seconds["dp"] <= seconds["milp"] else " MISSED"), quality,
                             "yes" if fits else ("-" if dp is None else "NO")])
    print(table(rows))
    print(f"columns: median seconds of {reps} runs each, taken in turns in one process; MILP/DP: how many "
          "times faster the DP is; DP cost/MILP cost: the model cost of the DP's plan over the MILP's optimum "
          f"(>= 1: the MILP is exact in bytes; chains <= {BOUND_BLOCKS} blocks, longer ones take the Lagrangian "
          "DP); -: no plan fits")


def synthetic(n: int, ops_per_block: int, seed: int = 0) -> Profile:
    """``n`` different blocks of ``ops_per_block`` ops each (sizes and times of a real network's ops)."""
    r, blocks = random.Random(seed), []
    for i in range(n):
        ops = []
        for k in range(ops_per_block):
            out = r.randint(1, 40) * 2**20
            ops.append(OpProfile(f"op{k}", r.uniform(2e-6, 1e-4), out, out if r.random() < 0.5 else 0, r.random() > 0.1))
        saved, inp = sum(o.saved_bytes for o in ops), r.randint(2, 10) * 2**20
        fwd = sum(o.forward_s for o in ops)
        blocks.append(BlockProfile(f"b{i}", fwd, 2 * fwd, saved, saved, inp, inp, inp, 0, 0, ops=tuple(ops)))
    return Profile(tuple(blocks), outside_forward_s=2e-3)


def planning_time() -> None:
    hw = preset("h100-sxm")
    prof = synthetic(1000, 50)
    keep_peak = build_schedule(Plan.uniform("keep", 1000), prof).peak_bytes
    rows = [["blocks x ops", "budget", "optimal s", "op-level s", "goal", "op-level peak/budget"]]
    for fraction in FRACTIONS:
        budget = int(keep_peak * fraction)
        start = time.perf_counter()
        optimal(prof, hw, budget)
        base = time.perf_counter() - start
        start = time.perf_counter()
        plan = op_level(prof, hw, budget)
        ours = time.perf_counter() - start
        fit = build_schedule(plan, prof).peak_bytes / budget
        rows.append(["1000 x 50", f"{fraction:.0%}", f"{base:.2f}", f"{ours:.2f}", "<= 2 s" + ("" if ours <= 2 else " MISSED"),
                     f"{fit:.3f}"])
    print(table(rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="H100 only")
    args = parser.parse_args()
    print(machine_header("bench_oplevel: op-level (selective recompute) vs block-level planning, analytic profiles"))
    quality(args.quick)
    print()
    solve_times(args.quick)
    print()
    planning_time()


if __name__ == "__main__":
    main()
