"""``ooc simulate --check``: the performance model against measured steps of the demo GPT."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import ooc
from ooc.apps.demo import CharData, demo_config, load_text
from ooc.backend import Backend, resolve_backend
from ooc.calibrate import calibrate
from ooc.models.gpt import GPT
from ooc.scheduler.hardware import Hardware
from ooc.scheduler.plan import Plan
from ooc.scheduler.planners import PLANNERS, annotate
from ooc.scheduler.schedule import build_schedule
from ooc.scheduler.simulate import simulate
from ooc.scheduler.units import format_bytes

TIME_TOLERANCE = 0.2
"""``ooc simulate --check`` fails where a plan's measured step is off its predicted one by more than this
fraction of the measured step (the bound ``ooc doctor`` holds a GPU's steps to)."""


@dataclass(frozen=True)
class CheckRow:
    plan: str
    predicted_peak: int
    measured_peak: int
    predicted_s: float
    measured_s: float

    @property
    def peak_error(self) -> float:
        return abs(self.measured_peak - self.predicted_peak) / max(1, self.predicted_peak)

    @property
    def time_error(self) -> float:
        return abs(self.measured_s - self.predicted_s) / self.measured_s

    @property
    def peak_ok(self) -> bool:
        return abs(self.measured_peak - self.predicted_peak) <= 0.01 * self.predicted_peak + 2**20

    @property
    def time_ok(self) -> bool:
        return self.time_error <= TIME_TOLERANCE


def demo_model_and_batch(device: torch.device, seed: int = 0) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    data = CharData.from_text(load_text())
    return GPT(demo_config(data)).to(device), data.batch(16, 64, torch.Generator().manual_seed(seed), device)


def train_losses(model: torch.nn.Module, steps: int, *, batch_size: int = 8, seed: int = 0) -> list[float]:
    """Train ``model`` (a demo-sized GPT) on the sonnets with AdamW for ``steps``; the loss of each step.

    The same batches and dropout masks for the same ``seed``, so runs with different settings
    (codecs, low-bit layers) compare like for like.
    """
    data = CharData.from_text(load_text())
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(*data.batch(batch_size, model.config.block_size, gen, device))[1]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def calibration_check(*, reps: int = 10, backend: str | Backend = "auto", hardware: Hardware | None = None,
                      show: Callable[[str], None] = lambda _line: None) -> list[CheckRow]:
    """For all-KEEP, all-SWAP, all-RECOMPUTE and a mixed plan: predicted vs measured peak and step time.
    ``show`` gets a line as each stage starts (minutes in all on a CPU)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, batch = demo_model_and_batch(device)
    backend_obj = resolve_backend(backend, model)
    show(f"profiling the demo GPT's {model.config.n_layer} blocks on {device}")
    prof = ooc.profile(model, batch, backend=backend_obj, reps=max(3, reps // 2))
    if hardware is None:
        show("measuring this machine's copy engines (as `ooc calibrate`; pass --hardware to skip)")
    hw = hardware or calibrate(backend_obj)
    n = len(prof)
    keep_peak = build_schedule(Plan.uniform("keep", n), prof).peak_bytes
    mixed = annotate(PLANNERS["optimal"](prof, hw, keep_peak // 2), prof)
    plans = [Plan.uniform("keep", n), Plan.uniform("swap", n), Plan.uniform("recompute", n), mixed.with_(name="optimal@50%")]
    rows = []
    for k, plan in enumerate(plans, 1):
        show(f"plan {k}/{len(plans)}, {plan.name}: {reps + 2} steps")
        wrapped = ooc.wrap(copy.deepcopy(model), plan, backend=backend_obj)
        times, peak = [], 0
        for step in range(reps + 2):
            wrapped.zero_grad(set_to_none=True)
            start = time.perf_counter()
            wrapped(*batch)[1].backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= 2:
                times.append(time.perf_counter() - start)
            peak = max(peak, ooc.memory_report(wrapped).peak_bytes)
        ooc.unwrap(wrapped)
        predicted = simulate(build_schedule(plan, prof, hw), hw, keep_timeline=False)
        rows.append(CheckRow(plan.name, predicted.peak_bytes, peak, predicted.step_time_s, statistics.median(times)))
    return rows


def format_check(rows: list[CheckRow]) -> str:
    header = ("plan", "peak predicted", "peak measured", "error", "step predicted", "step measured", "error")
    table = [header] + [
        (r.plan, format_bytes(r.predicted_peak), format_bytes(r.measured_peak), f"{r.peak_error:.2%}",
         f"{r.predicted_s * 1e3:.1f} ms", f"{r.measured_s * 1e3:.1f} ms", f"{r.time_error:.1%}")
        for r in rows
    ]
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    ok_peak = all(r.peak_ok for r in rows)
    ok_time = all(r.time_ok for r in rows)
    lines.append(f"peaks within 1% + 1 MiB: {'yes' if ok_peak else 'NO'}; step times within {TIME_TOLERANCE:.0%}: "
                 f"{'yes' if ok_time else 'NO'}")
    return "\n".join(lines)


def check_failures(rows: list[CheckRow]) -> list[str]:
    """One line per figure of ``rows`` the performance model missed: the plan, both values, and by how much.
    Empty where every peak is within 1% + 1 MiB and every step time within ``TIME_TOLERANCE``."""
    missed = []
    for r in rows:
        if not r.peak_ok:
            missed.append(f"plan {r.plan}: peak measured {format_bytes(r.measured_peak)}, predicted "
                          f"{format_bytes(r.predicted_peak)}: off by {format_bytes(abs(r.measured_peak - r.predicted_peak))} "
                          f"({r.peak_error:.2%}), more than 1% + 1 MiB")
        if not r.time_ok:
            missed.append(f"plan {r.plan}: step measured {r.measured_s * 1e3:.1f} ms, predicted {r.predicted_s * 1e3:.1f} "
                          f"ms: off by {r.time_error:.1%} of the measured step, more than {TIME_TOLERANCE:.0%}")
    return missed
