"""Claim (issue 15): what ooc's selective recompute costs per op beyond the ops themselves
(``Hardware.op_intercept_s``: recording each op of a block's forward, replaying its re-run from the
cache), on this machine, for the model ``ooc calibrate`` measures it on and for a larger one.

Each model is trained with every block recomputed (the baseline, measured in the same run) and with
every block recomputed caching its cheapest replayed op (selective: the dispatch modes run, and
almost nothing is skipped). Per op of the blocks: (selective - plain + what caching that op skips,
as the cost model prices it) / ops, the figure ``ooc calibrate`` records. On a GPU the step is
synchronised, so the figure is host time where it outlasts the kernels (NOTE [host time under the
kernels] in ``ooc.scheduler.hardware``): on a model whose kernels are short it is the host's whole
per-op cost, on one whose kernels are long part of it hides.
Run: ``python benchmarks/bench_intercept.py [--device cpu|cuda] [--reps 15] [--models tiny,gpt2]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ooc  # noqa: E402
from common import interleaved_medians, machine_header, table  # noqa: E402
from ooc.calibrate import intercept_plans  # noqa: E402
from ooc.models.gpt import GPT  # noqa: E402

MODELS = {"tiny": ("tiny", 16, 64), "gpt2": ("gpt2", 4, 512)}
"""Name: (GPT preset, batch, sequence). ``tiny`` at 16 x 64 is what ``ooc calibrate`` measures."""


def measure(name: str, device: torch.device, reps: int) -> list[str]:
    preset, batch_size, seq = MODELS[name]
    torch.manual_seed(0)
    model = GPT(preset).to(device)
    tokens = torch.randint(0, model.config.vocab_size, (batch_size, seq), generator=torch.Generator().manual_seed(0)).to(device)
    batch = (tokens, torch.roll(tokens, -1, dims=1))
    profile = ooc.profile(model, batch, ops=True, codec_errors=False, reps=1)
    plain, selective, skipped = intercept_plans(profile)
    wrapped = {label: ooc.wrap(GPT(preset).to(device), plan, backend="cuda" if device.type == "cuda" else "cpu")
               for label, plan in (("plain", plain), ("selective", selective))}

    def step(m: torch.nn.Module) -> None:
        m(*batch)[1].backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # whole steps are timed: wait for their kernels

    medians = interleaved_medians({label: (lambda m=m: step(m)) for label, m in wrapped.items()}, reps=reps)
    for m in wrapped.values():
        ooc.unwrap(m)
    ops = sum(len(b.ops) for b in profile.blocks)
    per_op = (medians["selective"] - medians["plain"] + skipped) / ops
    forward_per_op = sum(b.forward_s for b in profile.blocks) / ops
    return [name, f"{batch_size}x{seq}", str(ops), f"{medians['plain'] * 1e3:.2f}", f"{medians['selective'] * 1e3:.2f}",
            f"{medians['selective'] / medians['plain']:.3f}", f"{per_op * 1e6:.1f}", f"{forward_per_op * 1e6:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--models", default="tiny,gpt2")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(machine_header(f"selective recompute's per-op cost on {device}"))
    rows = [["model", "batch", "ops", "plain recompute ms", "selective ms", "ratio", "per op us", "kernel per op us"]]
    rows += [measure(name, device, args.reps) for name in args.models.split(",")]
    print(table(rows))
    print("# per op: (selective - plain + skipped) / ops, the calibrated op_intercept_s; kernel per op: the profile's "
          "forward time per op of the blocks")


if __name__ == "__main__":
    main()
