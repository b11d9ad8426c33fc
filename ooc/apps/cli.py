"""The ``ooc`` command line (also ``python -m ooc``): demo, train, checkpoints, profile, plan,
simulate, partition, calibrate, doctor."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from ooc.apps import doctor


def _hardware(spec: str | None, default: str = "cpu"):
    from ooc.scheduler.hardware import Hardware, preset

    spec = spec or default
    if spec.endswith(".json"):
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"no hardware file {path}; make one with `ooc calibrate --out {path}`")
        return Hardware.from_dict(json.loads(path.read_text()))
    return preset(spec)


def _output_file(value: str) -> str:
    """An argparse ``type`` for a file a command writes when its work is done: a missing folder failed
    only then (``ooc train --out`` after the whole run, ``ooc profile --out`` naming its ``.tmp`` file),
    so the path is checked before the work starts."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a directory; give a file name in it")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"no directory {path.parent} to write {path.name} into; create it first")
    return value


def _demo(args: argparse.Namespace) -> int:
    from ooc.apps.demo import run_demo

    run_demo(steps=args.steps, batch_size=args.batch_size, budget_fraction=args.budget_fraction,
             planner=args.planner, seed=args.seed, progress=not args.no_progress, threads=args.threads)
    return 0


def _train(args: argparse.Namespace) -> int:
    from ooc.apps.train import TrainConfig
    from ooc.apps.train import main as train_main

    if args.keep is not None and not args.save:  # (TrainConfig's keep has a default: given or not, it cannot tell)
        raise ValueError("--keep applies to --save's directory: give --save DIR too (without it nothing is saved)")
    cfg = TrainConfig(
        preset=args.preset, steps=args.steps, batch_size=args.batch_size, seq=args.seq, lr=args.lr,
        weight_decay=args.weight_decay, seed=args.seed, dtype=args.dtype, dropout=args.dropout, plan=args.plan, shard=args.shard,
        reduce_on=args.reduce_on, delayed_update=args.delayed_update, accumulate=args.accumulate,
        max_grad_norm=args.max_grad_norm, device_params_below=args.device_params_below, pipeline=not args.no_pipeline, timeout_s=args.timeout, out=args.out, save=args.save,
        save_every=args.save_every, keep=3 if args.keep is None else args.keep, resume=args.resume,
        progress=not args.no_progress, device=args.device,
    )
    return train_main(cfg)


def _checkpoints(args: argparse.Namespace) -> int:
    import datetime

    from ooc.checkpoint import moved_aside, scan_versions

    if not Path(args.directory).is_dir():
        raise ValueError(f"no directory {args.directory} (the directory given to `ooc train --save` or to Checkpointer)")
    found, damaged = scan_versions(args.directory)  # damaged: NOTE [damaged records] in ooc.checkpoint
    aside = [f"moved aside  {p.name}  (a damaged version a save moved out of the way; kept for you to inspect or delete)"
             for p in moved_aside(args.directory)]
    if not found and not damaged:
        print("\n".join([f"no complete checkpoint in {args.directory}", *aside]))
        return 1
    lines = {}
    for v in found:
        when = datetime.datetime.fromtimestamp(v.created).isoformat(timespec="seconds")
        size = sum(f["bytes"] for f in v.files.values())
        lines[v.step] = (f"step {v.step:>9d}  {when}  {size:>12d} B  {v.world} rank(s)  {v.path.name}  "
                         f"{json.dumps(v.metadata, sort_keys=True)}")
    for step, error in damaged.items():
        lines[step] = f"step {step:>9d}  DAMAGED  {error}"
    print("\n".join([*(lines[step] for step in sorted(lines)), *aside]))
    return 0


DEFAULT_SEQ = 64
"""Tokens per sequence of a reference GPT or an analytic transformer without ``--seq`` (a GPT's
``block_size`` where that is shorter: nano's 32)."""


def reference_model(spec: str, batch: int, seq: int | None = None):
    """``gpt:<preset>``, ``cnn`` or ``mlp``: a reference model and one input batch for it. ``seq``: a
    GPT's tokens per sequence, at most its ``block_size``; None: ``DEFAULT_SEQ`` or the ``block_size``,
    whichever is shorter."""
    import torch

    from ooc.models import GPT, GPT_PRESETS, MLPChain, ResNet

    torch.manual_seed(0)
    kind, _, variant = spec.partition(":")
    if kind == "gpt":
        variant = variant or "tiny"
        if variant not in GPT_PRESETS:
            raise ValueError(f"no GPT preset {variant!r}; choose one of {sorted(GPT_PRESETS)}")
        longest = GPT_PRESETS[variant].block_size
        if seq is not None and seq > longest:
            # It was cut to the preset's length silently (the input shape on stderr alone showed it).
            raise ValueError(f"--seq {seq} is longer than {spec}'s sequences of at most {longest} tokens (its "
                             f"block_size); pass --seq {longest} or less")
        model = GPT(variant)
        seq = min(DEFAULT_SEQ, longest) if seq is None else seq
        x = torch.randint(0, model.config.vocab_size, (batch, seq))
        return model, (x, torch.roll(x, -1, 1))
    if kind == "cnn":
        return ResNet(), (torch.randn(batch, 3, 32, 32),)
    if kind == "mlp":
        return MLPChain(), (torch.randn(batch, 32),)
    raise ValueError(f"unknown model {spec!r}; use gpt:<preset>, cnn or mlp")


def _profile(args: argparse.Namespace) -> int:
    from ooc.scheduler.analytic import decoder_7b, gpt2_xl, preact_resnet_bottleneck, wide_resnet
    from ooc.scheduler.units import format_bytes

    for flag, value in (("--batch", args.batch), ("--seq", args.seq)):
        if value is not None and value < 1:  # a batch of 0 profiled to 0 saved bytes; a negative one failed deep in the analytic model
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.analytic:
        hw = _hardware(args.hardware, "h100-sxm")
        seq = DEFAULT_SEQ if args.seq is None else args.seq
        makers = {
            "gpt2-xl": lambda: gpt2_xl(seq, args.batch, hw, flash_attention=args.flash_attention),
            "decoder-7b": lambda: decoder_7b(seq, args.batch, hw, flash_attention=args.flash_attention),
            "wrn-28-10": lambda: wide_resnet(batch=args.batch, hardware=hw),
            "resnet-1001": lambda: preact_resnet_bottleneck(batch=args.batch, hardware=hw),
        }
        if args.analytic not in makers:
            raise ValueError(f"no analytic model {args.analytic!r}; choose one of {sorted(makers)}")
        prof = makers[args.analytic]()
    else:
        import ooc

        model, sample = reference_model(args.model, args.batch, args.seq)
        print(f"profiling {args.model}, input {' x '.join(map(str, sample[0].shape))}: each block timed over "
              f"{args.reps} steps{' and op by op' if args.ops else ''}", file=sys.stderr, flush=True)
        prof = ooc.profile(model, sample, reps=args.reps, name=args.model, ops=args.ops)
    print(f"{prof.model}: {len(prof)} blocks, {prof.source}")
    for b in prof.blocks[:4]:
        print(f"  {b.name}: fwd {b.forward_s * 1e3:.3f} ms, bwd {b.backward_s * 1e3:.3f} ms, saved {format_bytes(b.saved_bytes)}, "
              f"input {format_bytes(b.input_bytes)}")
    if len(prof) > 4:
        print(f"  ... {len(prof) - 4} more")
    if args.out:
        prof.save(args.out)
        print(f"wrote {args.out}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from ooc.api import plan_for_profile
    from ooc.scheduler.planners import PLANNERS
    from ooc.scheduler.profile import Profile
    from ooc.scheduler.schedule import build_schedule
    from ooc.scheduler.simulate import predict
    from ooc.scheduler.units import format_bytes, parse_bytes

    prof = Profile.load(args.profile)
    hw = _hardware(args.hardware, "h100-sxm" if prof.machine.get("backend") != "cpu" else "cpu")
    budget = parse_bytes(args.budget, what="--budget")
    ideal = predict(PLANNERS["keep-all"](prof, hw, None), prof, hw).step_time_s
    chosen = plan_for_profile(prof, budget, hardware=hw, planner=args.planner, prefetch=args.prefetch,
                              include_params=args.include_params)
    print(chosen.table(prof.names))
    print()
    if args.include_params:
        schedule = build_schedule(chosen, prof, hw)
        result = predict(chosen, prof, hw)
        print(f"parameters + saved activations: peak {format_bytes(schedule.param_peak_bytes)} + "
              f"{format_bytes(schedule.peak_bytes)} within {format_bytes(budget)}; "
              f"{sum(b.streamed for b in chosen.blocks)} of {len(chosen)} blocks stream their parameters; "
              f"step {result.step_time_s * 1e3:.2f} ms ({result.step_time_s / ideal:.3f}x ideal) on {hw.name}")
        if args.out:
            Path(args.out).write_text(chosen.to_json())
            print(f"wrote {args.out}")
        return 0
    rows = [("planner", "step ms", "x ideal", "peak", "fits")]
    for name, planner in PLANNERS.items():
        try:
            plan = planner(prof, hw, budget, prefetch=args.prefetch)
        except ValueError:
            rows.append((name, "-", "-", "-", "no plan"))
            continue
        result = predict(plan, prof, hw)
        fits = build_schedule(plan, prof).peak_bytes <= budget
        rows.append((name, f"{result.step_time_s * 1e3:.2f}", f"{result.step_time_s / ideal:.3f}", format_bytes(result.peak_bytes), "yes" if fits else "no"))
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    for k, row in enumerate(rows):
        print("  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))))
        if k == 0:
            print("  ".join("-" * w for w in widths))
    print(f"budget {format_bytes(budget)} on {hw.name}; ideal (keep-all, unlimited memory) {ideal * 1e3:.2f} ms")
    if args.out:
        Path(args.out).write_text(chosen.to_json())
        print(f"wrote {args.out}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    if args.check:
        from ooc.apps.check import calibration_check, check_failures, format_check

        hardware = _hardware(args.hardware) if args.hardware else None
        rows = calibration_check(reps=args.reps, hardware=hardware, show=lambda line: print(line, file=sys.stderr, flush=True))
        print(format_check(rows))
        missed = check_failures(rows)  # step times were reported, and a miss exited 0
        for line in missed:
            print(f"ooc simulate --check: {line}", file=sys.stderr)
        if missed:
            print("ooc simulate --check: the performance model missed. Step times vary on a busy machine: run again "
                  "with more --reps, and pass --hardware the JSON `ooc calibrate --out` measured here", file=sys.stderr)
        return 1 if missed else 0
    from ooc.scheduler.plan import Plan
    from ooc.scheduler.profile import Profile
    from ooc.scheduler.schedule import build_schedule
    from ooc.scheduler.simulate import simulate

    if not args.profile or not args.plan:
        raise ValueError("ooc simulate needs --profile P.json and --plan Q.json (or --check)")
    prof = Profile.load(args.profile)
    plan_path = Path(args.plan)
    if not plan_path.is_file():
        raise ValueError(f"no plan at {plan_path}; make one with `ooc plan --profile {args.profile} --budget ... --out {plan_path}`")
    plan = Plan.from_json(plan_path.read_text())
    hw = _hardware(args.hardware, "h100-sxm" if prof.machine.get("backend") != "cpu" else "cpu")
    result = simulate(build_schedule(plan, prof, hw), hw)
    print(result.summary())
    if args.timeline:
        from ooc.apps.plots import plot_timeline

        plot_timeline(result, args.timeline, title=f"{prof.model}, plan {plan.name} on {hw.name}")
        print(f"wrote {args.timeline}")
    if args.trace:
        from ooc.scheduler.trace import write_chrome_trace

        write_chrome_trace(result, args.trace, name=f"{prof.model} {plan.name}")
        print(f"wrote {args.trace}")
    return 0


def _partition(args: argparse.Namespace) -> int:
    from ooc.apps.partition import PartitionConfig, run_partition

    methods = tuple(args.method) if args.method else PartitionConfig.methods
    return run_partition(PartitionConfig(
        graph=args.graph, devices=args.devices, capacity=args.capacity, methods=methods,
        bandwidth_GBps=args.bandwidth, latency_us=args.latency, batch=args.batch, seq=args.seq,
        export_pardnn=args.export_pardnn, gantt=args.gantt, placement=args.placement))


def _calibrate(args: argparse.Namespace) -> int:
    from ooc.calibrate import calibrate

    print("measuring copies each way and both at once, copy latency, compute under copies and the host AdamW "
          "rate (a minute or two)", file=sys.stderr, flush=True)
    hw = calibrate(args.backend)
    print(hw.describe())
    print(f"compute slowdown while copying {hw.compute_slowdown:.2f}, per-copy compute {hw.copy_issue_s * 1e6:.0f} us")
    if args.out:
        Path(args.out).write_text(hw.to_json())
        print(f"wrote {args.out}")
    return 0


def _planner_help() -> str:
    from ooc.scheduler.planners import PLANNERS

    return f"one of {', '.join(PLANNERS)} (default %(default)s)"


def _hardware_help() -> str:
    from ooc.scheduler.hardware import PRESETS

    return f"a preset ({', '.join(sorted(PRESETS))}) or a JSON file from `ooc calibrate --out`"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ooc", description="Out-of-core training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a tiny GPT under a memory budget that forces keep/swap/recompute")
    demo.add_argument("--steps", type=int, default=300, help="training steps (default %(default)s; at least 10)")
    demo.add_argument("--batch-size", type=int, default=16, help="sequences of 64 characters per step (default %(default)s)")
    demo.add_argument("--budget-fraction", type=float, default=0.4,
                      help="budget as a fraction of the keep-all peak, in (0, 1] (default %(default)s)")
    demo.add_argument("--planner", default="optimal", help=_planner_help())
    demo.add_argument("--seed", type=int, default=0, help="seed of the weights, batches and dropout (default %(default)s)")
    demo.add_argument("--threads", type=int, default=None,
                      help="torch threads (default: one on a CPU whose cores the load average fills, else torch's own)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    demo.set_defaults(run=_demo)

    prof = sub.add_parser("profile", help="measure a reference model's blocks, or build an analytic profile")
    prof.add_argument("--model", default="gpt:tiny",
                      help="gpt:<preset> (nano, tiny, gpt2, ...), cnn or mlp, measured here (default %(default)s)")
    prof.add_argument("--analytic", help="gpt2-xl, decoder-7b, wrn-28-10 or resnet-1001 (roofline on --hardware)")
    prof.add_argument("--batch", type=int, default=16, help="batch size of the profiled input (default %(default)s)")
    prof.add_argument("--seq", type=int,
                      help="sequence length of a GPT, at most its block_size, or of an analytic transformer (default: "
                      "64, or a GPT's block_size where that is shorter)")
    prof.add_argument("--reps", type=int, default=3, help="timed steps per block; the median is kept (default %(default)s)")
    prof.add_argument("--hardware", help=_hardware_help())
    prof.add_argument("--flash-attention", action="store_true", help="analytic transformers: fused attention, scores never materialised")
    prof.add_argument("--ops", action="store_true",
                      help="measured models: also time each block's forward op by op (for the op-level planner)")
    prof.add_argument("--out", type=_output_file, help="write the profile JSON here")
    prof.set_defaults(run=_profile)

    plan = sub.add_parser("plan", help="choose a plan for a profile under a budget; compare every planner")
    plan.add_argument("--profile", required=True, help="a profile JSON from `ooc profile --out` (or profiles/*.json)")
    plan.add_argument("--budget", required=True,
                      help="device bytes for saved activations, e.g. 20GiB, 512MiB or 1.5GB (GiB/MiB: powers of 2)")
    plan.add_argument("--planner", default="optimal", help=_planner_help() + "; the table compares them all")
    plan.add_argument("--hardware", help=_hardware_help())
    plan.add_argument("--prefetch", type=int, default=2,
                      help="swapped blocks whose copies back may be in flight at once (default %(default)s)")
    plan.add_argument("--include-params", action="store_true",
                      help="the budget covers parameters too; stream some blocks' parameters from the host")
    plan.add_argument("--out", type=_output_file, help="write the chosen plan JSON here")
    plan.set_defaults(run=_plan)

    sim = sub.add_parser("simulate", help="predict a plan's step; draw its timeline; or check the model against runs")
    sim.add_argument("--profile", help="a profile JSON from `ooc profile --out`")
    sim.add_argument("--plan", help="a plan JSON from `ooc plan --out`, for the same model as --profile")
    sim.add_argument("--hardware", help=_hardware_help())
    sim.add_argument("--timeline", type=_output_file, help="write a PNG Gantt chart with the memory curve")
    sim.add_argument("--trace", type=_output_file, help="write a Chrome/Perfetto trace JSON")
    sim.add_argument("--check", action="store_true", help="predicted vs measured on the demo GPT (keep/swap/recompute/mixed); "
                     "exits 1 where a peak misses by more than 1%% + 1 MiB or a step time by more than 20%%")
    sim.add_argument("--reps", type=int, default=10, help="--check: measured steps per plan (default %(default)s)")
    sim.set_defaults(run=_simulate)

    tr = sub.add_parser("train", help="train the reference GPT with the host optimizer; data-parallel under torchrun",
                        description="Single process: `ooc train`. Data-parallel on one machine: `torchrun "
                        "--nproc_per_node=2 -m ooc train`. Across machines: `torchrun --nnodes=2 --nproc_per_node=G "
                        "--rdzv_backend=c10d --rdzv_endpoint=HOST:PORT -m ooc train` on each. Ctrl-C stops it after the "
                        "checkpoint version in flight is written, naming the newest one (exit status 130).")
    tr.add_argument("--preset", default="tiny", help="GPT preset (nano, tiny, ...)")
    tr.add_argument("--steps", type=int, default=50, help="steps this run adds, after a resumed version's (default %(default)s)")
    tr.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per rank")
    tr.add_argument("--seq", type=int, help="characters per sequence, at most the preset's block_size "
                    "(default: 64, or the preset's block_size where that is shorter)")
    tr.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default %(default)s)")
    tr.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default %(default)s)")
    tr.add_argument("--seed", type=int, default=0, help="seed of the weights, batches and dropout (default %(default)s)")
    tr.add_argument("--dtype", default="float32",
                    help="parameter dtype: float32, bfloat16, or float16 (the loss scaled by the optimizer, as GradScaler does)")
    tr.add_argument("--dropout", type=float, help="dropout probability (default: the preset's)")
    tr.add_argument("--plan", default="recompute",
                    help="keep, swap, recompute, budget:<fraction of the keep-all peak> or a plan JSON file from "
                         "`ooc plan --out` (default %(default)s)")
    tr.add_argument("--shard", action="store_true", help="shard the host optimizer state across ranks")
    tr.add_argument("--reduce-on", default="auto",
                    help="where gradients are summed: device, host, auto (device with NCCL, else host) or model "
                         "(the performance model chooses from a profile)")
    tr.add_argument("--delayed-update", action="store_true", help="one-step-stale updates (changes numerics)")
    tr.add_argument("--accumulate", type=int, default=1, help="micro-batches per step per rank")
    tr.add_argument("--max-grad-norm", type=float, help="clip gradients to this global norm")
    tr.add_argument("--device-params-below", type=int, default=0,
                    help="parameters with fewer elements keep a device optimizer (norms, biases)")
    tr.add_argument("--no-pipeline", action="store_true",
                    help="update in step() after the backward (faster where compute already uses every core)")
    tr.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait for a peer")
    tr.add_argument("--out", type=_output_file, help="write losses and step times as JSON (rank 0)")
    tr.add_argument("--save", help="checkpoint directory: a version at the end (and every --save-every steps)")
    tr.add_argument("--save-every", type=int, default=0, help="also save a version every N steps (0: only at the end)")
    tr.add_argument("--keep", type=int, default=None, help="versions kept in --save's directory (default 3)")
    tr.add_argument("--resume", help="continue from a checkpoint directory's newest complete version; auto: "
                    "from --save's, or a fresh start if it has none")
    tr.add_argument("--no-progress", action="store_true", help="a log line per step instead of a progress bar")
    tr.add_argument("--device", default="auto",
                    help="auto (cuda:LOCAL_RANK when CUDA exists, else cpu), cuda (cuda:LOCAL_RANK), cuda:N or cpu")
    tr.set_defaults(run=_train)

    ck = sub.add_parser("checkpoints", help="list a checkpoint directory's complete versions with their metadata")
    ck_sub = ck.add_subparsers(dest="action", required=True)
    ck_list = ck_sub.add_parser("list", help="one line per complete version: step, time, bytes, ranks, folder, metadata; "
                                 "and per version whose commit record is damaged: step, DAMAGED, why")
    ck_list.add_argument("directory", help="the directory given to --save (or to Checkpointer)")
    ck_list.set_defaults(run=_checkpoints)

    part = sub.add_parser("partition", help="place a training op graph on K devices under memory limits (ParDNN and baselines)")
    part.add_argument("--graph", default="lstm:1000",
                      help="lstm:N, transformer:N, cnn3d:N (analytic, about N ops), gpt:<preset>, cnn, mlp "
                      "(captured here), an ooc profile (.json: its chain op by op, e.g. profiles/analytic-*.json) or a "
                      "folder in ParDNN's format")
    part.add_argument("--devices", type=int, default=2, help="K")
    part.add_argument("--capacity", help="bytes per device, e.g. 2GiB (default: all the graph holds)")
    part.add_argument("--method", action="append", help="pardnn, contiguous, heft or mincut (repeat; default all)")
    part.add_argument("--bandwidth", type=float, default=50.0, help="link GB/s per direction")
    part.add_argument("--latency", type=float, default=10.0, help="link latency per copy, us")
    part.add_argument("--batch", type=int, default=8, help="batch of a captured reference model")
    part.add_argument("--seq", type=int, help="sequence length of a captured GPT, at most its block_size (default: 64, "
                      "or its block_size where that is shorter)")
    part.add_argument("--export-pardnn", metavar="DIR", help="write the graph in ParDNN's format (with settings.json)")
    part.add_argument("--gantt", metavar="PNG", type=_output_file, help="draw the best placement: ops per device, copies per link, memory")
    part.add_argument("--placement", metavar="FILE", type=_output_file, help="write the best placement as ParDNN's `name device` lines")
    part.set_defaults(run=_partition)

    cal = sub.add_parser("calibrate", help="measure this machine's copy engines and host optimizer rate")
    cal.add_argument("--backend", default="auto", help="auto (cuda if there is a GPU, else cpu), cuda or cpu")
    cal.add_argument("--out", type=_output_file, help="write the hardware JSON here")
    cal.set_defaults(run=_calibrate)

    doc = sub.add_parser("doctor", help="first contact with a GPU machine: run every check and write doctor.md/doctor.json")
    doctor.add_arguments(doc)
    doc.set_defaults(run=doctor.run)
    return parser


INTERRUPTED = 130
"""The exit status after Ctrl-C, as a shell reports a process SIGINT ended (128 + 2)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as exc:
        print(f"ooc {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback through torch's internals
        print(f"ooc {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED



def run() -> NoReturn:
    """The ``ooc`` command and ``python -m ooc``: :func:`main`, then the process ends without the
    interpreter's teardown.

    NOTE [the command leaves without teardown]
    A daemon thread inside a torch call when the interpreter finalizes aborts the process: it
    wakes to take the GIL, CPython ends the thread there, and the unwinding through the binding's
    ``noexcept`` GIL release calls ``std::terminate`` ("terminate called without an active
    exception", SIGABRT; pytorch#38228; 6 of 6 runs of a script that exits with one such thread).
    ooc closes its own threads before it returns (NOTE [threads stop at exit] in
    ooc.optim.pipeline), but a join that times out on an overloaded machine, or any library's thread,
    still can be there: `ooc train --resume auto` died so once in ~40 runs with two pytest workers
    beside it. A command has closed its optimizer, backend and checkpoints and written its files by
    the time :func:`main` returns, so it flushes stdout and stderr and leaves with ``os._exit``. An
    exception (or ``SystemExit`` from the argument parser) still goes through the interpreter.
    ``main`` itself returns, for callers in the same process."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
