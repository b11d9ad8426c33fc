"""The ``ooc`` command line: ``ooc demo`` (and ``python -m ooc demo``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    from ooc.demo import run_demo

    run_demo(steps=args.steps, batch_size=args.batch_size, budget_fraction=args.budget_fraction,
             planner=args.planner, seed=args.seed, progress=not args.no_progress)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ooc", description="Out-of-core training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny GPT under a memory budget that forces keep/swap/recompute")
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--batch-size", type=int, default=16)
    demo.add_argument("--budget-fraction", type=float, default=0.5, help="budget as a fraction of the keep-all peak")
    demo.add_argument("--planner", default="optimal")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as exc:
        print(f"ooc {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
