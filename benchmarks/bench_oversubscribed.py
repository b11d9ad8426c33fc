"""Claim (NOTE [a waiter runs the copies] in ooc.backend.cpu): on a machine whose cores are
oversubscribed, a thread that waits for a copy runs it itself instead of waiting for the copy
engine's thread to be scheduled, so the CPU backend's step no longer pays a time slice per hand-off.

Measured on the demo GPT (the sonnets, one 16 x 64 batch, forward + backward) with ``--load`` busy
processes beside it (default 8: a load of ~10 on 2 cores), in interleaved turns in one run:
- plain PyTorch (the baseline);
- wrapped with a plan that swaps and recomputes (the CPU backend's copy engines at work), the waiter
  running the copies (this version);
- the same plan with waiters that only wait for the engines' threads (the version before).
Each row: median step time and its ratio to plain. ``--optimizer``: each step also updates the
weights (torch's AdamW for plain PyTorch, the pipelined HostAdamW for ooc, whose update thread is
another hand-off per bucket).

Run: ``python benchmarks/bench_oversubscribed.py [--load 8] [--reps 10]`` (``--load 0``: an idle machine).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ooc  # noqa: E402
from common import demo_gpt, interleaved_medians, machine_header, table  # noqa: E402
from ooc.backend import CpuBackend  # noqa: E402
from ooc.backend.cpu import _CopyEngine  # noqa: E402

PLAN = ("swap", "recompute", "swap", "keep", "swap", "keep")
"""Three swapped blocks (copies out in the forward, prefetches in the backward), one recomputed."""


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--load", type=int, default=8, help="busy processes started beside the steps")
    parser.add_argument("--reps", type=int, default=10, help="interleaved turns timed per variant")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch's intra-op threads (default: torch's own)")
    parser.add_argument("--optimizer", action="store_true",
                        help="each step also updates: torch's AdamW for plain, ooc's pipelined HostAdamW for ooc")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    _, plain_model, (x, y) = demo_gpt(device)
    _, ooc_model, _ = demo_gpt(device)
    backend = CpuBackend(check_order=False)
    plan = ooc.Plan.of([ooc.BlockPlan(p) for p in PLAN[: len(ooc_model.blocks)]], min_swap_bytes=4096)
    ooc.wrap(ooc_model, plan, backend=backend)
    helping = _CopyEngine.run_until

    optimizers: dict[int, torch.optim.Optimizer] = {}
    if args.optimizer:
        optimizers[id(plain_model)] = torch.optim.AdamW(plain_model.parameters(), lr=1e-4)
        optimizers[id(ooc_model)] = ooc.optim.HostAdamW(ooc_model.parameters(), lr=1e-4, model=ooc_model, pipeline=True)

    def step(model: torch.nn.Module) -> Callable[[], None]:
        opt = optimizers.get(id(model))

        def run() -> None:
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
            if opt is not None:
                opt.step()
        return run

    def without_help() -> None:
        _CopyEngine.run_until = lambda self, done: None  # the waiter only waits (the version before)
        try:
            step(ooc_model)()
        finally:
            _CopyEngine.run_until = helping

    busy = _busy(args.load)
    try:
        times = interleaved_medians({"plain": step(plain_model), "ooc": step(ooc_model), "ooc, waiters only wait": without_help},
                                    reps=args.reps, warmup=2)
    finally:
        for proc in busy:
            proc.kill()
        for opt in optimizers.values():
            if hasattr(opt, "close"):
                opt.close()
        ooc.unwrap(ooc_model)
        backend.close()
    what = "forward + backward + AdamW (HostAdamW pipelined for ooc)" if args.optimizer else "forward + backward"
    print(machine_header(f"bench_oversubscribed: demo GPT 16x64, {what}, plan {'/'.join(PLAN)}, "
                         f"{args.load} busy processes beside it, {args.reps} interleaved turns"))
    base = times["plain"]
    print(table([["variant", "median step", "vs plain"]]
                + [[name, f"{t * 1e3:.1f} ms", f"x{t / base:.2f}"] for name, t in times.items()]))


if __name__ == "__main__":
    main()
