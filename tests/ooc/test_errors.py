"""Bad input gives a clear exception, and leaves the model unchanged and trainable."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import signal
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import ooc
import ooc.api
from ooc.api import ASSUMED_GPU, hardware_for
from ooc.models import GPT
from ooc.scheduler.hardware import preset
from ooc.scheduler.profile import Profile
from tests.helpers import NANO_NO_DROPOUT as NANO
from tests.helpers import gpt_batch


def _assert_untouched_and_trainable(model: nn.Module, reference: nn.Module, batch) -> None:
    assert not ooc.is_wrapped(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
        m(*batch)[1].backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))


@pytest.fixture()
def gpt():
    torch.manual_seed(0)
    model = GPT(NANO)
    return model, copy.deepcopy(model), gpt_batch()


def test_budget_below_minimum_names_the_minimum(gpt) -> None:
    model, reference, batch = gpt
    with pytest.raises(ooc.BudgetError) as info:
        ooc.wrap(model, budget=1000, sample=batch, backend="cpu")
    assert info.value.minimum_bytes > 1000
    assert str(info.value.minimum_bytes) in str(info.value)
    assert "Raise the budget" in str(info.value)
    _assert_untouched_and_trainable(model, reference, batch)


def test_budget_at_the_minimum_is_feasible(gpt) -> None:
    model, _, batch = gpt
    with pytest.raises(ooc.BudgetError) as info:
        ooc.wrap(model, budget=1000, sample=batch, backend="cpu")
    ooc.wrap(model, budget=info.value.minimum_bytes, sample=batch, backend="cpu")
    model(*batch)[1].backward()
    assert ooc.memory_report(model).peak_bytes <= info.value.minimum_bytes
    ooc.unwrap(model)


def test_budget_without_sample_plans_from_the_first_step(gpt) -> None:
    model, reference, batch = gpt
    prof = ooc.profile(model, batch)
    budget = sum(b.saved_bytes for b in prof.blocks) // 2
    ooc.wrap(model, budget=budget, backend="cpu")
    for step in range(3):
        policies = set(ooc.runtime.runtime_of(model).plan.policies)
        for m in (model, reference):
            torch.manual_seed(step)
            m(*batch)[1].backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
        if step == 0:  # measured under recompute-all, the leanest plan
            assert policies == {ooc.Policy.RECOMPUTE}
        else:
            assert ooc.memory_report(model).peak_bytes <= budget
            assert ooc.Policy.KEEP in policies
    ooc.unwrap(model)


def test_budget_without_sample_that_nothing_fits(gpt) -> None:
    model, reference, batch = gpt
    ooc.wrap(model, budget=1000, backend="cpu")
    with pytest.raises(ooc.BudgetError, match="smallest peak any plan reaches"):
        model(*batch)[1].backward()
    reference(*batch)[1].backward()  # the failed step's gradients are those of plain PyTorch
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    _assert_untouched_and_trainable(model, reference, batch)


def test_no_blocks_lists_the_candidates() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with pytest.raises(ooc.BlockError, match=r"candidates: <model> \(Sequential, 3 children\).*blocks=\["):
        ooc.wrap(model)
    assert not ooc.is_wrapped(model)


def test_wrapping_twice(gpt) -> None:
    model, _, batch = gpt
    ooc.wrap(model, backend="cpu")
    with pytest.raises(ooc.WrapError, match="already wrapped.*unwrap"):
        ooc.wrap(model, backend="cpu")
    ooc.unwrap(model)


def test_plan_length_mismatch(gpt) -> None:
    model, reference, batch = gpt
    with pytest.raises(ooc.PlanError, match="plan has 3 blocks but the model has 4"):
        ooc.wrap(model, ooc.Plan.uniform("swap", 3), backend="cpu")
    _assert_untouched_and_trainable(model, reference, batch)


def test_no_trainable_parameters(gpt) -> None:
    model, _, _ = gpt
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ooc.WrapError, match="no parameters that require grad"):
        ooc.wrap(model)
    assert not ooc.is_wrapped(model)


def test_blocks_that_are_not_submodules(gpt) -> None:
    model, reference, batch = gpt
    with pytest.raises(ooc.BlockError, match="submodule"):
        ooc.wrap(model, blocks=[nn.Linear(2, 2)])
    _assert_untouched_and_trainable(model, reference, batch)


def test_unknown_backend_and_planner(gpt) -> None:
    model, reference, batch = gpt
    with pytest.raises(ValueError, match="backend must be"):
        ooc.wrap(model, backend="tpu")
    with pytest.raises(ValueError, match="no planner 'magic'"):
        ooc.wrap(model, budget="1GiB", sample=batch, planner="magic", backend="cpu")
    _assert_untouched_and_trainable(model, reference, batch)


def test_unwrap_of_a_plain_model() -> None:
    with pytest.raises(ooc.WrapError, match="not wrapped"):
        ooc.unwrap(nn.Linear(2, 2))


def test_every_exported_error_is_an_ooc_error() -> None:
    """``except ooc.OocError`` catches every error ooc exports, whichever package exports it.

    ``ooc.kernels`` is the exception: it imports only torch/triton/cupy (DESIGN.md), so its
    ``UnsupportedCodecError`` is a ValueError; the runtime refuses such a codec with a PlanError
    before any kernel runs (``check_codecs``)."""
    import importlib
    import sys

    packages = ("ooc", "ooc.scheduler", "ooc.optim", "ooc.optim.pipeline", "ooc.distributed", "ooc.recompute",
                "ooc.backend.order")
    for name in packages:
        importlib.import_module(name)
    errors = {}
    for name, module in list(sys.modules.items()):
        if name in packages or (name.startswith("ooc.") and not name.startswith("ooc.kernels") and module is not None):
            for attr in dir(module):
                obj = getattr(module, attr)
                if (isinstance(obj, type) and issubclass(obj, Exception) and not issubclass(obj, Warning)
                        and obj.__module__.startswith("ooc")
                        and not obj.__name__.startswith("_")):  # private control flow is not exported
                    errors[f"{obj.__module__}.{obj.__qualname__}"] = obj
    expected = {
        "ooc.scheduler.errors.PlanError", "ooc.scheduler.errors.ProfileError", "ooc.scheduler.errors.HardwareError",
        "ooc.scheduler.errors.InfeasibleBudget", "ooc.errors.BudgetError", "ooc.errors.WrapError",
        "ooc.errors.BlockError", "ooc.optim.host_adamw.HostMemoryError", "ooc.optim.pipeline.PipelineError",
        "ooc.distributed.WorldError", "ooc.recompute.RecomputeError", "ooc.backend.order.StreamOrderError",
    }
    assert expected <= set(errors)
    assert [name for name, cls in sorted(errors.items()) if not issubclass(cls, ooc.OocError)] == []
    assert issubclass(ooc.PlanError, ValueError) and issubclass(ooc.scheduler.InfeasibleBudget, ValueError)


@contextlib.contextmanager
def _deadline(seconds: float):
    """Fail instead of hanging: a NaN that gets past validation makes planning loop forever."""

    def expire(signum, frame) -> None:  # noqa: ANN001
        raise TimeoutError(f"still running after {seconds} s: a bad number got past validation")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_wrap_refuses_a_profile_with_nan_before_planning(gpt, tmp_path) -> None:
    model, reference, batch = gpt
    data = ooc.profile(model, batch, reps=1).to_dict()
    data["blocks"][1]["forward_s"] = math.nan
    path = tmp_path / "nan.json"
    path.write_text(json.dumps(data))
    with _deadline(60), pytest.raises(ooc.ProfileError, match="forward_s must be a finite number"):
        ooc.wrap(model, budget="1GiB", profile=ooc.scheduler.Profile.load(path), backend="cpu")
    _assert_untouched_and_trainable(model, reference, batch)


@pytest.mark.parametrize("budget", [math.inf, math.nan], ids=str)
def test_a_budget_that_is_not_finite_names_the_budget(gpt, budget: float) -> None:
    model, reference, batch = gpt
    with _deadline(60), pytest.raises(ooc.OocError, match="budget or byte size must be a finite number") as info:
        ooc.wrap(model, budget=budget, sample=batch, backend="cpu")
    assert isinstance(info.value, ValueError)
    _assert_untouched_and_trainable(model, reference, batch)


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m ooc ARGS`` in a fresh process, killed (and the test failed) if it hangs."""
    return subprocess.run([sys.executable, "-m", "ooc", *args], capture_output=True, text=True, timeout=120)


def test_cli_plan_and_simulate_refuse_nan_and_infinity(tmp_path) -> None:
    from ooc.scheduler import BlockProfile, Plan, Profile, preset

    prof = Profile(tuple(BlockProfile(f"b{i}", 1e-3, 2e-3, 1 << 20, 1 << 20, 1 << 16, 1 << 16, 1 << 16, 0, 0)
                         for i in range(3)), machine={"backend": "cpu"})
    bad_profile = prof.to_dict()
    bad_profile["blocks"][0]["backward_s"] = math.inf
    (tmp_path / "profile.json").write_text(json.dumps(bad_profile))
    run = _cli("plan", "--profile", str(tmp_path / "profile.json"), "--budget", "2MiB")
    assert run.returncode == 2 and "backward_s must be a finite number" in run.stderr

    bad_hardware = preset("cpu").to_dict()
    bad_hardware["compute_slowdown"] = math.nan
    (tmp_path / "hw.json").write_text(json.dumps(bad_hardware))
    prof.save(tmp_path / "good.json")
    (tmp_path / "plan.json").write_text(Plan.uniform("swap", 3).to_json())
    run = _cli("simulate", "--profile", str(tmp_path / "good.json"), "--plan", str(tmp_path / "plan.json"),
               "--hardware", str(tmp_path / "hw.json"))
    assert run.returncode == 2 and "compute_slowdown must be a finite number" in run.stderr
def test_the_first_step_is_planned_from_its_own_profile(gpt, monkeypatch) -> None:
    """The recorder's profile of the measured first step has the bytes ``ooc.profile`` measures."""
    model, _, batch = gpt
    prof = ooc.profile(model, batch)
    seen = []
    planner = ooc.api.plan_for_profile
    monkeypatch.setattr(ooc.api, "plan_for_profile", lambda p, *a, **k: seen.append(p) or planner(p, *a, **k))
    ooc.wrap(model, budget=sum(b.saved_bytes for b in prof.blocks), backend="cpu")
    model(*batch)[1].backward()
    ooc.unwrap(model)
    assert len(seen) == 1 and isinstance(seen[0], Profile)
    fields = ("saved_bytes", "swappable_bytes", "input_bytes", "input_swappable_bytes", "param_bytes", "compressed")
    assert [[getattr(b, f) for f in fields] for b in seen[0].blocks] == [[getattr(b, f) for f in fields] for b in prof.blocks]


@pytest.mark.parametrize("before", ["validation", "eval-validation"])
def test_a_forward_dropped_before_the_first_step_is_not_in_its_profile(gpt, monkeypatch, before: str) -> None:
    """A validation forward without ``no_grad`` (README: it works) before the first training step of
    ``wrap(budget=...)``: its graph dropped unused, the recorder kept its records and the first step's
    profile held both forwards' (every block's input bytes doubled, its times mixed). The profile the
    plan comes from is the training step's alone."""
    model, _, batch = gpt
    prof = ooc.profile(model, batch)
    seen = []
    planner = ooc.api.plan_for_profile
    monkeypatch.setattr(ooc.api, "plan_for_profile", lambda p, *a, **k: seen.append(p) or planner(p, *a, **k))
    ooc.wrap(model, budget=sum(b.saved_bytes for b in prof.blocks), backend="cpu")
    model.train(before == "validation")
    model(*batch)[1].item()  # a validation loss read; its graph is dropped
    model.train()
    model(*batch)[1].backward()
    ooc.unwrap(model)
    assert len(seen) == 1
    fields = ("saved_bytes", "swappable_bytes", "input_bytes", "input_swappable_bytes", "param_bytes", "compressed")
    assert [[getattr(b, f) for f in fields] for b in seen[0].blocks] == [[getattr(b, f) for f in fields] for b in prof.blocks]


def test_no_hardware_on_a_gpu_warns_which_preset_is_assumed() -> None:
    gpu = SimpleNamespace(device=torch.device("cuda", 0))  # a device object; CUDA is never touched
    with pytest.warns(UserWarning, match=r"planning for the 'h100-sxm' preset.*hardware=.*ooc calibrate"):
        assert hardware_for(None, gpu) == preset(ASSUMED_GPU) == preset("h100-sxm")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hardware_for(None, SimpleNamespace(device=torch.device("cpu"))) == preset("cpu")
        assert hardware_for("h200", gpu) == preset("h200")


@pytest.mark.parametrize("plan, hint", [
    ("20GiB", r"got str \('20GiB'\): for a budget, pass it by name, ooc.wrap\(model, budget='20GiB'\)"),
    (2**30, r"got int \(1073741824\): for a budget, pass it by name, ooc.wrap\(model, budget=1073741824\)"),
    (["keep", "recompute"], r"got list; ooc.Plan.of\(\[...\]\) makes one from policy names"),
])
def test_a_budget_or_a_list_given_as_the_plan_says_what_to_write(gpt, plan, hint: str) -> None:
    """``ooc.wrap(model, "20GiB")``: the budget went to ``plan``, the second argument, and the error said only
    "plan must be an ooc.scheduler.Plan, got str"."""
    model, reference, batch = gpt
    with pytest.raises(ooc.WrapError, match=r"plan must be an ooc.scheduler.Plan, " + hint):
        ooc.wrap(model, plan)
    _assert_untouched_and_trainable(model, reference, batch)
