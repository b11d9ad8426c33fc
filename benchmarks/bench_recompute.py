"""Claim: recompute through saved-tensor hooks costs no more step time than ooc's previous recompute
(one opaque autograd Function per block) and is on par with ``torch.utils.checkpoint``.

On the demo GPT (batch 16 x 64 characters) on this machine's backend: step time (forward +
backward) of the plain model, of ``ooc.wrap`` with every block recomputed (the current mechanism,
and, with ``--old REV``, the Function-based one of that git revision, loaded from git history), and
of every block under ``checkpoint(use_reentrant=False)``. Median of interleaved steps.
Run: ``python benchmarks/bench_recompute.py [--reps 30] [--old c9b7229]``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ooc  # noqa: E402
from common import demo_gpt, interleaved_medians, machine_header, table  # noqa: E402
from ooc.models.gpt import GPT  # noqa: E402
from ooc.runtime import runtime_of  # noqa: E402
from ooc.saved import unpack  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def old_recompute_module(rev: str) -> types.ModuleType:
    """``ooc/recompute.py`` as it was at ``rev`` (the Function-based mechanism), as a module."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:ooc/recompute.py"],
                            check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("ooc_recompute_old")
    exec(compile(source, f"{rev}:ooc/recompute.py", "exec"), module.__dict__)  # noqa: S102
    return module


def use_old_recompute(model: torch.nn.Module, old: types.ModuleType) -> None:
    """Route every block of the wrapped ``model`` through ``old.run_recomputed``, as the runtime's
    RECOMPUTE branch did at that revision (no streaming, no timer)."""
    rt = runtime_of(model)
    anchor = torch.empty(0, requires_grad=True)
    for i, module in enumerate(rt.chain.modules):
        original = module.forward.original

        def call(*args: Any, i: int = i, original: Any = original, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return original(*args, **kwargs)
            if rt.first_calls is not None:  # the runtime's first-forward check of the chain
                rt.first_calls.append(i)
            step = rt.pass_for(i)
            with saved_tensors_hooks(step.pack_hook(i, swap=False, what="save"), unpack):
                out = old.run_recomputed(
                    original, rt.chain.modules[i], args, kwargs, anchor=anchor, device=rt.backend.device,
                    recompute_hooks=lambda: saved_tensors_hooks(step.pack_hook(i, swap=False, what="recompute"), unpack),
                    range_name=f"ooc/recompute/{rt.chain.names[i]}", timer=lambda what: contextlib.nullcontext(),
                )
            for j in rt.schedule.releases_after_forward[i]:
                step.release(j)
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                register_multi_grad_hook(outputs, lambda _g, i=i: step.on_backward_start(i), mode="any")
            return out

        module.forward = call


def use_torch_checkpoint(model: GPT) -> None:
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--old", default=None, help="git revision whose Function-based recompute to compare (e.g. c9b7229)")
    args = parser.parse_args()
    print(machine_header("bench_recompute: recompute-all step time, ooc (hooks) vs ooc (old Function) vs torch checkpoint"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg, base, batch = demo_gpt(device)
    n = cfg.n_layer

    models = {"plain": copy.deepcopy(base), "ooc recompute-all": ooc.wrap(copy.deepcopy(base), ooc.Plan.uniform("recompute", n))}
    if args.old:
        models[f"ooc recompute-all @{args.old}"] = ooc.wrap(copy.deepcopy(base), ooc.Plan.uniform("recompute", n))
        use_old_recompute(models[f"ooc recompute-all @{args.old}"], old_recompute_module(args.old))
    models["torch checkpoint-all"] = copy.deepcopy(base)
    use_torch_checkpoint(models["torch checkpoint-all"])

    def step(model: torch.nn.Module) -> None:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        model(*batch)[1].backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    # Same gradients from every variant (dropout replayed bit for bit), else the timing is moot.
    reference = None
    for name, model in models.items():
        step(model)
        got = [p.grad.clone() for p in model.parameters()]
        reference = reference or got
        if not all(torch.equal(a, b) for a, b in zip(reference, got)):
            raise SystemExit(f"{name}: gradients differ from plain PyTorch")

    medians = interleaved_medians({name: (lambda m=m: step(m)) for name, m in models.items()}, reps=args.reps)
    rows = [["config", "step ms", "vs plain", "vs ooc recompute-all"]]
    for name in models:
        rows.append([name, f"{medians[name] * 1e3:.1f}", f"{medians[name] / medians['plain']:.3f}",
                     f"{medians[name] / medians['ooc recompute-all']:.3f}"])
    print(table(rows))
    print(f"median of {args.reps} interleaved steps; {n} blocks; napkin bound: recompute-all adds one block "
          "forward per block (~1/3 of a step), less with early stop")


if __name__ == "__main__":
    main()
