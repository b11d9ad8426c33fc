"""Claim: ``optimal`` is within 1% of the MILP where the MILP solves, beats the single techniques at
tight budgets, and plans 1,000 blocks in <= 0.5 s and 10,000 in <= 5 s; every planner of the table
plans 1,000 blocks in <= 1 s.

Analytic profiles (roofline on the H100 and V100 presets) of GPT-2 XL (seq 1024, micro-batch 8), a
7B decoder (seq 4096, micro-batch 1), WRN-28-10 (batch 512) and ResNet-1001 (batch 256), at budgets
of 80/50/30/20% of the keep-all peak: predicted step time of each planner / ideal (keep-all time,
unlimited memory). "-" means the planner's plan does not fit the budget.
Run: ``python benchmarks/bench_planner.py [--quick]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_header, table  # noqa: E402
from ooc.scheduler import PLANNERS, BlockProfile, Plan, Profile, build_schedule, preset  # noqa: E402
from ooc.scheduler.analytic import decoder_7b, gpt2_xl, preact_resnet_bottleneck, wide_resnet  # noqa: E402
from ooc.scheduler.costmodel import build_options  # noqa: E402
from ooc.scheduler.milp import solve_milp  # noqa: E402
from ooc.scheduler.simulate import predict  # noqa: E402

FRACTIONS = (0.8, 0.5, 0.3, 0.2)
SHOWN = ("recompute-all", "swap-all", "sqrt-checkpoint", "karma", "optimal")


def profiles(hw_name: str, quick: bool) -> list[Profile]:
    hw = preset(hw_name)
    out = [gpt2_xl(1024, 8, hw), decoder_7b(4096, 1, hw), wide_resnet(batch=512, hardware=hw)]
    if not quick:
        out.append(preact_resnet_bottleneck(batch=256, hardware=hw))
    return out


def planner_table(quick: bool) -> None:
    rows = [["hardware", "model", "budget", *SHOWN, "milp", "opt/milp", "best single/opt", "swap-all/opt", "optimal s", "milp s"]]
    for hw_name in ("h100-sxm", "v100-16gb"):
        hw = preset(hw_name)
        for prof in profiles(hw_name, quick):
            n = len(prof)
            keep_peak = build_schedule(Plan.uniform("keep", n), prof).peak_bytes
            ideal = predict(Plan.uniform("keep", n), prof, hw).step_time_s
            opts = build_options(prof, hw)
            for fraction in FRACTIONS:
                budget = int(keep_peak * fraction)
                times, seconds = {}, {}
                for name in SHOWN:
                    start = time.perf_counter()
                    try:
                        plan = PLANNERS[name](prof, hw, budget, prefetch=2)
                    except ValueError:
                        continue
                    seconds[name] = time.perf_counter() - start
                    if build_schedule(plan, prof).peak_bytes <= budget:
                        times[name] = predict(plan, prof, hw).step_time_s / ideal
                start = time.perf_counter()
                milp = solve_milp(opts, budget, 2, time_limit_s=20.0) if n <= 64 else None
                milp_s = time.perf_counter() - start
                milp_ratio = None
                if milp is not None:
                    milp_plan = opts.plan(milp[0], prefetch=2, min_swap_bytes=prof.min_swap_bytes, name="milp")
                    milp_ratio = predict(milp_plan, prof, hw).step_time_s / ideal
                singles = [times[k] for k in ("recompute-all", "swap-all") if k in times]
                opt = times.get("optimal")
                rows.append([
                    hw_name, prof.model, f"{fraction:.0%}",
                    *[f"{times[k]:.3f}" if k in times else "-" for k in SHOWN],
                    f"{milp_ratio:.3f}" if milp_ratio else ("n>64" if n > 64 else "-"),
                    f"{opt / milp_ratio:.4f}" if opt and milp_ratio else "-",
                    f"{min(singles) / opt:.2f}x" if opt and singles else "-",
                    f"{times['swap-all'] / opt:.2f}x" if opt and "swap-all" in times else "-",
                    f"{seconds['optimal']:.3f}" if "optimal" in seconds else "-",
                    f"{milp_s:.3f}" if n <= 64 else "-",
                ])
    print(table(rows))
    print("columns: predicted step time / ideal; opt/milp <= 1.01 is the target; "
          "'best single' is the faster of recompute-all and swap-all where it fits; "
          "target: optimal s <= milp s (planning seconds, same run)")


def scaling(quick: bool) -> None:
    rng = random.Random(0)
    hw = preset("v100-16gb")
    rows = [["blocks", *(f"{name} s" for name in PLANNERS), "optimal peak/budget"]]
    for n in (100, 300, 1000, 3000) + (() if quick else (10000,)):
        blocks = []
        for i in range(n):
            saved = rng.randint(20, 100) * 2**20
            inp = rng.randint(2, 10) * 2**20
            blocks.append(BlockProfile(f"b{i}", rng.uniform(1e-3, 5e-3), rng.uniform(2e-3, 1e-2), saved, saved, inp, inp, inp, 0, 0))
        prof = Profile(tuple(blocks), outside_forward_s=2e-3)
        budget = int(build_schedule(Plan.uniform("keep", n), prof).peak_bytes * 0.3)
        seconds = {}
        for name, planner in PLANNERS.items():
            if n > 3000 and name != "optimal":
                continue  # the baselines' table stops at 3,000 blocks; optimal's claim goes to 10,000
            start = time.perf_counter()
            plan = planner(prof, hw, budget, prefetch=2)
            seconds[name] = time.perf_counter() - start
            if name == "optimal":
                fit = build_schedule(plan, prof).peak_bytes / budget
        rows.append([str(n), *(f"{seconds[k]:.3f}" if k in seconds else "-" for k in PLANNERS), f"{fit:.3f}"])
    print(table(rows))
    print("targets: optimal <= 0.5 s at 1,000 blocks and <= 5 s at 10,000; every planner <= 1 s at 1,000 "
          "(budget 30% of keep-all). greedy judged each candidate by building its schedule until "
          "2026-11-23: 26 s at 333 blocks, 234 s at 1,000 on this machine")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="skip ResNet-1001 and 10,000 blocks")
    args = parser.parse_args()
    print(machine_header("bench_planner: planners on analytic profiles, and planning time"))
    planner_table(args.quick)
    print()
    scaling(args.quick)


if __name__ == "__main__":
    main()
