"""Claim: wrapping with all-KEEP costs <= 3% step time; SWAP and RECOMPUTE trade time for memory.

On the demo GPT (6 layers, 128 wide, batch 16 x 64 characters) on this machine's backend: step time
(forward + backward) of the plain model and of ``ooc.wrap`` under all-KEEP, all-SWAP and
all-RECOMPUTE, with peak device-resident saved bytes and bytes moved per step.
Run: ``python benchmarks/bench_runtime.py [--reps 30]``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ooc  # noqa: E402
from common import demo_gpt, interleaved_medians, machine_header, table  # noqa: E402
from ooc.scheduler.units import format_bytes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    print(machine_header("bench_runtime: ooc.wrap overhead and policy costs on the demo GPT"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg, base, batch = demo_gpt(device)
    prof = ooc.profile(base, batch)
    saved = sum(b.saved_bytes for b in prof.blocks)

    models = {"plain": copy.deepcopy(base)}
    for policy in ("keep", "swap", "recompute"):
        models[policy] = ooc.wrap(copy.deepcopy(base), ooc.Plan.uniform(policy, cfg.n_layer))

    def step(model: torch.nn.Module) -> None:
        model.zero_grad(set_to_none=True)
        model(*batch)[1].backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    medians = interleaved_medians({name: (lambda m=m: step(m)) for name, m in models.items()}, reps=args.reps)
    rows = [["config", "step ms", "vs plain", "vs keep", "peak saved on device", "vs keep", "moved/step", "moved/saved"]]
    keep_peak = None
    for name, model in models.items():
        if name == "plain":
            rows.append([name, f"{medians[name] * 1e3:.1f}", "1.000", "-", format_bytes(saved) + " (all)", "-", "0 B", "-"])
            continue
        step(model)
        report = ooc.memory_report(model)
        keep_peak = keep_peak or report.peak_bytes
        moved = report.swapped_out_bytes + report.swapped_in_bytes
        rows.append([
            f"wrap {name}-all",
            f"{medians[name] * 1e3:.1f}",
            f"{medians[name] / medians['plain']:.3f}",
            f"{medians[name] / medians['keep']:.3f}",
            format_bytes(report.peak_bytes),
            f"{report.peak_bytes / keep_peak:.3f}",
            format_bytes(moved),
            f"{moved / saved:.3f}",
        ])
    print(table(rows))
    overhead = medians["keep"] / medians["plain"] - 1
    print(f"all-KEEP overhead: {overhead * 100:+.1f}% (target <= 3%); median of {args.reps} interleaved steps")
    print(f"napkin bound: swap-all moves 2 x {format_bytes(sum(b.swappable_bytes for b in prof.blocks))} per step "
          f"(each swappable byte out and back in)")


if __name__ == "__main__":
    main()
