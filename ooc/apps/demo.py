"""The demo: train a tiny character-level GPT on the shipped sonnets under a device-memory budget
that forces a mix of keep, swap and recompute, and show what it cost."""

from __future__ import annotations

import copy
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources

import torch
from tqdm import tqdm

import ooc
from ooc.api import DEFAULT_PLANNER, hardware_for, plan_for_profile
from ooc.backend import resolve_backend
from ooc.blocks import find_blocks
from ooc.errors import BudgetError
from ooc.models.gpt import GPT, GPT_PRESETS, GPTConfig
from ooc.scheduler.hardware import Hardware
from ooc.scheduler.plan import Plan
from ooc.scheduler.profile import Profile
from ooc.scheduler.schedule import build_schedule
from ooc.scheduler.units import format_bytes


def load_text() -> str:
    return resources.files("ooc.apps").joinpath("data/sonnets.txt").read_text(encoding="utf-8")


@dataclass(frozen=True)
class CharData:
    """The text as token ids, with its alphabet."""

    ids: torch.Tensor
    chars: str

    @classmethod
    def from_text(cls, text: str) -> "CharData":
        chars = "".join(sorted(set(text)))
        index = {c: i for i, c in enumerate(chars)}
        return cls(torch.tensor([index[c] for c in text], dtype=torch.long), chars)

    def batch(self, size: int, length: int, generator: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(size, length) inputs and their next-character targets."""
        starts = torch.randint(0, len(self.ids) - length - 1, (size,), generator=generator)
        x = torch.stack([self.ids[s : s + length] for s in starts])
        y = torch.stack([self.ids[s + 1 : s + length + 1] for s in starts])
        return x.to(device), y.to(device)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


def demo_config(data: CharData) -> GPTConfig:
    """The demo's GPT: the "tiny" preset (6 layers, 128 wide, 64 characters) over the text's alphabet."""
    return replace(GPT_PRESETS["tiny"], vocab_size=len(data.chars))


def demo_threads(requested: int | None, device: torch.device) -> tuple[int, str]:
    """The torch threads the demo runs on, and why (for its first line).

    NOTE [the demo's threads]
    On a machine whose cores other work keeps busy, torch's intra-op threads wait on each other at
    every parallel op, each for a turn on a core: at a load average of 8 on 2 cores the demo's plain
    PyTorch step took 4.7 s on two threads against 0.58 s on one (and ooc's 5.7 s against 0.76 s,
    measured in alternation; ``benchmarks/bench_oversubscribed.py`` shows the same). So on the CPU the
    demo runs on one thread where the 1-minute load average already fills the cores it may use, else
    on torch's default; ``requested`` (``--threads``) decides otherwise. On a GPU the threads only
    issue kernels: torch's default."""
    default = torch.get_num_threads()
    if requested is not None:
        if requested < 1:
            raise ValueError(f"threads must be at least 1, got {requested}")
        return requested, f"{requested} torch thread{'s' * (requested > 1)}"
    if device.type != "cpu" or default == 1:
        return default, f"{default} torch thread{'s' * (default > 1)}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0]
    if load >= cores:
        return 1, f"1 torch thread: the load average {load:.1f} fills the {cores} cores; --threads to choose"
    return default, f"{default} torch threads"


@dataclass(frozen=True)
class DemoResult:
    first_loss: float
    last_loss: float
    budget_bytes: int
    keep_all_peak_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    wrapped_step_s: float
    plain_step_s: float
    policies: tuple[str, ...]


@torch.no_grad()
def sample_text(model: GPT, data: CharData, prompt: str, length: int, generator: torch.Generator) -> str:
    device = next(model.parameters()).device
    ids = torch.tensor([[data.chars.index(c) for c in prompt]], device=device)
    model.eval()
    for _ in range(length):
        logits, _ = model(ids[:, -model.config.block_size :])
        probs = torch.softmax(logits[:, -1, :] / 0.8, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs.cpu(), 1, generator=generator).to(device)], dim=1)
    model.train()
    return data.decode(ids[0])


def plan_for_fraction(prof: Profile, fraction: float, *, hardware: Hardware, option: str,
                      planner: str = DEFAULT_PLANNER) -> tuple[Plan, int, int]:
    """A plan for a budget of ``fraction`` of the keep-all peak (every block's saved bytes), with that
    budget and peak. Where nothing fits, the ``BudgetError`` also names the smallest fraction that does,
    as the command's ``option`` takes it (``"--budget-fraction {}"``): its message named bytes alone,
    which neither ``ooc demo --budget-fraction`` nor ``ooc train --plan budget:<fraction>`` takes."""
    keep_peak = sum(b.saved_bytes for b in prof.blocks)
    budget = int(keep_peak * fraction)
    try:
        return plan_for_profile(prof, budget, hardware=hardware, planner=planner), budget, keep_peak
    except BudgetError as exc:
        smallest = math.ceil(exc.minimum_bytes / keep_peak * 1000) / 1000
        raise BudgetError(exc.budget_bytes, exc.minimum_bytes, f"({option.format('<fraction>')} takes a fraction of "
                          f"the keep-all peak, {format_bytes(keep_peak)}: the smallest that fits here is "
                          f"{option.format(f'{smallest:g}')})") from None


def run_demo(
    *,
    steps: int = 300,
    batch_size: int = 16,
    budget_fraction: float = 0.4,
    planner: str = "optimal",
    seed: int = 0,
    show: Callable[[str], None] = print,
    progress: bool = True,
    threads: int | None = None,
) -> DemoResult:
    """Train for ``steps`` with a budget of ``budget_fraction`` of the keep-everything peak, on
    ``threads`` torch threads (None: :func:`demo_threads` chooses; torch's setting is put back at the
    end)."""
    if not 0.0 < budget_fraction <= 1.0:
        raise ValueError(f"budget_fraction must be in (0, 1], got {budget_fraction}")
    if steps < 10:
        raise ValueError(f"steps must be >= 10 to show a trend, got {steps}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    count, why = demo_threads(threads, device)
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return _train(steps, batch_size, budget_fraction, planner, seed, show, progress, device, why)
    finally:
        torch.set_num_threads(before)


def _train(steps: int, batch_size: int, budget_fraction: float, planner: str, seed: int, show: Callable[[str], None],
           progress: bool, device: torch.device, threads: str) -> DemoResult:
    """:func:`run_demo` once its arguments are checked and its threads set."""
    torch.manual_seed(seed)
    data = CharData.from_text(load_text())
    cfg = demo_config(data)
    model = GPT(cfg).to(device)
    gen = torch.Generator().manual_seed(seed)
    sample = data.batch(batch_size, cfg.block_size, gen, device)
    show(f"ooc demo: a {cfg.n_layer}-layer character GPT ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params) "
         f"on {len(data.ids)} characters of Shakespeare's sonnets, on {device} ({threads}); AdamW on the host "
         "(ooc.optim.HostAdamW)")

    backend = resolve_backend("auto", model)
    prof = ooc.profile(model, sample, backend=backend)
    plan, budget, keep_peak = plan_for_fraction(prof, budget_fraction, hardware=hardware_for(None, backend),
                                                planner=planner, option="--budget-fraction {}")
    predicted = build_schedule(plan, prof).peak_bytes
    show(f"budget for saved activations: {format_bytes(budget)} "
         f"({budget_fraction:.0%} of the {format_bytes(keep_peak)} that keeping everything needs)")
    show(plan.table(find_blocks(model).names))
    show(f"predicted peak: {format_bytes(predicted)}")

    def train_step(m: GPT, opt: torch.optim.Optimizer, batch) -> tuple[float, float]:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        _, loss = m(*batch)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return loss.item(), time.perf_counter() - start

    # The plain model, for the step-time baseline, from the same weights and the same AdamW kernel; its
    # steps alternate with the first wrapped ones, on the same batches, so that both meet the same
    # load (measured one after the other, a load that rose in between was charged to ooc alone).
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    compare = min(30, steps)
    plain_times = []

    ooc.wrap(model, plan, backend=backend)
    # AdamW on the host. On a GPU each block's update overlaps the rest of the backward; on the CPU
    # backend compute already keeps every core busy, and the update thread only competes with it
    # (measured here: 171 ms per step pipelined vs 146 ms updating in step()).
    opt = ooc.optim.HostAdamW(model.parameters(), lr=1e-3, model=model, pipeline=device.type == "cuda")
    losses, times, peak = [], [], 0
    bar = tqdm(range(steps), desc="training", unit="step", disable=None if progress else True, leave=False)
    for step in bar:
        batch = data.batch(batch_size, cfg.block_size, gen, device)
        if step < compare:
            plain_times.append(train_step(plain, plain_opt, batch)[1])
        if step == compare:
            del plain, plain_opt
        loss, seconds = train_step(model, opt, batch)
        losses.append(loss)
        times.append(seconds)
        peak = max(peak, ooc.memory_report(model).peak_bytes)
        bar.set_postfix(loss=f"{loss:.3f}")
        if step % max(1, steps // 6) == 0 or step == steps - 1:
            tqdm.write(f"step {step:4d}  loss {loss:.3f}") if progress else show(f"step {step:4d}  loss {loss:.3f}")
    bar.close()
    opt.synchronize()
    opt.close()
    ooc.unwrap(model)

    window = max(1, steps // 10)
    first, last = statistics.mean(losses[:window]), statistics.mean(losses[-window:])
    wrapped_s = statistics.median(times[5:compare] if compare > 10 else times[:compare])
    plain_s = statistics.median(plain_times[5:] if compare > 10 else plain_times)
    show(f"loss: {first:.3f} (first {window} steps) -> {last:.3f} (last {window} steps)")
    show(f"peak device-resident saved activations: measured {format_bytes(peak)}, predicted {format_bytes(predicted)}, "
         f"budget {format_bytes(budget)} ({'within' if peak <= budget else 'OVER'} budget)")
    show(f"step time: {wrapped_s * 1e3:.1f} ms with ooc vs {plain_s * 1e3:.1f} ms plain "
         f"({wrapped_s / plain_s:.2f}x) while holding {peak / keep_peak:.0%} of the activations")
    show("sample: " + sample_text(model, data, "Shall ", 120, gen).replace("\n", " / "))
    return DemoResult(first, last, budget, keep_peak, predicted, peak, wrapped_s, plain_s, tuple(p.value for p in plan.policies))
