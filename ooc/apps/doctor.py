"""``ooc doctor --out DIR``: the first contact with a GPU machine, one command of at most 10 minutes.

It installs nothing and needs no network. Each step runs in its own subprocess under a time cap
(a hung kernel or a CUDA error in one step cannot stop the others), inside one overall budget, and
the doctor writes ``DIR/doctor.md`` (one page) and ``DIR/doctor.json`` with every figure, every
check against its target, and each step's time. Steps:

- ``environment``: Python, torch, Triton, CuPy, nvtx, the device; ooc imports.
- ``offline-install``: ``pip install --no-index --no-deps --no-build-isolation -e .`` into a fresh
  venv that sees this interpreter's packages, then imports ooc from it; and a scan that no code
  path checks torch's version (the project pins torch 2.13 for CPU CI; GPU images carry others).
- ``compile-lane``: tests/kernels/test_compile.py (Triton for sm_80/sm_90, .cu files with nvcc).
- ``calibrate`` (GPU): ``ooc.calibrate.calibrate("cuda")``; saved as DIR/hardware.json.
- ``kernels`` (GPU): quantize/dequantize GB/s as a fraction of the device-to-device copy's
  (target >= 0.8), each timed with calls queued back to back (one call per timing is a figure too),
  quantize without its NaN/Inf count (the rate with the swap engine's device flag is a figure).
- ``overlap`` (GPU): an all-SWAP step of a chain whose compute outlasts its copies hides >= 80% of
  the copy time: ``1 - (t_swap - t_keep) / t_copy``.
- ``gpt2`` (GPU): GPT-2 small, batch 4x512: plain vs all-KEEP (overhead <= 3%, in alternating
  rounds of each), and the optimal
  plan at 50% and 25% of all-KEEP's activation bytes (step time within 20% of the simulator's
  prediction, tracked peak within the budget).
- ``gpu-lane`` (GPU): ``pytest -m "gpu and not slow"``.

Without a GPU every GPU step is skipped with its reason, and the doctor exits 0 if the rest pass.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_BUDGET_S = 570.0

GPT2 = ("gpt2", 4, 512)
"""The GPT step's model preset, batch size and sequence length."""
OVERLAP_CHAIN = (8192, 2048, 8192, 8)
"""The overlap step's MLP chain: rows, width, hidden, depth. Per block ~12*rows*width*hidden = 1.6
TFLOP of fp32 matmuls (~30 ms on an H100 without TF32) against ~0.6 GiB saved (~12 ms each way at
50 GB/s): compute outlasts the copies about 2.5 times."""
KERNEL_ELEMENTS = 64 * 2**20
"""The kernel step's tensor: 256 MiB of fp32, far beyond L2, so every figure is DRAM bandwidth."""
KERNEL_LAUNCHES = 20
"""Calls queued back to back per timing in the kernel step (its ``queued_seconds``)."""
"""Ten minutes on the GPU machine, less 30 s for the machine's own start and the report."""

ROOT = Path(__file__).resolve().parents[2]
"""The source checkout (pyproject.toml, tests/) when ooc is installed editable or run from source."""


@dataclass(frozen=True)
class StepSpec:
    name: str
    title: str
    cap_s: float
    needs_gpu: bool = False
    needs_source: bool = False


# In order of what a short GPU loan must not miss: the measurements take about two minutes on an
# H100, the GPU lane the most; the last two steps run on every CPU machine as well.
STEPS = (
    StepSpec("environment", "versions, device, ooc imports", 60),
    StepSpec("calibrate", "copy bandwidths, latency, host AdamW rate (ooc.calibrate)", 90, needs_gpu=True),
    StepSpec("kernels", "quantize/dequantize GB/s vs the device-to-device copy", 90, needs_gpu=True),
    StepSpec("overlap", "all-SWAP step hides the copies behind compute", 120, needs_gpu=True),
    StepSpec("gpt2", "GPT-2 small 4x512: KEEP overhead; optimal plans at 50%/25% vs the simulator", 180, needs_gpu=True),
    StepSpec("oplevel", "GPT-2 small 4x512: op-level vs block-level optimal plans at 50%/25%, one op-level profile", 180,
             needs_gpu=True),
    StepSpec("gpu-lane", 'pytest -m "gpu and not slow" (the CUDA runtime tests)', 330, needs_gpu=True, needs_source=True),
    StepSpec("offline-install", "pip install --no-index --no-deps --no-build-isolation -e . into a fresh venv", 150,
             needs_source=True),
    StepSpec("compile-lane", "Triton kernels for sm_80/sm_90 and .cu files with nvcc (tests/kernels/test_compile.py)", 180,
             needs_source=True),
)

GPU_LANE_ORDER = (
    "tests/gpu/test_cuda_runtime.py", "tests/gpu/test_cuda_selective.py", "tests/gpu/test_cuda_host_adamw.py", "tests/gpu/test_cuda_memory.py",
    "tests/gpu/test_cuda_nccl.py", "tests/kernels", "tests/gpu/test_cuda_sanitizer.py", "tests/gpu/test_cpu_lanes_on_gpu.py",
)
"""The GPU lane's files, runtime first: if the cap cuts the run short, what ran matters most. The
other files of tests/gpu follow them, then every other test folder's ``gpu`` tests."""


@dataclass
class Check:
    name: str
    value: float
    target: str
    ok: bool


@dataclass
class StepResult:
    """What one step reports: ``status`` is ``pass``, ``fail`` or ``skip``."""

    name: str
    title: str
    status: str = "pass"
    reason: str = ""
    summary: str = ""
    elapsed_s: float = 0.0
    cap_s: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    def check(self, name: str, value: float, target: str, ok: bool) -> None:
        self.checks.append(Check(name, float(value), target, bool(ok)))
        if not ok:
            self.status = "fail"


# ------------------------------------------------------------------------------------------------
# Steps. Each runs in a subprocess (``--run-step NAME``) and fills a StepResult.


def _step_environment(result: StepResult, out: Path) -> None:
    import importlib

    import torch

    import ooc

    figures = result.figures
    figures.update(python=platform.python_version(), platform=platform.platform(), torch=torch.__version__,
                   torch_cuda=torch.version.cuda, ooc=ooc.__version__, ooc_path=str(Path(ooc.__file__).parent))
    for name in ("triton", "cupy", "nvtx", "numpy", "scipy", "tqdm", "matplotlib"):
        try:
            figures[name] = getattr(importlib.import_module(name), "__version__", "installed")
        except Exception as exc:  # noqa: BLE001 - report any import failure, never stop the doctor
            figures[name] = f"missing ({type(exc).__name__})"
    for module in ("ooc.kernels", "ooc.scheduler", "ooc.optim", "ooc.distributed", "ooc.models"):
        importlib.import_module(module)
    figures["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        figures.update(device=props.name, capability=f"sm_{props.major}{props.minor}", device_memory=props.total_memory,
                       device_count=torch.cuda.device_count())
    result.summary = (f"torch {torch.__version__}, triton {figures['triton']}, python {figures['python']}, "
                      f"{figures.get('device', 'no CUDA device')}")
    result.check("ooc, ooc.kernels, ooc.scheduler, ooc.optim, ooc.distributed import", 1, "import", True)


VERSION_GATE = re.compile(r"torch\.__version__\s*(?:[<>]=?|==|!=|\.startswith|\.split|\[)|version\.parse\(|TorchVersion\(|"
                          r"torch_version\s*[<>]")


def version_gates(root: Path) -> list[str]:
    """``path:line`` of every source line that compares torch's version (none should)."""
    hits = []
    for folder in ("ooc", "kernels", "scheduler"):
        for path in sorted((root / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if VERSION_GATE.search(line) and "VERSION_GATE" not in line:
                    hits.append(f"{path.relative_to(root)}:{number}")
    return hits


def _pinned(root: Path, package: str) -> str:
    match = re.search(rf'"{package}\s*([=<>~!][^"]*)"', (root / "pyproject.toml").read_text())
    return match.group(1) if match else "unpinned"


def _step_offline_install(result: StepResult, out: Path) -> None:
    import site

    import torch

    figures = result.figures
    figures.update(torch_pin=_pinned(ROOT, "torch"), triton_pin=_pinned(ROOT, "triton"), torch_installed=torch.__version__)
    gates = version_gates(ROOT)
    figures["torch_version_gates"] = gates
    result.check("source lines comparing torch's version", len(gates), "0", not gates)
    with tempfile.TemporaryDirectory(prefix="ooc-doctor-venv-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True,
                       capture_output=True, text=True, timeout=60)
        python = venv / "bin" / "python"
        if sys.prefix != sys.base_prefix:
            # This interpreter is itself a venv, whose packages --system-site-packages does not
            # reach: a .pth line makes the new venv see them, as it would a system interpreter's.
            purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     check=True, capture_output=True, text=True, timeout=60).stdout.strip()
            Path(purelib, "_ooc_doctor_parent.pth").write_text("\n".join(site.getsitepackages()) + "\n")
        command = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--no-deps",
                   "--no-build-isolation", "-e", str(ROOT)]
        figures["command"] = " ".join(["python"] + command[1:]).replace(str(python), "VENV/bin/python").replace(str(ROOT), ".")
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp)
        figures["install_s"] = round(time.perf_counter() - start, 1)
        if done.returncode != 0:
            result.check("pip install exit code", done.returncode, "0", False)
            result.reason = pip_failure(done.stdout + done.stderr)
            return
        probe = ("import importlib.metadata, json, ooc, ooc.kernels, ooc.scheduler, torch; print(json.dumps({'ooc': ooc.__file__, "
                 "'kernels': ooc.kernels.__file__, 'scheduler': ooc.scheduler.__file__, 'torch': torch.__version__, "
                 "'metadata': str(importlib.metadata.distribution('ooc')._path)}))")
        seen = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp,
                              env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        if seen.returncode != 0:
            result.check("import ooc from the new venv", seen.returncode, "exit 0", False)
            result.reason = seen.stderr[-1500:]
            return
        paths = json.loads(seen.stdout.strip().splitlines()[-1])
        figures["imported_from"] = paths
        from_root = all(Path(paths[k]).resolve().is_relative_to(ROOT / d) for k, d in
                        (("ooc", "ooc"), ("kernels", "kernels"), ("scheduler", "scheduler")))
        result.check("the venv imports ooc, ooc.kernels, ooc.scheduler from this checkout", 1 if from_root else 0, "1",
                     from_root)
        # The parent's own install points at the same checkout: the metadata shows this one was made.
        own = Path(paths["metadata"]).resolve().is_relative_to(venv.resolve())
        result.check("ooc's metadata comes from the new venv's install", 1 if own else 0, "1", own)
    result.summary = (f"editable install without index or deps in {figures['install_s']} s; torch {torch.__version__} "
                      f"accepted (pin {figures['torch_pin']} is for CPU CI); {len(gates)} version gates")


def pip_failure(output: str) -> str:
    """Why pip failed, its cause on the first line (the one doctor.md's table shows: the last line of
    pip's output is box art such as ``╰─> [14 lines of output]``), then the end of the output."""
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.lstrip().startswith("error:")]
    # The build's own error is indented deepest, under pip's ("error: subprocess-exited-with-error").
    deepest = max(errors, key=lambda line: len(line) - len(line.lstrip()), default=None)
    cause = (deepest or (lines[-1] if lines else "pip failed without output")).strip()
    if "invalid command 'bdist_wheel'" in output:
        cause += ("; --no-build-isolation builds with this environment's setuptools, which has no bdist_wheel: "
                  "setuptools >= 70.1 has it, an older one needs the `wheel` package installed beside it")
    return f"{cause}\n{output[-1500:]}"


def _pytest_counts(text: str) -> dict[str, int]:
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    return {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", tail)}


def _session_members(sid: int) -> list[int]:
    """Processes of session ``sid`` (Linux /proc), whatever process group they moved to."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        if int(fields[3]) == sid:  # after "pid (comm)": state, ppid, pgrp, session
            members.append(int(stat.parent.name))
    return members


def run_capped(command: list[str], timeout: float, *, session: bool = False, **kwargs: Any) -> tuple[int | None, str]:
    """Run ``command``; on timeout stop it and everything it started. With ``session`` it leads a
    new session and everything in that session is stopped (the step processes, whose pytest runs
    in a process group of its own); else it leads a new process group. Returns (exit code, or None
    on timeout; stdout and stderr together)."""
    if session:
        kwargs["start_new_session"] = True
    else:
        kwargs["preexec_fn"] = os.setpgrp
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        for pid in (_session_members(proc.pid) if session else []) + [proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL) if pid == proc.pid else os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output


def _run_pytest(result: StepResult, out: Path, args: list[str], log_name: str, timeout: float, env: dict[str, str]) -> None:
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfE", *args]
    result.figures["command"] = " ".join(["python"] + command[1:])
    code, output = run_capped(command, timeout, cwd=ROOT, env=env)
    (out / log_name).write_text(output)
    lines = output.splitlines()
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    if code is None:
        counts = {kind: sum(line.rstrip().endswith(kind.upper()) or f" {kind.upper()} " in line for line in lines)
                  for kind in ("passed", "failed", "skipped")}
        failed = [line.split(" ")[0] for line in lines if " FAILED" in line][:30]
        result.figures.update(counts=counts, failed=failed, log=log_name)
        result.check("pytest finished within its cap", timeout, f"<= {timeout:.0f} s", False)
        result.reason = f"pytest did not finish in {timeout:.0f} s ({counts} so far); its log: {log_name}"
        return
    counts = _pytest_counts(output)
    result.figures.update(counts=counts, failed=failed[:30], log=log_name)
    result.check("pytest exit code", code, "0", code == 0)
    result.summary = ", ".join(f"{n} {k}" for k, n in counts.items()) + f" (log: {log_name})"


def _step_compile_lane(result: StepResult, out: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    _run_pytest(result, out, ["tests/kernels/test_compile.py"], "compile-lane.log", result.cap_s - 10, env)


def _step_gpu_lane(result: StepResult, out: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    others = [f"tests/gpu/{p.name}" for p in sorted((ROOT / "tests" / "gpu").glob("test_*.py"))]
    rest = [p for p in others if p not in GPU_LANE_ORDER]
    rest += [f"tests/{p.name}" for p in sorted((ROOT / "tests").iterdir()) if p.is_dir() and p.name not in ("gpu", "kernels")]
    _run_pytest(result, out, ["-m", "gpu and not slow", *GPU_LANE_ORDER, *rest], "gpu-lane.log", result.cap_s - 10, env)


def _step_calibrate(result: StepResult, out: Path) -> None:
    from ooc.calibrate import calibrate

    hw = calibrate("cuda")
    (out / "hardware.json").write_text(hw.to_json())
    gb = 1e9
    result.figures.update(h2d_GBps=hw.h2d / gb, d2h_GBps=hw.d2h / gb, h2d_duplex_GBps=hw.h2d_duplex / gb,
                          d2h_duplex_GBps=hw.d2h_duplex / gb, d2d_GBps=hw.d2d / gb, copy_latency_us=hw.copy_latency_s * 1e6,
                          host_adamw_GBps=hw.host_optimizer / gb, compute_slowdown=hw.compute_slowdown,
                          copy_issue_us=hw.copy_issue_s * 1e6, host_contention=hw.host_contention,
                          op_intercept_us=hw.op_intercept_s * 1e6, op_issue_us=hw.op_issue_s * 1e6)
    result.check("pinned H2D bandwidth", hw.h2d / gb, "> 0 GB/s (figure for the planner)", hw.h2d > 0)
    result.summary = (f"H2D {hw.h2d / gb:.1f} GB/s, D2H {hw.d2h / gb:.1f} GB/s, both at once {hw.h2d_duplex / gb:.1f}/"
                      f"{hw.d2h_duplex / gb:.1f} GB/s, D2D {hw.d2d / gb:.0f} GB/s; saved as hardware.json")


def _hardware(out: Path):  # noqa: ANN202
    """The calibrate step's figures if it ran, else a fresh calibration."""
    from ooc.calibrate import calibrate
    from ooc.scheduler.hardware import Hardware

    saved = out / "hardware.json"
    return Hardware.from_dict(json.loads(saved.read_text())) if saved.is_file() else calibrate("cuda")


def _step_kernels(result: StepResult, out: Path) -> None:
    import torch

    from ooc.calibrate import cuda_event_seconds
    from ooc.kernels.quant import dequantize, quantize

    n = KERNEL_ELEMENTS
    x = torch.randn(n, device="cuda").view(4096, -1)
    y = torch.empty_like(x)

    def queued_seconds(fn: Callable[[], object]) -> float:
        """Device seconds per call of ``fn`` with KERNEL_LAUNCHES calls queued back to back between
        two events: a launch's host time (~30-50 us for a Triton launcher's Python, 5 us for a copy)
        then overlaps the call before it, as in the swap engine's stream of codec launches, instead
        of being timed as device time (one call per event pair put dequantize at 0.71 of the copy on
        an H200 and back to back at 0.99)."""
        return cuda_event_seconds(lambda: [fn() for _ in range(KERNEL_LAUNCHES)], 5) / KERNEL_LAUNCHES

    d2d = 2 * 4 * n / queued_seconds(lambda: y.copy_(x))  # bytes read + written
    result.figures["d2d_GBps"] = d2d / 1e9
    codecs = ["int8", "int4"] + (["fp8_e4m3"] if torch.cuda.get_device_capability() >= (8, 9) else [])
    # quantize as the swap engine calls it (ooc.saved.CompressedStorage.encode): no read-back, the
    # NaN/Inf count added to a device flag by the kernel (NOTE [the NaN/Inf count in the kernel]).
    # Counted by three launches after the kernel, the flagged int8 rate was 0.51 of the copy on an
    # H200 and 0.97 without the flag; the unflagged rate stays a figure to show the count is free.
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    for codec in codecs:
        def encode(c: str = codec) -> object:
            return quantize(x, codec=c, check_finite=False, nonfinite_flag=flag)

        q = encode()
        code_bytes = q.codes.numel() * q.codes.element_size() + q.scales.numel() * 4
        moved = 4 * n + code_bytes  # quantize reads fp32, writes codes and scales; dequantize the reverse
        for kind, fn in (("quantize", encode), ("dequantize", lambda q=q: dequantize(q, out=y))):
            rate = moved / queued_seconds(fn)
            result.figures[f"{kind}_{codec}_GBps"] = rate / 1e9
            result.figures[f"{kind}_{codec}_one_launch_GBps"] = moved / cuda_event_seconds(fn, 10) / 1e9
            result.check(f"{kind} {codec}: fraction of the D2D copy's GB/s", rate / d2d, ">= 0.8", rate / d2d >= 0.8)
        unflagged = queued_seconds(lambda c=codec: quantize(x, codec=c, check_finite=False))
        result.figures[f"quantize_{codec}_without_flag_GBps"] = moved / unflagged / 1e9
    worst = min(c.value for c in result.checks)
    result.check("groups of the finite input the kernels counted as NaN/Inf", int(flag), "== 0", int(flag) == 0)
    result.summary = f"D2D copy {d2d / 1e9:.0f} GB/s; slowest kernel at {worst:.0%} of it"


def _median_step(model, batch, loss_fn, steps: int, warmup: int = 2) -> float:  # noqa: ANN001
    """Median wall seconds of forward + backward (no optimizer), synchronized."""
    import torch

    times = []
    for step in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss_fn(model, batch).backward()
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _step_overlap(result: StepResult, out: Path) -> None:
    import torch

    import ooc
    from ooc.backend.cuda import CudaBackend
    from ooc.models import MLPChain

    rows, width, hidden, depth = OVERLAP_CHAIN
    torch.manual_seed(0)
    model = MLPChain(width, width, depth, 16, hidden=hidden).cuda()
    batch = (torch.randn(rows, width, device="cuda"), torch.randint(0, 16, (rows,), device="cuda"))

    def loss_fn(m, b):  # noqa: ANN001, ANN202
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    backend = CudaBackend()
    times, moved = {}, {}
    for policy in ("keep", "swap"):
        ooc.wrap(model, ooc.Plan.uniform(policy, depth), backend=backend)
        times[policy] = _median_step(model, batch, loss_fn, 5)
        report = ooc.memory_report(model)
        moved[policy] = (report.swapped_out_bytes, report.swapped_in_bytes)
        ooc.unwrap(model)
    out_bytes, in_bytes = moved["swap"]
    chunk = max(1, out_bytes // depth)
    host, device = backend.host_buffer(chunk), backend.device_buffer(chunk)
    d2h_s = statistics.median(_timed(lambda: backend.copy_d2h(host, device, ()).synchronize()) for _ in range(5))
    h2d_s = statistics.median(_timed(lambda: backend.copy_h2d(device, host, ()).synchronize()) for _ in range(5))
    copy_s = out_bytes / chunk * d2h_s + in_bytes / chunk * h2d_s
    hidden_fraction = 1.0 - max(0.0, times["swap"] - times["keep"]) / copy_s
    result.figures.update(keep_step_ms=times["keep"] * 1e3, swap_step_ms=times["swap"] * 1e3, copy_alone_ms=copy_s * 1e3,
                          swapped_out_bytes=out_bytes, swapped_in_bytes=in_bytes, hidden_fraction=hidden_fraction,
                          tf32=torch.backends.cuda.matmul.allow_tf32)
    result.check("compute >= transfer (the premise): keep step / copy time", times["keep"] / copy_s, ">= 1",
                 times["keep"] >= copy_s)
    result.check("copy time hidden: 1 - (t_swap - t_keep) / t_copy", hidden_fraction, ">= 0.8", hidden_fraction >= 0.8)
    result.summary = (f"keep {times['keep'] * 1e3:.1f} ms, swap {times['swap'] * 1e3:.1f} ms, copies alone "
                      f"{copy_s * 1e3:.1f} ms: {hidden_fraction:.0%} hidden")


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _gpt2_on_cuda():  # noqa: ANN202
    """The GPT step's model on the GPU, seeded, its batch (inputs, targets) and its loss function."""
    import torch

    from ooc.models import GPT

    torch.manual_seed(0)
    preset, batch_size, seq = GPT2
    model = GPT(preset).cuda()
    x = torch.randint(0, model.config.vocab_size, (batch_size, seq), device="cuda")

    def loss_fn(m, b):  # noqa: ANN001, ANN202
        return m(*b)[1]

    return model, (x, torch.roll(x, -1, dims=1)), loss_fn


def _alternated_medians(model, batch, loss_fn, plan, backend, rounds: int = 8, steps: int = 3) -> tuple[float, float]:  # noqa: ANN001
    """Median step seconds of the plain model and of ``plan`` wrapped, measured in alternating
    rounds of ``steps`` each: the GPU's clocks and the host's load drift over a run by as much as
    the few percent an overhead check looks for, and the plain figure of the step's start was taken
    minutes before the wrapped one."""
    import ooc

    plain, wrapped = [], []
    for _ in range(rounds):
        plain.append(_median_step(model, batch, loss_fn, steps, warmup=1))
        ooc.wrap(model, plan, backend=backend)
        try:
            wrapped.append(_median_step(model, batch, loss_fn, steps, warmup=1))
        finally:
            ooc.unwrap(model)
    return statistics.median(plain), statistics.median(wrapped)


def _measure_plans(result: StepResult, model, batch, loss_fn, prof, rows, hw, backend, plain_s: float) -> None:  # noqa: ANN001
    """Run each (name, plan, budget) of ``rows`` wrapped on ``backend``; record its measured and
    predicted step time and peaks in ``result.figures[name]``; check the prediction within 20% and,
    where a budget is given, the tracked peak within it (without one: the overhead over plain)."""
    import torch

    import ooc
    from ooc.scheduler.schedule import build_schedule
    from ooc.scheduler.simulate import simulate

    figures = result.figures
    for name, plan, budget in rows:
        ooc.wrap(model, plan, backend=backend)
        torch.cuda.reset_peak_memory_stats()
        measured = _median_step(model, batch, loss_fn, 10, warmup=3)
        report = ooc.memory_report(model)
        ooc.unwrap(model)
        predicted = simulate(build_schedule(plan, prof, hw), hw, keep_timeline=False)
        letters = "".join("C" if b.cached_ops else b.policy.value[0].upper() for b in plan.blocks)  # C: caches ops
        figures[name] = dict(plan=plan.name or str(plan), blocks=letters, cached_ops=sum(len(b.cached_ops) for b in plan.blocks),
                             measured_ms=measured * 1e3, predicted_ms=predicted.step_time_s * 1e3,
                             tracked_peak_bytes=report.peak_bytes, predicted_peak_bytes=predicted.peak_bytes,
                             budget_bytes=budget, cuda_max_allocated=report.cuda_max_allocated,
                             measured_over_plain=measured / plain_s)
        if budget is None:
            plain_round, wrapped_round = _alternated_medians(model, batch, loss_fn, plan, backend)
            overhead = wrapped_round / plain_round - 1.0
            figures[name].update(alternated_plain_ms=plain_round * 1e3, alternated_measured_ms=wrapped_round * 1e3)
            result.check("all-KEEP overhead vs plain PyTorch (alternated)", overhead, "<= 0.03", overhead <= 0.03)
        else:
            error = abs(measured - predicted.step_time_s) / measured
            result.check(f"{name}: |measured - predicted| / measured step time", error, "<= 0.20", error <= 0.2)
            result.check(f"{name}: tracked peak / budget", report.peak_bytes / budget, "<= 1", report.peak_bytes <= budget)
    result.summary = ", ".join(
        [f"plain {plain_s * 1e3:.1f} ms"]
        + [f"{name} {figures[name]['measured_ms']:.1f} ms (predicted {figures[name]['predicted_ms']:.1f})" for name, _, _ in rows])


def _step_gpt2(result: StepResult, out: Path) -> None:
    import ooc
    from ooc.api import plan_for_profile
    from ooc.backend.cuda import CudaBackend
    from ooc.scheduler.schedule import build_schedule

    model, batch, loss_fn = _gpt2_on_cuda()
    backend = CudaBackend()
    hw = _hardware(out)
    plain_s = _median_step(model, batch, loss_fn, 10, warmup=3)
    prof = ooc.profile(model, batch, backend=backend, reps=3)
    keep = ooc.Plan.uniform("keep", len(model.blocks))
    keep_peak = build_schedule(keep, prof).peak_bytes
    result.figures.update(plain_ms=plain_s * 1e3, keep_peak_bytes=keep_peak)
    rows = [("keep", keep, None)]
    for fraction in (0.5, 0.25):
        budget = int(keep_peak * fraction)
        rows.append((f"optimal@{fraction:.0%}", plan_for_profile(prof, budget, hardware=hw, planner="optimal"), budget))
    _measure_plans(result, model, batch, loss_fn, prof, rows, hw, backend, plain_s)


def _step_oplevel(result: StepResult, out: Path) -> None:
    """Issue 15 on a GPU: the op-level planner against block-level ``optimal``, both planned on one
    op-level profile measured here, at 50% and 25% of the keep-all saved activations; and the
    op-level plan's gradients against plain PyTorch's, bit for bit."""
    import torch

    import ooc
    from ooc.api import plan_for_profile
    from ooc.backend.cuda import CudaBackend

    model, batch, loss_fn = _gpt2_on_cuda()
    backend = CudaBackend()
    hw = _hardware(out)
    plain_s = _median_step(model, batch, loss_fn, 10, warmup=3)
    prof = ooc.profile(model, batch, backend=backend, reps=3, ops=True, codec_errors=False)
    keep_all = sum(b.saved_bytes for b in prof.blocks)
    result.figures.update(plain_ms=plain_s * 1e3, keep_all_saved_bytes=keep_all,
                          ops_per_block=len(prof.blocks[0].ops))
    rows = []
    for fraction in (0.5, 0.25):
        budget = int(keep_all * fraction)
        for planner in ("optimal", "op-level"):
            rows.append((f"{planner}@{fraction:.0%}", plan_for_profile(prof, budget, hardware=hw, planner=planner), budget))
    _measure_plans(result, model, batch, loss_fn, prof, rows, hw, backend, plain_s)
    for fraction in ("50%", "25%"):
        ratio = result.figures[f"op-level@{fraction}"]["measured_ms"] / result.figures[f"optimal@{fraction}"]["measured_ms"]
        result.figures[f"op-level/optimal@{fraction}"] = ratio
        result.summary += f"; op-level/optimal@{fraction} {ratio:.3f}"
    grads = {}
    for name, plan in (("plain", None), ("op-level@25%", rows[-1][1])):
        if plan is not None:
            ooc.wrap(model, plan, backend=backend)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks on both sides
        loss_fn(model, batch).backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
        if plan is not None:
            ooc.unwrap(model)
    equal = all(torch.equal(a, b) for a, b in zip(grads["plain"], grads["op-level@25%"]))
    result.check("op-level@25% gradients equal plain PyTorch's bit for bit", float(equal), "== 1", equal)


STEP_FUNCTIONS: dict[str, Callable[[StepResult, Path], None]] = {
    "environment": _step_environment,
    "offline-install": _step_offline_install,
    "compile-lane": _step_compile_lane,
    "calibrate": _step_calibrate,
    "kernels": _step_kernels,
    "overlap": _step_overlap,
    "gpt2": _step_gpt2,
    "oplevel": _step_oplevel,
    "gpu-lane": _step_gpu_lane,
}


def _run_step_here(name: str, out: Path, result_path: Path) -> int:
    """The child side: run one step, write its StepResult as JSON."""
    spec = next(s for s in STEPS if s.name == name)
    result = StepResult(spec.name, spec.title, cap_s=spec.cap_s)
    try:
        STEP_FUNCTIONS[name](result, out)
    except Exception as exc:  # noqa: BLE001 - a step's error is its result, reported with the traceback's end
        import traceback

        result.status = "fail"
        result.reason = f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exc().splitlines(True)[-8:])
    result_path.write_text(json.dumps(asdict(result)))
    return 0


# ------------------------------------------------------------------------------------------------
# The parent side: decide, run under caps, report.


def _gpu_absent_reason() -> str | None:
    import torch

    if torch.cuda.is_available():
        return None
    return (f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda})")


def _run_child(spec: StepSpec, out: Path, timeout: float) -> StepResult:
    result_path = out / f".{spec.name}.json"
    result_path.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if (ROOT / "pyproject.toml").is_file():  # a source checkout: its ooc, whatever is installed
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "ooc.apps.doctor", "--out", str(out), "--run-step", spec.name, "--step-out", str(result_path)]
    # Own session: on timeout the step and anything it started (pytest, pip) are stopped together.
    code, output = run_capped(command, timeout, session=True, cwd=ROOT, env=env)
    if code is None:
        return StepResult(spec.name, spec.title, status="fail", cap_s=timeout,
                          reason=f"timed out after {timeout:.0f} s (the step's cap); output tail: {output[-800:]}")
    if result_path.is_file():
        data = json.loads(result_path.read_text())
        result_path.unlink()
        data["checks"] = [Check(**c) for c in data["checks"]]
        return StepResult(**data)
    return StepResult(spec.name, spec.title, status="fail", cap_s=timeout,
                      reason=f"the step's process exited {code} without a result: {output[-1500:]}")


MIN_STEP_S = 15.0
"""A step is started only with at least this many seconds of the budget left."""


def run_doctor(out: Path, *, budget_s: float = DEFAULT_BUDGET_S, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run every step (or ``only`` these) within ``budget_s``; write DIR/doctor.json and DIR/doctor.md."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    deadline = time.monotonic() + budget_s
    no_gpu = _gpu_absent_reason()
    has_source = (ROOT / "pyproject.toml").is_file() and (ROOT / "tests").is_dir()
    results = []
    for spec in STEPS:
        remaining = deadline - time.monotonic()
        skip = None
        if spec.needs_gpu and no_gpu:
            skip = no_gpu
        elif spec.needs_source and not has_source:
            skip = f"needs the source checkout (pyproject.toml and tests/ beside the ooc package); {ROOT} has none"
        elif only and spec.name not in only:
            skip = f"not selected (--only {','.join(only)})"
        elif remaining < MIN_STEP_S:
            skip = f"the doctor's time budget ({budget_s:.0f} s) ran out before this step"
        if skip:
            results.append(StepResult(spec.name, spec.title, status="skip", reason=skip, cap_s=spec.cap_s))
            continue
        timeout = min(spec.cap_s, remaining)
        start = time.monotonic()
        result = _run_child(spec, out, timeout)
        result.elapsed_s = time.monotonic() - start
        result.cap_s = timeout
        results.append(result)
    report = _report(results, started, budget_s, no_gpu)
    (out / "doctor.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "doctor.md").write_text(format_markdown(report))
    return report


def _report(results: list[StepResult], started: float, budget_s: float, no_gpu: str | None) -> dict[str, Any]:
    counts = {status: sum(r.status == status for r in results) for status in ("pass", "fail", "skip")}
    environment = next((r.figures for r in results if r.name == "environment"), {})
    return {
        "ok": counts["fail"] == 0,
        "counts": counts,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "host": platform.node(),
        "device": environment.get("device", no_gpu or "unknown"),
        "budget_s": budget_s,
        "elapsed_s": round(time.time() - started, 1),
        "steps": [asdict(r) for r in results],
    }


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "; ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(map(str, value)) if value else "none"
    return str(value)


def format_markdown(report: dict[str, Any]) -> str:
    """The one-page report: a line per step, then each step's checks and figures."""
    verdict = "PASS" if report["ok"] else "FAIL"
    c = report["counts"]
    lines = [
        "# ooc doctor",
        "",
        f"{report['started']} on `{report['host']}`; device: {report['device']}",
        "",
        f"**{verdict}**: {c['pass']} passed, {c['fail']} failed, {c['skip']} skipped in {report['elapsed_s']:.0f} s "
        f"(budget {report['budget_s']:.0f} s)",
        "",
        "| step | status | time | summary or reason |",
        "|---|---|---|---|",
    ]
    for step in report["steps"]:
        text = (step["summary"] if step["status"] == "pass" else step["reason"] or step["summary"]).splitlines()
        note = (text[0] if text else "").replace("|", "\\|")
        took = f"{step['elapsed_s']:.1f} s / {step['cap_s']:.0f} s" if step["status"] != "skip" else "-"
        lines.append(f"| {step['name']} | {step['status'].upper()} | {took} | {note} |")
    for step in report["steps"]:
        if step["status"] == "skip":
            continue
        lines += ["", f"## {step['name']}: {step['title']}", ""]
        if step["reason"]:
            lines += ["```", step["reason"].strip()[-1500:], "```", ""]
        for check in step["checks"]:
            lines.append(f"- {'ok' if check['ok'] else 'FAIL'}: {check['name']} = {check['value']:.4g} (target {check['target']})")
        if step["figures"]:
            lines.append("- figures: " + "; ".join(f"{k} {_fmt(v)}" for k, v in step["figures"].items()))
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``ooc doctor`` (also ``python -m ooc.apps.doctor``)."""
    parser.add_argument("--out", type=Path, required=True, help="folder for doctor.md, doctor.json and the step logs")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"overall time budget in seconds (default {DEFAULT_BUDGET_S:.0f}: under 10 minutes in all)")
    parser.add_argument("--only", default="", help=f"comma-separated steps to run, of: {', '.join(s.name for s in STEPS)}")
    parser.add_argument("--run-step", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--step-out", type=Path, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Run the doctor from parsed arguments; 0 when no step failed."""
    if args.run_step:
        return _run_step_here(args.run_step, args.out, args.step_out)
    only = tuple(s for s in args.only.split(",") if s)
    unknown = sorted(set(only) - {s.name for s in STEPS})
    if unknown:
        raise SystemExit(f"ooc doctor: no step {', '.join(unknown)}; steps are {', '.join(s.name for s in STEPS)}")
    report = run_doctor(args.out, budget_s=args.budget_s, only=only)
    print(format_markdown(report))
    print(f"report: {args.out / 'doctor.md'} and {args.out / 'doctor.json'}")
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ooc doctor", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
