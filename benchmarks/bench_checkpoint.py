"""Claim (issue 14): ``Checkpointer.save`` blocks the training loop only for a small copy; the
snapshot of the host state, serialization, checksums and fsyncs run on a thread.

Measured on a GPT (default: the gpt2 preset, 124M parameters; ``--quick``: 4x256) trained with the
pipelined HostAdamW on the CPU backend, each figure beside its baseline from the same run:
- time one ``save()`` blocks the loop (lazy snapshot; and ``lazy=False``, everything copied in
  ``save``) vs a synchronous ``torch.save`` of the same state + fsync (goal: <= 5%);
- mean step time with a save every 10 steps and every step vs no checkpoints, in interleaved blocks of
  10 steps, each including the wait for its last write (goals: <= 3.5%, the CheckFreq figure, and
  <= 10%);
- with ``--pairs N``, N more pairs of 10-step blocks (no saves, a save every 10 steps; each first in turn): the
  every-10 figure's mean over the pairs and its 95% bootstrap interval, which says whether the goal
  is met where two rounds' medians cannot;
- the same with a save asked for every step with ``if_busy="skip"`` (no wait: a step whose save
  finds the previous version still being written gets none; the row says how many were written);
- the two floors of a version every step: the time its bytes take at the disk's bandwidth (writes
  go at most as fast as ``dd``) vs the step time, and the writer's CPU time per version (its
  thread's and the I/O thread's: the copy into the bounce buffers, the CRC, the kernel's direct
  writes) vs a step's CPU time: on a machine
  whose cores the training keeps busy, that CPU time comes out of the steps;
- write bandwidth (a version's bytes over the time from ``save()`` to its commit, checksums and fsyncs
  included) vs the disk's, measured with ``dd oflag=direct conv=fsync`` of as many bytes in the
  same folder;
- the time from save() to a version committed and the one before retired, with no training beside
  it, written over the files of the version retired before (NOTE [recycled files]) vs into new
  files, deleting the retired one (the path before);
- extra host memory: the peak resident set while a save is written, above the one before it, vs the
  bytes of the state (the lazy snapshot writes from the live tensors; it copies a bucket aside only
  when the bucket's update comes before its write, which the blocking measurement never lets happen;
  the step-time rows count such copies).

- the writer's CPU time per version of a 100M-parameter state (24 Linear(2048, 2048), HostAdamW, 1.2 GB
  written), load-independent: the thread CPU time of the writer thread, its I/O thread and its fsync
  threads, this version (pieces of large tensors written straight from their memory: NOTE [writes
  straight from the tensors]) vs every byte copied into the bounce buffers and each piece's bytes taken
  with torch calls (the version before), in
  turns, in the same run (``--writer-cpu`` measures only this).

``--profile`` also prints where the writer thread spends its time over the timed lazy saves
(cProfile, by own time: checksums, writes, fsyncs, serialization).

Run: ``python benchmarks/bench_checkpoint.py [--quick] [--rounds 2] [--pairs 20] [--dir DIR] [--profile]``. The step
figures vary by several points from run to run with 2 rounds; the README quotes ``--rounds 6``. With
``OMP_NUM_THREADS=1`` the training runs on one core and the writer has the other (as on a GPU host,
whose cores the training mostly leaves idle); the header line says how many threads torch used.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_header, table  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def writer_cpu_per_version(directory: Path, repeats: int) -> list[list[str]]:
    """Rows: the thread CPU time the writer spends on one version of a ~100M-parameter state, now
    vs with every byte through the bounce buffers (the path before), median of ``repeats`` each,
    in turns. CPU time, not wall time: a loaded machine stretches the wall time, hardly this."""
    import torch

    import ooc.checkpoint as ckpt_mod
    from ooc.checkpoint import Checkpointer
    from ooc.optim import HostAdamW
    from ooc.scheduler.units import format_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(24)])
    opt = HostAdamW(model.parameters(), lr=1e-3, model=model)
    model(torch.randn(2, 2048)).square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    opt.synchronize()
    threads = [0.0]  # CPU seconds of the I/O and fsync threads
    cpu: list[tuple[float, float]] = []  # per version: the writer thread's, the I/O and fsync threads'

    sink_write, fsync_dir, direct_span = ckpt_mod._Sink.write, ckpt_mod._fsync_dir, ckpt_mod._direct_span
    piece = ckpt_mod._TensorFile._piece

    def timed(fn, only_on: str | None = None):  # noqa: ANN001, ANN202
        def run(*args: object) -> object:
            if only_on is not None and threading.current_thread().name != only_on:
                return fn(*args)  # on the writer thread: counted with it
            before = time.thread_time()
            try:
                return fn(*args)
            finally:
                threads[0] += time.thread_time() - before
        return run

    class Counted(Checkpointer):
        def _write(self, *job: object) -> None:
            before, others = resource.getrusage(resource.RUSAGE_THREAD), threads[0]
            try:
                super()._write(*job)
            finally:
                after = resource.getrusage(resource.RUSAGE_THREAD)
                cpu.append((after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, threads[0] - others))

    ckpt_mod._Sink.write = timed(sink_write)
    ckpt_mod._fsync_dir = timed(fsync_dir, "ooc-checkpoint-fsync")
    figures: dict[str, list[tuple[float, float]]] = {"now": [], "before": []}
    try:
        ckpt = Counted(directory / "writer-cpu", model, opt, keep=1)
        for i in range(2 * repeats + 2):
            mode = "now" if i % 2 else "before"
            # Before: every byte copied into the bounce buffers, each piece's bytes taken with torch calls.
            ckpt_mod._direct_span = direct_span if mode == "now" else lambda address, position, size, alignment: (size, size)
            ckpt_mod._TensorFile._piece = piece if mode == "now" else \
                lambda file, name, t, start: ckpt_mod._tensor_bytes(t, start, start + ckpt_mod._SLICE_BYTES)
            ckpt.save(i)
            ckpt.wait()
            if i >= 2:  # the first two write new files; then each is written over a spare's (NOTE [recycled files])
                figures[mode].append(cpu[-1])
        version = sum(f["bytes"] for f in ckpt.latest().files.values())
        ckpt.close()
    finally:
        ckpt_mod._Sink.write, ckpt_mod._fsync_dir, ckpt_mod._direct_span = sink_write, fsync_dir, direct_span
        ckpt_mod._TensorFile._piece = piece
        opt.close()
    per_gb = lambda s: f"{s / version * 1e9 * 1e3:.0f} ms/GB"  # noqa: E731
    rows = [["figure", "now", "before", "ratio", "napkin"]]
    for what, part in (("writer + I/O + fsync threads", sum), ("writer thread (copy, checksum, serialization)",
                                                                   lambda t: t[0]),
                       ("I/O + fsync threads (the kernel's direct writes)", lambda t: t[1])):
        now = statistics.median(part(t) for t in figures["now"])
        before = statistics.median(part(t) for t in figures["before"])
        rows.append([f"writer's CPU per version of 100.7M params ({format_bytes(version)}), {what}, median of {repeats}",
                     f"{now * 1e3:.1f} ms", f"every byte bounced {before * 1e3:.1f} ms", f"{now / before:.2f}x",
                     f"{per_gb(now)} vs {per_gb(before)}"])
    return rows


def mean_interval(samples: list[float], resamples: int = 10_000) -> tuple[float, float, float]:
    """The mean of ``samples`` and its 95% bootstrap interval (percentiles of the means of
    ``resamples`` draws with replacement, seeded: the same samples give the same interval)."""
    draw = random.Random(0)
    means = sorted(statistics.fmean(draw.choices(samples, k=len(samples))) for _ in range(resamples))
    return statistics.fmean(samples), means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def rss() -> int:
    """This process's resident bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRss:
    """Samples the resident set every millisecond on a thread; ``stop()`` returns the peak."""

    def __init__(self) -> None:
        self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss())


def dd_bandwidth(directory: Path, nbytes: int) -> tuple[float, str]:
    """Bytes per second ``dd`` writes ``nbytes`` of zeros to a file in ``directory`` (direct I/O if
    the file system takes it), fsync included."""
    path = directory / "dd.bin"
    count = max(1, nbytes >> 20)
    try:
        for flags in (["oflag=direct", "conv=fsync"], ["conv=fsync"]):
            started = time.perf_counter()
            done = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={count}", *flags],
                                  capture_output=True, text=True)
            elapsed = time.perf_counter() - started
            if done.returncode == 0:
                return (count << 20) / elapsed, f"dd bs=1M count={count} {' '.join(flags)}"
        raise RuntimeError(f"dd failed: {done.stderr}")
    finally:
        path.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a 4x256 GPT (3M parameters) instead of gpt2 (124M)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of four 10-step blocks (no saves, every 10, every step, every step skipping) "
                             "for the step times (default 2, quick 8)")
    parser.add_argument("--pairs", type=int, default=0,
                        help="then this many pairs of 10-step blocks, no saves and a save every 10 steps, each first in "
                             "turn, for that figure's mean and 95%% interval over the pairs")
    parser.add_argument("--saves", type=int, default=3, help="saves timed for the blocking figure")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dir", default=None, help="folder to write in (default: a temporary one under /tmp)")
    parser.add_argument("--profile", action="store_true", help="print where the writer thread spends its time")
    parser.add_argument("--writer-cpu", action="store_true", help="measure only the writer's CPU time per version")
    parser.add_argument("--cpu-repeats", type=int, default=5, help="versions timed per path for the writer's CPU")
    args = parser.parse_args()
    if args.writer_cpu:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            rows = writer_cpu_per_version(Path(tmp), args.cpu_repeats)
        print(machine_header("bench_checkpoint --writer-cpu: thread CPU time per version"))
        print(table(rows))
        return
    rounds = args.rounds or (8 if args.quick else 2)

    import torch

    import ooc.checkpoint as ckpt_mod
    from ooc.checkpoint import Checkpointer
    from ooc.models.gpt import GPT, GPT_PRESETS, GPTConfig
    from ooc.optim import HostAdamW
    from ooc.scheduler.units import format_bytes

    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=4, n_head=4, n_embd=256, dropout=0.0) if args.quick \
        else replace(GPT_PRESETS["gpt2"], block_size=args.seq)
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

    for _ in range(2):
        step()
    opt.synchronize()
    params = sum(p.numel() for p in model.parameters())
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    print(machine_header(f"bench_checkpoint: GPT {cfg.n_layer}x{cfg.n_embd}, vocab {cfg.vocab_size} ({params / 1e6:.1f}M "
                         f"fp32 params), batch {args.batch}x{args.seq}, HostAdamW pipelined, CPU backend; state "
                         f"{format_bytes(state_bytes)}"))

    profile = cProfile.Profile()
    writer_cpu: list[float] = []
    io_cpu = [0.0]
    sink_write = ckpt_mod._Sink.write

    def timed_sink_write(sink: ckpt_mod._Sink, data: memoryview) -> None:
        """The direct writes run on an I/O thread (NOTE [direct writes]): their CPU time counts too."""
        before = time.thread_time()
        try:
            sink_write(sink, data)
        finally:
            io_cpu[0] += time.thread_time() - before

    ckpt_mod._Sink.write = timed_sink_write

    class ProfiledCheckpointer(Checkpointer):
        """Measures the CPU time of the writer thread's work on each version and, with --profile,
        profiles it (cProfile sees only its own thread)."""

        def _write(self, *job: object) -> None:
            before, io_before = resource.getrusage(resource.RUSAGE_THREAD), io_cpu[0]
            if args.profile:
                profile.enable()
            try:
                super()._write(*job)
            finally:
                if args.profile:
                    profile.disable()
                after = resource.getrusage(resource.RUSAGE_THREAD)
                writer_cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
                                  + io_cpu[0] - io_before)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        cpu_rows = writer_cpu_per_version(root, args.cpu_repeats)
        disk, dd_cmd = dd_bandwidth(root, state_bytes)

        # Blocking time of save() (lazy and eager snapshot) vs a synchronous torch.save (+ fsync), with
        # the write bandwidth and the extra resident memory of each.
        lazy = ProfiledCheckpointer(root / "lazy", model, opt, keep=1)
        eager = Checkpointer(root / "eager", model, opt, keep=1, lazy=False)
        blocked: dict[str, list[float]] = {"lazy": [], "eager": [], "torch.save": []}
        written: dict[str, list[float]] = {"lazy": [], "eager": [], "torch.save": []}
        extra: dict[str, list[int]] = {"lazy": [], "eager": [], "torch.save": []}
        version_bytes = 0
        for i in range(args.saves):
            step()
            for name, saver in (("lazy", lazy), ("eager", eager)):
                opt.synchronize()
                before, peak = rss(), PeakRss()
                started = time.perf_counter()
                saver.save(i)
                blocked[name].append(time.perf_counter() - started)
                saver.wait()
                written[name].append(time.perf_counter() - started)
                extra[name].append(peak.stop() - before)
                version_bytes = sum(f["bytes"] for f in saver.latest().files.values())
            opt.synchronize()
            before, peak = rss(), PeakRss()
            started = time.perf_counter()
            with open(root / "sync.pt", "wb") as f:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            blocked["torch.save"].append(time.perf_counter() - started)
            written["torch.save"].append(blocked["torch.save"][-1])
            extra["torch.save"].append(peak.stop() - before)
        sync_bytes = (root / "sync.pt").stat().st_size
        lazy.close()
        eager.close()

        # The time from save() to a version committed and the one before retired, with no training
        # beside it: written over the files of the version retired before (NOTE [recycled files]) vs
        # into new files, the retired version deleted (the path before), in turns.
        quiet_wall: dict[str, list[float]] = {"recycled": [], "new files": []}
        alone = {path: Checkpointer(root / path.replace(" ", "-"), model, opt, keep=1) for path in quiet_wall}
        alone["new files"]._recycle = lambda path: None
        alone["new files"]._retire = lambda step, path: shutil.rmtree(path)
        for i in range(args.saves + 2):
            for path, saver in alone.items():
                opt.synchronize()
                started = time.perf_counter()
                saver.save(i)
                saver.wait()
                if i >= 2:  # a spare exists from the second save's retirement on
                    quiet_wall[path].append(time.perf_counter() - started)
        for saver in alone.values():
            saver.close()

        # Mean step time over blocks of 10 steps with no saves, a save at the block's first step, and
        # a save every step, the three interleaved round by round (a machine shared with other work
        # drifts). A block's time includes waiting for its last write, so every write is paid for.
        # "skip": a save asked for every step with if_busy="skip" (NOTE [skipped saves]); the block's
        # last save waits, as a run's last save should.
        modes = {0: 0, 10: 10, 1: 1, "skip": 1}
        savers = {mode: Checkpointer(root / f"every{mode}", model, opt, keep=2) if every else None
                  for mode, every in modes.items()}
        # The extra host memory of a version: what the updates copy aside before the writer has read
        # it (alive until the version is written), summed per snapshot, largest per mode.
        aside: dict[int, int] = {}
        aside_mode: dict[int, int | str] = {}
        gated: dict[int, float] = {}
        """Per snapshot: seconds the updates spent in the listener (waiting for the writer's slice,
        copying aside), on the thread whose updates the next forward waits for."""
        before_update = ckpt_mod._Snapshot.before_update

        def counting_before_update(snapshot: ckpt_mod._Snapshot, bucket: int) -> bool:
            with snapshot._cond:
                unread = [snapshot._refs[slot] for slot in snapshot._unread.get(bucket, ())]
                nbytes = sum(c[k].numel() * c[k].element_size() for c, k in unread)
            aside[id(snapshot)] = aside.get(id(snapshot), 0) + nbytes
            aside_mode[id(snapshot)] = current_mode[0]
            started = time.perf_counter()
            try:
                return before_update(snapshot, bucket)
            finally:
                gated[id(snapshot)] = gated.get(id(snapshot), 0.0) + time.perf_counter() - started

        ckpt_mod._Snapshot.before_update = counting_before_update
        current_mode: list[int | str] = [0]
        blocks: dict[int | str, list[float]] = {mode: [] for mode in savers}
        asked = written_versions = done = 0
        step_cpu: list[float] = []
        for _ in range(rounds):
            for mode, saver in savers.items():
                current_mode[0] = mode
                cpu_before = resource.getrusage(resource.RUSAGE_SELF)
                started = time.perf_counter()
                for i in range(10):
                    step()
                    done += 1
                    if saver is not None and i % modes[mode] == 0:
                        skip = mode == "skip" and i < 9
                        wrote = saver.save(done, if_busy="skip" if skip else "wait")
                        if mode == "skip":
                            asked += 1
                            written_versions += wrote
                if saver is not None:
                    saver.wait()
                opt.synchronize()
                blocks[mode].append((time.perf_counter() - started) / 10)
                if saver is None:
                    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
                    step_cpu.append((cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime) / 10)
        # Pairs of 10-step blocks, no saves and a save every 10 steps, each first in turn, so that a
        # drift of the machine adds as much to each: the per-pair ratio's mean and interval say whether the
        # every-10 figure is within its goal, which two rounds' medians cannot (their spread is a
        # few points).
        paired_savers: dict[str, Checkpointer | None] = {"none": None, "every 10 steps": savers[10]}
        paired: dict[str, list[float]] = {name: [] for name in paired_savers if name != "none"}
        for pair in range(args.pairs):
            seconds: dict[str, float] = {}
            names = list(paired_savers)
            for name in names[pair % len(names):] + names[:pair % len(names)]:  # each block first in turn
                saver = paired_savers[name]
                current_mode[0] = 10 if saver is savers[10] else 0
                started = time.perf_counter()
                for i in range(10):
                    step()
                    done += 1
                    if saver is not None and i == 0:
                        saver.save(done)
                if saver is not None:
                    saver.wait()
                opt.synchronize()
                seconds[name] = (time.perf_counter() - started) / 10
            for name in paired:
                paired[name].append(seconds[name] / seconds["none"] - 1)
        times = {mode: statistics.median(b) for mode, b in blocks.items()}
        copied = {mode: saver.copied_by_listener for mode, saver in savers.items() if saver is not None}
        most_aside = {mode: max([b for s, b in aside.items() if aside_mode[s] == mode], default=0) for mode in savers}
        most_gated = {mode: max([g for s, g in gated.items() if aside_mode[s] == mode], default=0.0) for mode in savers}
        for saver in savers.values():
            if saver is not None:
                saver.close()
    opt.close()

    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    med = statistics.median
    sync = med(blocked["torch.save"])
    base = times[0]
    gbs = lambda b, s: f"{b / s / 1e9:.2f} GB/s"  # noqa: E731
    print(table([
        ["figure", "ooc", "baseline", "ratio", "goal"],
        ["save() blocks the loop (lazy snapshot)", ms(med(blocked["lazy"])), f"torch.save+fsync {ms(sync)}",
         f"{med(blocked['lazy']) / sync * 100:.1f}%", "<= 5%"],
        ["save() blocks the loop (lazy=False)", ms(med(blocked["eager"])), f"torch.save+fsync {ms(sync)}",
         f"{med(blocked['eager']) / sync * 100:.1f}%", ""],
        [f"mean step, a save every 10 steps ({copied[10]} buckets copied by the update thread)", ms(times[10]),
         f"no saves {ms(base)}", f"{(times[10] / base - 1) * 100:+.1f}%", "<= 3.5%"],
        [f"mean step, a save every step ({copied[1]} buckets copied by the update thread)", ms(times[1]),
         f"no saves {ms(base)}", f"{(times[1] / base - 1) * 100:+.1f}%", "<= 10%"],
        [f"mean step, a save asked every step, if_busy='skip' ({written_versions} of {asked} written, "
         f"{copied['skip']} buckets copied)", ms(times["skip"]), f"no saves {ms(base)}",
         f"{(times['skip'] / base - 1) * 100:+.1f}%", ""],
        ["a version's bytes at dd's bandwidth, vs a step (disk floor of a version every step)",
         ms(version_bytes / disk), f"step (wall) {ms(base)}", f"{version_bytes / disk / base * 100:.0f}%", ""],
        ["writer's CPU time per version (copy, CRC, kernel; writer + I/O thread), vs a step's (all threads)",
         ms(med(writer_cpu)), f"step (CPU) {ms(med(step_cpu))}", f"{med(writer_cpu) / med(step_cpu) * 100:.0f}%", ""],
        ["a version, save() to committed and the one before retired, no training: over the retired one's files",
         ms(med(quiet_wall["recycled"])), f"into new files, the retired deleted {ms(med(quiet_wall['new files']))}",
         f"{med(quiet_wall['recycled']) / med(quiet_wall['new files']) * 100:.0f}%", ""],
        ["write bandwidth, save() to commit (lazy)", gbs(version_bytes, med(written["lazy"])), f"{dd_cmd}: {gbs(1, 1 / disk)}",
         f"{version_bytes / med(written['lazy']) / disk * 100:.0f}%", ""],
        ["write bandwidth, torch.save+fsync", gbs(sync_bytes, sync), f"{dd_cmd}: {gbs(1, 1 / disk)}",
         f"{sync_bytes / sync / disk * 100:.0f}%", ""],
        ["extra host memory while a save is written (lazy, no training meanwhile)", format_bytes(max(extra["lazy"])),
         f"state {format_bytes(state_bytes)}", f"{max(extra['lazy']) / state_bytes:.2f}x", ""],
        *[[f"extra host memory while training, a save every {modes[mode]} step(s): most copied aside for one version",
           format_bytes(most_aside[mode]), f"state {format_bytes(state_bytes)}", f"{most_aside[mode] / state_bytes:.2f}x", ""]
          for mode in (10, 1)],
        *[[f"updates held by the checkpoint (waits for a slice, copies aside), a save every {modes[mode]} step(s): "
           "most for one version", ms(most_gated[mode]), f"step (wall) {ms(base)}", f"{most_gated[mode] / base * 100:.0f}%", ""]
          for mode in (10, 1)],
        ["extra host memory, torch.save", format_bytes(max(extra["torch.save"])), f"state {format_bytes(state_bytes)}",
         f"{max(extra['torch.save']) / state_bytes:.2f}x", ""],
    ]))
    if args.pairs:
        rows = [["figure", "ooc", "baseline", "ratio", "goal"]]
        for name, ratios in paired.items():
            mean, low, high = mean_interval(ratios)
            rows.append([f"mean step, a save {name}, over {len(ratios)} rounds of 10-step blocks in turns: mean, "
                         "95% interval", f"{mean * 100:+.1f}%", "the round's block with no saves",
                         f"[{low * 100:+.1f}%, {high * 100:+.1f}%]", "<= 3.5%" if name == "every 10 steps" else ""])
        print(table(rows))
    print(table(cpu_rows))
    print(f"\nversion {format_bytes(version_bytes)} on disk, torch.save file {format_bytes(sync_bytes)}; step times: "
          f"median over {rounds} rounds of 10-step blocks; {args.saves} timed saves (median)")
    if args.profile:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(12)
        print(f"\nwriter thread over the {args.saves} timed lazy saves, by own time:\n"
              + out.getvalue().split("\n\n", 1)[-1].strip())


if __name__ == "__main__":
    main()
