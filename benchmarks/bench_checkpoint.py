"""Claim (issue 14): ``Checkpointer.save`` blocks the training loop only for a copy of the state; the
serialization, checksums and fsyncs run on a thread.

Measured on a GPT trained with the pipelined HostAdamW on the CPU backend:
- blocking time of one ``save()`` (lazy snapshot, and ``lazy=False``: everything copied in ``save``) vs
  a synchronous ``torch.save`` of the same state (+ fsync);
- median step time with no checkpoints, a save every 10 steps and a save every step;
- extra host memory: the bytes of the snapshot one ``save`` holds until its write is committed.

Run: ``python benchmarks/bench_checkpoint.py [--layers 4 --width 256 --steps 30]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_header, table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    import torch

    from ooc.checkpoint import Checkpointer
    from ooc.models.gpt import GPT, GPTConfig
    from ooc.optim import HostAdamW
    from ooc.scheduler.units import format_bytes

    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width, dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = HostAdamW(model.parameters(), lr=1e-3, model=model, pipeline=True)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    y = torch.roll(x, -1, dims=1)

    def step() -> None:
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    opt.synchronize()
    params = sum(p.numel() for p in model.parameters())
    print(machine_header(f"bench_checkpoint: GPT {args.layers}x{args.width} ({params / 1e6:.1f}M fp32 params), "
                         f"batch {args.batch}x{args.seq}, HostAdamW pipelined, CPU backend"))

    with tempfile.TemporaryDirectory() as root:
        # Blocking time of save() (lazy and eager snapshot) vs a synchronous torch.save (+ fsync).
        ckpt = Checkpointer(Path(root) / "async", model, opt, keep=2)
        eager = Checkpointer(Path(root) / "eager", model, opt, keep=2, lazy=False)
        blocking, blocking_eager, sync = [], [], []
        for i in range(5):
            for saver, into in ((ckpt, blocking), (eager, blocking_eager)):
                started = time.perf_counter()
                saver.save(i)
                into.append(time.perf_counter() - started)
                saver.wait()
            started = time.perf_counter()
            path = Path(root) / "sync.pt"
            with open(path, "wb") as f:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            sync.append(time.perf_counter() - started)
        snapshot = sum(f["bytes"] for f in ckpt.latest().files.values())
        ckpt.close()
        eager.close()

        # Step time with saves every k steps (each save waits for the previous write).
        times: dict[str, float] = {}
        copied: dict[str, int] = {}
        for label, every in (("no checkpoints", 0), ("save every 10 steps", 10), ("save every step", 1)):
            saver = Checkpointer(Path(root) / f"every{every}", model, opt, keep=2) if every else None
            seconds = []
            for i in range(args.steps):
                started = time.perf_counter()
                step()
                if saver is not None and (i + 1) % every == 0:
                    saver.save(i + 1)
                seconds.append(time.perf_counter() - started)
            if saver is not None:
                saver.close()
            opt.synchronize()
            times[label] = statistics.mean(seconds)
            if saver is not None:
                copied[label] = saver.copied_by_listener

    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    print(table([["what", "median", "min"],
                 ["save() blocking, lazy snapshot", ms(statistics.median(blocking)), ms(min(blocking))],
                 ["save() blocking, eager copy (lazy=False)", ms(statistics.median(blocking_eager)), ms(min(blocking_eager))],
                 ["torch.save + fsync (synchronous)", ms(statistics.median(sync)), ms(min(sync))]]))
    print()
    base = times["no checkpoints"]
    print(table([["checkpoints", "mean step", "overhead", "buckets copied by the update thread"]]
                + [[k, ms(v), f"{(v / base - 1) * 100:+.1f}%", str(copied.get(k, "-"))] for k, v in times.items()]))
    print(f"\nextra host memory while a write is in flight: one snapshot, {format_bytes(snapshot)} "
          f"(model {format_bytes(sum(p.numel() * p.element_size() for p in model.parameters()))} + optimizer state)")
    opt.close()


if __name__ == "__main__":
    main()
