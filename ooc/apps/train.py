"""``ooc train``: the reference GPT, out of core, data-parallel over every rank ``torchrun`` starts.

Each step takes one global batch of ``batch_size x world x accumulate`` sequences of the shipped
text; rank ``r`` trains on its micro-batches ``r*accumulate ... r*accumulate + accumulate - 1``,
each seeded by its place in the global batch (dropout included). So the run does not depend on how
the global batch is split: one process with ``accumulate=2`` computes what two ranks compute.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import ooc
from ooc.api import hardware_for
from ooc.apps.cli import DEFAULT_SEQ, INTERRUPTED
from ooc.apps.demo import CharData, load_text, plan_for_fraction
from ooc.backend import resolve_backend
from ooc.checkpoint import (
    Checkpointer,
    CorruptCheckpointError,
    NoIntactVersionError,
    UnreadableCheckpointError,
    Version,
    scan_versions,
)
from ooc.distributed import DataParallel, check_reduce_on, check_timeout, init_from_env, peer_failures
from ooc.errors import OocError
from ooc.models.gpt import GPT, GPT_PRESETS
from ooc.optim import HostAdamW, LossScale
from ooc.scheduler.dataparallel import choose_reduce_on
from ooc.scheduler.plan import Plan, Policy
from ooc.scheduler.units import format_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""float16 is loss-scaled by the optimizer (``HostAdamW(loss_scale=LossScale())``; NOTE [loss scaling in the
optimizer] in ooc.optim.loss_scale)."""


def _longer_presets(seq: int) -> str:
    """Advice to take a GPT preset whose sequences hold ``seq`` characters, if one does."""
    names = [f"{name}: {cfg.block_size}" for name, cfg in GPT_PRESETS.items() if cfg.block_size >= seq]
    return f", or a preset whose sequences hold {seq} ({', '.join(names)})" if names else ""


@dataclass(frozen=True)
class TrainConfig:
    """Options of ``ooc train`` (see ``ooc train --help``)."""

    preset: str = "tiny"
    steps: int = 50
    batch_size: int = 8
    """Sequences per micro-batch, per rank."""
    seq: int | None = None
    """Characters per sequence, at most the preset's ``block_size``; None: ``DEFAULT_SEQ``, or the
    preset's ``block_size`` where that is shorter."""
    lr: float = 3e-3
    weight_decay: float = 0.1
    seed: int = 0
    dtype: str = "float32"
    dropout: float | None = None
    """None: the preset's."""
    plan: str = "recompute"
    """keep, swap, recompute, a plan JSON file, or "budget:<fraction of the keep-all peak>"."""
    shard: bool = False
    reduce_on: str = "auto"
    delayed_update: bool = False
    accumulate: int = 1
    max_grad_norm: float | None = None
    device_params_below: int = 0
    pipeline: bool = True
    """Overlap each block's exchange and update with the backward (else all in ``step()``)."""
    timeout_s: float = 60.0
    out: str | None = None
    save: str | None = None
    """Checkpoint directory (``ooc.checkpoint.Checkpointer``): a version at the end of the run."""
    save_every: int = 0
    """Also a version every this many steps (0: only at the end)."""
    keep: int = 3
    """Versions kept in ``save``."""
    resume: str | None = None
    """A checkpoint directory (its newest complete version), or ``auto``: ``save``'s newest, or a fresh start."""
    progress: bool = True
    device: str = "auto"
    """Where the model trains: ``auto`` (``cuda:LOCAL_RANK`` when CUDA exists, else ``cpu``), ``cuda``
    (``cuda:LOCAL_RANK``), ``cuda:N`` or ``cpu``."""

    def __post_init__(self) -> None:
        if self.preset not in GPT_PRESETS:
            raise ValueError(f"no GPT preset {self.preset!r}; choose one of {sorted(GPT_PRESETS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("steps", "batch_size", "seq", "accumulate"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        longest = GPT_PRESETS[self.preset].block_size
        if self.seq is not None and self.seq > longest:
            # It was cut to the preset's length silently (the header line's "x 32" alone showed it).
            raise ValueError(f"--seq {self.seq} is longer than GPT preset {self.preset}'s sequences of at most {longest} "
                             f"characters (its block_size); pass --seq {longest} or less{_longer_presets(self.seq)}")
        if self.save_every < 0 or self.keep < 1:
            raise ValueError(f"--save-every must be >= 0 and --keep >= 1, got {self.save_every} and {self.keep}")
        if self.save_every and not self.save:
            # A run given --save-every alone trained to its end and saved nothing, without a word.
            raise ValueError("--save-every saves into --save's directory: give --save DIR too (without it nothing is saved)")
        if self.resume == "auto" and not self.save:
            raise ValueError("--resume auto continues from --save's directory: give --save DIR too")
        check_timeout(self.timeout_s, name="--timeout")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        check_reduce_on(self.reduce_on, extra=("model",))  # model: the performance model chooses (rank 0)
        if self.plan.startswith("budget:"):
            fraction = self.plan.partition(":")[2]
            try:
                ok = 0.0 < float(fraction) <= 1.0
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"--plan budget:<fraction> needs a fraction of the keep-all peak in (0, 1], got {fraction!r}")


def train_device(spec: str, env: Mapping[str, str], cuda_available: bool) -> torch.device:
    """The device ``ooc train --device spec`` trains on, in a process with environment ``env``:
    ``auto`` is ``cuda:LOCAL_RANK`` (each rank ``torchrun`` starts on its own GPU) when CUDA is
    available, else the CPU; ``cuda`` is ``cuda:LOCAL_RANK``; ``cuda:N`` and ``cpu`` are themselves."""
    if spec == "auto":
        spec = "cuda" if cuda_available else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if not cuda_available:
        raise ValueError(f"--device {spec} needs CUDA, which this process does not have; pass --device cpu")
    if spec == "cuda":
        return torch.device("cuda", int(env.get("LOCAL_RANK", "0")))
    return torch.device(spec)


@dataclass(frozen=True)
class TrainResult:
    losses: list[float]
    """Per step: the mean loss over the global batch (every rank's micro-batches)."""
    step_s: list[float]
    world: int
    start_step: int


def _micro_batch(data: CharData, cfg: TrainConfig, step: int, index: int, micro_batches: int,
                 seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` of the ``micro_batches`` of ``step``'s global batch: its rows
    ``index*batch_size ...``. The global batch is drawn whole, so its rows do not depend on the split:
    one process with a batch of ``2*batch_size`` trains on the rows two ranks share."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, len(data.ids) - seq - 1, (cfg.batch_size * micro_batches,), generator=gen)
    rows = starts[index * cfg.batch_size:(index + 1) * cfg.batch_size]
    x = torch.stack([data.ids[s:s + seq] for s in rows])
    y = torch.stack([data.ids[s + 1:s + seq + 1] for s in rows])
    return x, y


def _resolve_plan(cfg: TrainConfig, model: GPT, sample: tuple[torch.Tensor, torch.Tensor], world: int) -> Plan:
    """The plan; with data parallelism rank 0 chooses and every rank takes its choice (profiles
    measured on two ranks would differ by timing noise)."""
    n = model.config.n_layer
    if cfg.plan in (p.value for p in Policy):
        return Plan.uniform(cfg.plan, n)
    chosen: list[str | None] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        if cfg.plan.startswith("budget:"):
            fraction = float(cfg.plan.partition(":")[2])
            backend = resolve_backend("auto", model)  # the model's own device: a CPU profile of a GPU model counts nothing
            try:
                prof = ooc.profile(model, sample, backend=backend)
            finally:
                backend.close()
            plan, _, _ = plan_for_fraction(prof, fraction, hardware=hardware_for(None, backend), option="--plan budget:{}")
            chosen[0] = plan.to_json()
        else:
            path = Path(cfg.plan)
            if not path.is_file():
                missing = f"no plan file {path}; make one with `ooc plan --profile P.json --budget ... --out {path}`, or " \
                    if path.suffix == ".json" else ""
                raise ValueError(f"--plan {cfg.plan!r}: {missing}give keep, swap, recompute, budget:<fraction> or a "
                                 "plan file")
            chosen[0] = path.read_text()
    if dist.is_initialized() and world > 1:
        dist.broadcast_object_list(chosen, src=0)
    return Plan.from_json(chosen[0])


def _resolve_reduce_on(cfg: TrainConfig, model: GPT, sample: tuple[torch.Tensor, torch.Tensor], plan: Plan,
                       world: int, show) -> str:  # noqa: ANN001
    """``--reduce-on model``: rank 0 profiles the blocks and lets the performance model choose."""
    if cfg.reduce_on != "model":
        return cfg.reduce_on
    choice: list[str | None] = [None]
    if dist.get_rank() == 0:
        backend = resolve_backend("auto", model)
        prof = ooc.profile(model, sample, backend=backend)
        hardware = hardware_for(None, backend)
        choice[0], seconds = choose_reduce_on(plan, prof, hardware, world=world, shard=cfg.shard,
                                              copies=backend.separate_memory or cfg.dtype != "float32")
        show(f"reduce on {choice[0]}: predicted step " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in seconds.items())
             + f" on {hardware.name}")
        backend.close()
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def train(cfg: TrainConfig, show=print) -> TrainResult:  # noqa: ANN001
    """Run ``cfg`` on this process (one rank of the default process group, if there is one)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = train_device(cfg.device, os.environ, torch.cuda.is_available())
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the default device of this rank's kernels, streams and NCCL calls
    torch.manual_seed(cfg.seed)
    data = CharData.from_text(load_text())
    gpt_cfg = replace(GPT_PRESETS[cfg.preset], vocab_size=len(data.chars))
    if cfg.dropout is not None:
        gpt_cfg = replace(gpt_cfg, dropout=cfg.dropout)
    model = GPT(gpt_cfg).to(device=device, dtype=DTYPES[cfg.dtype])
    seq = cfg.seq if cfg.seq is not None else min(DEFAULT_SEQ, gpt_cfg.block_size)

    def batch(step: int, index: int, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _micro_batch(data, cfg, step, index, micro_batches, seq)
        return x.to(device), y.to(device)

    plan = _resolve_plan(cfg, model, batch(0, 0, 1), world)
    reduce_on = _resolve_reduce_on(cfg, model, batch(0, 0, 1), plan, world, show) if world > 1 else "auto"
    ooc.wrap(model, plan, backend="auto")
    opt = HostAdamW(
        model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, model=model, pipeline=cfg.pipeline,
        delayed_update=cfg.delayed_update, accumulate=cfg.accumulate, max_grad_norm=cfg.max_grad_norm,
        device_params_below=cfg.device_params_below,
        loss_scale=LossScale() if cfg.dtype == "float16" else None,
        data_parallel=DataParallel(shard=cfg.shard, reduce_on=reduce_on, timeout_s=cfg.timeout_s) if world > 1 else None,
    )
    saver = Checkpointer(cfg.save, model, opt, keep=cfg.keep, rank=rank, world=world, layout=_layout(cfg)) \
        if cfg.save else None
    try:
        return _train_loop(cfg, model, opt, saver, plan, batch, seq, device, rank, world, show)
    except BaseException:
        _close_after_error(model, opt, saver)
        raise


def _train_loop(cfg: TrainConfig, model: GPT, opt: HostAdamW, saver: Checkpointer | None, plan: Plan,
                batch, seq: int, device: torch.device, rank: int, world: int, show) -> TrainResult:  # noqa: ANN001
    """Resume, train ``cfg.steps`` steps, save, report; close the optimizer and the saver and unwrap."""
    start_step = _resume(cfg, model, opt, rank, world, saver, show)
    if saver is not None:
        saver.check_step(_first_save(cfg, start_step))  # a --resume older than --save's versions fails now, not later
    if rank == 0:
        show(f"ooc train: GPT {cfg.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, {cfg.dtype}) "
             f"on {world} rank(s), global batch {cfg.batch_size * world * cfg.accumulate} x {seq}, plan {plan.name} "
             f"[{' '.join(p.value for p in plan.policies)}], host AdamW{' sharded' if cfg.shard else ''}")
    losses, times = [], []
    skipped = 0  # float16: steps whose gradients overflowed the loss scale
    bar = tqdm(range(start_step, start_step + cfg.steps), desc="training", unit="step", leave=False,
               disable=None if cfg.progress and rank == 0 else True)
    for step in bar:
        started = time.perf_counter()
        total = torch.zeros((), device=device)
        for micro in range(cfg.accumulate):
            index = rank * cfg.accumulate + micro
            x, y = batch(step, index, world * cfg.accumulate)
            torch.manual_seed(cfg.seed * 7919 + step * 4096 + index)  # dropout masks follow the micro-batch
            _, loss = model(x, y)
            scaled = loss / cfg.accumulate
            (opt.scale(scaled) if cfg.dtype == "float16" else scaled).backward()
            total += loss.detach().float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        skipped += opt.last_step_skipped
        if world > 1:
            with peer_failures():
                dist.all_reduce(total)  # for the log only; the default group, used by this thread alone
        losses.append(float(total) / (world * cfg.accumulate))
        times.append(time.perf_counter() - started)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if rank == 0 and not cfg.progress:
            show(f"step {step:5d}  loss {losses[-1]:.4f}")
            sys.stdout.flush()
        done = step + 1  # a version's step: the steps done, so the step a resumed run starts at
        if saver is not None and (done == start_step + cfg.steps or (cfg.save_every and done % cfg.save_every == 0)):
            saver.save(done, loss=losses[-1], preset=cfg.preset)  # the preset: a resume checks it first
    bar.close()
    opt.synchronize()
    if saver is not None:
        saver.close()
    if rank == 0:
        median = statistics.median(times[1:] if len(times) > 1 else times)
        report = ooc.memory_report(model)
        show(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {cfg.steps} steps; median step {median * 1e3:.1f} ms; "
             f"peak device-resident activations {format_bytes(report.peak_bytes)}"
             + (f"; {skipped} step(s) skipped, their gradients over the loss scale (now {opt.get_scale():g})"
                if cfg.dtype == "float16" else ""))
        newest = saver.latest() if saver is not None else None
        if newest is not None:
            show(f"saved {newest.path} (`ooc checkpoints list {cfg.save}`; continue with --save {cfg.save} --resume auto)")
    result = TrainResult(losses, times, world, start_step)
    if cfg.out and rank == 0:
        Path(cfg.out).write_text(json.dumps(asdict(result), indent=1))
    opt.close()
    ooc.unwrap(model)
    return result


def _close_after_error(model: GPT, opt: HostAdamW, saver: Checkpointer | None) -> None:
    """After an error or Ctrl-C in training: let the version in flight be written and leave the
    directory as a finished run does (no retired ``.spare-*`` folder, the writer lock released), and
    stop the optimizer's threads. An error here would hide the one that stopped the run: dropped."""
    if saver is not None:
        with contextlib.suppress(Exception):
            saver.close(check_ranks=False)  # another rank may be gone: waiting for its record would only delay
    with contextlib.suppress(Exception):
        opt.close()
    with contextlib.suppress(Exception):
        ooc.unwrap(model)


def _first_save(cfg: TrainConfig, start_step: int) -> int:
    """The step of the run's first version: later ones are above it, so if ``save`` takes it, it
    takes them all (NOTE [saves go forward] in ooc.checkpoint)."""
    last = start_step + cfg.steps
    return min(last, (start_step // cfg.save_every + 1) * cfg.save_every) if cfg.save_every else last


def _layout(cfg: TrainConfig) -> dict[str, object]:
    """What a checkpoint records of how its optimizer state was split, besides the world size."""
    return {"shard": cfg.shard}


def _resume(cfg: TrainConfig, model: GPT, opt: HostAdamW, rank: int, world: int, saver: Checkpointer | None,
            show) -> int:  # noqa: ANN001
    """Load ``--resume``'s version (saved by any number of ranks, sharded or not); return its step
    (0 for a fresh start).

    NOTE [resume auto falls back past damaged versions]
    A version found damaged (a file or its commit record no longer matching: a disk that lost
    writes it had acknowledged, a flipped bit) stopped ``--resume auto`` with advice to move the
    folder out of the directory and run again, after which the run resumed from the newest intact
    version: a requeued job failed until someone did that by hand. ``--resume auto`` now does the
    same itself: it restores through ``--save``'s Checkpointer with ``fallback=True``, says which
    version it skipped, and that Checkpointer's first save moves the damaged folders above the one
    restored aside as ``step-N.damaged-<time>`` (kept; NOTE [damaged versions moved aside] in
    ooc.checkpoint). Nothing intact is moved: a version the file system failed to read
    (``UnreadableCheckpointError``, maybe intact) still stops the run, to be retried, and one a
    fallback skipped for that reason still refuses the saves at or below its step. With no intact
    version left it stops too: starting afresh would throw the run away. ``--resume DIR`` (another
    directory) stops as before: its versions are not this run's to move."""
    if not cfg.resume:
        return 0
    auto = cfg.resume == "auto"
    directory = Path(cfg.save if auto else cfg.resume)
    found, damaged = scan_versions(directory)
    if not found and not damaged:  # a damaged version: restore() names it (NOTE [damaged records])
        if auto:
            if rank == 0:
                show(f"--resume auto: no version in {directory} yet; starting from step 0")
            return 0
        raise ValueError(f"--resume {directory}: no complete checkpoint there")
    _check_same_preset(cfg, directory, found)
    loader = saver if auto else Checkpointer(directory, model, opt, keep=None, rank=rank, world=world,
                                             layout=_layout(cfg), lazy=False)
    try:
        version = loader.restore()
    except UnreadableCheckpointError as exc:
        raise ValueError(f"--resume {directory}: {exc.path} {exc.reason}: the file system failed, which does not say "
                         "the version is damaged, and it is kept as it is; check the disk and run again") from exc
    except CorruptCheckpointError as exc:
        if not auto:
            # Its advice names the Python API (restore(fallback=True)), which the command line has not.
            raise ValueError(
                f"--resume {directory}: the newest version is damaged ({exc.path}: {exc.reason}); "
                f"`ooc checkpoints list {directory}` shows which versions are. Move its folder out of {directory} "
                "(keep it to inspect) and run again: --resume then continues from the newest intact version") from exc
        version = _fall_back(loader, directory, exc)
        if rank == 0:
            show(f"--resume auto: {directory / exc.path.parent.name} is damaged ({exc.path.name}: {exc.reason}); "
                 "continuing from the newest intact version. The first save moves the damaged versions above it "
                 f"aside as step-N.damaged-<time>, kept for you to inspect (`ooc checkpoints list {directory}`)")
    finally:
        if loader is not saver:
            loader.close()  # a reader only: its folder locks and writer (none started) go with it
    if rank == 0:
        show(f"resumed from {directory / version.path.name} (step {version.step})")  # as the user named the directory
    return version.step


def _check_same_preset(cfg: TrainConfig, directory: Path, found: list[Version]) -> None:
    """Refuse to resume a version another ``--preset`` trained (checkpoint.py's own check lists every
    tensor of the model; this one says which option to change)."""
    newest = max(found, key=lambda v: v.step, default=None)
    saved = newest.metadata.get("preset") if newest is not None else None
    if saved is not None and saved != cfg.preset:
        raise ValueError(f"--resume {directory}: its newest version (step {newest.step}) is of --preset {saved}, "
                         f"this run builds --preset {cfg.preset}; run with --preset {saved}, or --save into another "
                         "directory to train a new model")


def _fall_back(saver: Checkpointer, directory: Path, damage: CorruptCheckpointError) -> Version:
    """Restore the newest intact version of ``saver``'s directory, whose newest is damaged (NOTE
    [resume auto falls back past damaged versions])."""
    try:
        return saver.restore(fallback=True)
    except NoIntactVersionError as exc:
        found = "; ".join(f"{error.path}: {error.reason}" for error in exc.errors)
        raise ValueError(f"--resume {directory}: no version there is intact ({found}); `ooc checkpoints list "
                         f"{directory}` shows them. Move them out of {directory} (keep them to inspect) to start "
                         "afresh") from damage


def main(cfg: TrainConfig) -> int:
    """Join the process group (if launched by torchrun), train, and exit non-zero on any failure,
    never hanging: a dead or stuck rank fails every collective within ``timeout_s``."""
    try:
        device = train_device(cfg.device, os.environ, torch.cuda.is_available())
        distributed = init_from_env(cfg.timeout_s, device=device)
    except (RuntimeError, ValueError) as exc:
        print(f"ooc train: could not join the process group: {exc}", file=sys.stderr)
        return 1
    rank = dist.get_rank() if distributed else 0
    try:
        train(cfg)
    except (OocError, RuntimeError, ValueError, OSError, KeyboardInterrupt) as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        print(f"ooc train: rank {rank}: " + (f"interrupted{_where_to_go_on(cfg)}" if interrupted else f"error: {exc}"),
              file=sys.stderr)
        code = INTERRUPTED if interrupted else 1
        if distributed:
            # The process group may wait on a dead peer forever at shutdown: leave now.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    if distributed:
        dist.destroy_process_group()
    return 0


def _where_to_go_on(cfg: TrainConfig) -> str:
    """After Ctrl-C: the newest complete version of ``--save`` and how to continue from it."""
    if not cfg.save:
        return " (nothing saved: --save DIR keeps versions to continue from)"
    found, _damaged = scan_versions(cfg.save)
    if not found:
        return f"; no complete version in {cfg.save} yet"
    return (f"; the newest complete version in {cfg.save} is step {max(v.step for v in found)}: continue with "
            f"--save {cfg.save} --resume auto")
