"""The public entry points: ``wrap``, ``plan``."""

from __future__ import annotations

import warnings
from typing import Any

import torch.nn as nn

from ooc.backend import Backend, resolve_backend
from ooc.blocks import find_blocks
from ooc.errors import BudgetError, WrapError
from ooc.profiler import FirstStepRecorder
from ooc.profiler import profile as measure_profile
from ooc.runtime import BudgetExceededWarning, check_trainable, install
from ooc.scheduler import checks
from ooc.scheduler.costmodel import build_options
from ooc.scheduler.errors import PlanError
from ooc.scheduler.hardware import PRESETS, Hardware, preset
from ooc.scheduler.optimal import minimum_peak
from ooc.scheduler.param_planner import plan_with_streaming
from ooc.scheduler.plan import Plan, Policy
from ooc.scheduler.planners import PLANNERS, InfeasibleBudget, annotate
from ooc.scheduler.profile import Profile
from ooc.scheduler.schedule import peak_bytes
from ooc.scheduler.units import format_bytes, parse_bytes

DEFAULT_PLANNER = "optimal"
ASSUMED_GPU = "h100-sxm"
"""The preset a GPU is planned for when no ``hardware=`` is given."""


def hardware_for(hardware: Hardware | str | None, backend: Backend) -> Hardware:
    """The machine to plan for: ``hardware`` itself, a preset by name, or with ``None`` the ``cpu``
    preset on the CPU and the ``ASSUMED_GPU`` preset on any GPU, with a warning that says so."""
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str):
        return preset(hardware)
    if hardware is not None:
        raise WrapError(f"hardware must be an ooc.scheduler.Hardware, a preset name ({', '.join(sorted(PRESETS))}) "
                        f"or None, got {hardware!r} ({type(hardware).__name__})")
    if backend.device.type == "cpu":
        return preset("cpu")
    # Reported at ooc's own call site, so the default filter shows it once per process and entry point.
    warnings.warn(
        f"no hardware= given: planning for the {ASSUMED_GPU!r} preset, whatever this GPU is. Pass hardware= a "
        f"preset name ({', '.join(sorted(PRESETS))}) or the Hardware that `ooc calibrate` measures on this machine",
        UserWarning, stacklevel=2,
    )
    return preset(ASSUMED_GPU)


def plan_for_profile(
    prof: Profile,
    budget: int | str,
    *,
    hardware: Hardware,
    planner: str = DEFAULT_PLANNER,
    prefetch: int = 2,
    include_params: bool = False,
) -> Plan:
    """Run a named planner on a profile; raise :class:`ooc.BudgetError` if nothing fits.

    ``include_params``: the budget covers the device-resident parameters too, and blocks may have
    their parameters streamed from the host (:func:`ooc.scheduler.param_planner.plan_with_streaming`).
    """
    budget_bytes = parse_bytes(budget)
    _check_prefetch(prefetch)
    choose = _planner(planner)
    if include_params:
        try:
            return annotate(plan_with_streaming(prof, hardware, budget_bytes, choose, prefetch=prefetch), prof)
        except InfeasibleBudget as exc:
            raise BudgetError(budget_bytes, exc.minimum_bytes, "(Every block's parameters may already be streamed.)",
                              what="parameters and saved activations together") from None
    try:
        chosen = choose(prof, hardware, budget_bytes, prefetch=prefetch)
    except InfeasibleBudget:
        chosen = None
    if chosen is None or peak_bytes(chosen, prof) > budget_bytes:
        minimum = minimum_peak(build_options(prof, hardware), prefetch)
        # Advice to switch planners only where 'optimal' would fit: below its minimum none does.
        fits_optimal = planner != "optimal" and budget_bytes >= minimum
        detail = f"(the {planner!r} planner's own plan needs more; try planner='optimal')" if fits_optimal else ""
        raise BudgetError(budget_bytes, minimum, detail)
    return annotate(chosen, prof)


def _planner(name: object) -> Any:
    """The planner called ``name``; :class:`PlanError` naming the choices for any other value."""
    if not isinstance(name, str) or name not in PLANNERS:
        raise PlanError(f"no planner {name!r}; choose one of {sorted(PLANNERS)}")
    return PLANNERS[name]


def _check_prefetch(prefetch: object) -> None:
    # A negative depth indexed the planners' tables from their end (an IndexError deep inside).
    checks.count(prefetch, "prefetch", WrapError, hint="the number of blocks whose swapped tensors are copied back "
                 "ahead of their backward (2 by default)")


def plan(
    model: nn.Module,
    sample: Any,
    *,
    budget: int | str,
    hardware: Hardware | str | None = None,
    planner: str = DEFAULT_PLANNER,
    blocks: object = None,
    backend: str | Backend = "auto",
    prefetch: int = 2,
    include_params: bool = False,
) -> Plan:
    """Profile ``model`` on ``sample`` and choose a plan whose predicted peak of saved activations
    on the device is at most ``budget`` (bytes, or a string like ``"20GiB"``); with
    ``include_params``, of parameters and saved activations together, streaming parameters from
    the host where needed."""
    return _plan_from_sample(model, sample, budget=budget, hardware=hardware, planner=planner, blocks=blocks,
                             backend=backend, prefetch=prefetch, include_params=include_params)


def _plan_from_sample(model: nn.Module, sample: Any, *, budget: int | str, hardware: Hardware | str | None, planner: str,
                      blocks: object, backend: str | Backend, prefetch: int, include_params: bool) -> Plan:
    """``plan``, for it and for ``wrap(budget=..., sample=...)``: its warnings point at their caller."""
    _check_prefetch(prefetch)
    _planner(planner)
    if sample is None:
        raise WrapError("ooc.plan profiles the model on a sample: pass one input batch as its second argument (or "
                        "call ooc.wrap(model, budget=...) without a sample to plan from the first training step)")
    if not model.training:
        # NOTE [a plan is for the batch it measured] in ooc.runtime: the profile measures the forward as
        # the model runs it now (HF's from_pretrained returns models in eval mode, Trainer then trains them).
        warnings.warn(
            f"{type(model).__name__} is in eval mode, so its profile measures an eval forward, which saves less "
            "than a training one (dropout saves its masks): a plan for this budget goes over it once the model "
            "trains in train mode. Call model.train() before ooc.wrap / ooc.plan (Hugging Face's from_pretrained "
            "returns models in eval mode); if you train in eval mode, ignore this.",
            UserWarning, stacklevel=3,  # the caller of ooc.plan or ooc.wrap
        )
    backend_obj = resolve_backend(backend, model)
    try:
        prof = measure_profile(model, sample, blocks=blocks, backend=backend_obj)
    finally:
        if not isinstance(backend, Backend):
            backend_obj.close()
    return plan_for_profile(prof, budget, hardware=hardware_for(hardware, backend_obj), planner=planner, prefetch=prefetch,
                            include_params=include_params)
"""``plan``, under a name that ``wrap``'s own ``plan`` parameter does not shadow."""


def _plan_hint(plan: object) -> str:
    """What a plan of the wrong type was likely meant as: ``wrap(model, "20GiB")`` took the budget as its
    ``plan`` (the second argument) and said only that a str is no Plan."""
    if isinstance(plan, (str, int, float)) and not isinstance(plan, bool):
        return f" ({plan!r}): for a budget, pass it by name, ooc.wrap(model, budget={plan!r})"
    if isinstance(plan, (list, tuple)):
        return "; ooc.Plan.of([...]) makes one from policy names ('keep', 'swap', 'recompute') or BlockPlans"
    return ""


def _warn_if_predicted_over(plan: Plan, budget: int, include_params: bool) -> None:
    """NOTE [a given plan predicted over the budget]
    ``wrap(model, plan, budget=...)``: the plan wins, and nothing checked the budget, at wrap or after
    a step. A plan that ``ooc.plan`` or ``ooc plan`` chose from a profile carries its predicted peak
    (``predicted_peak_bytes``, and ``predicted_param_peak_bytes`` with streamed blocks): a plan made
    for a larger budget (another GPU, a JSON file kept from an earlier run) is known to go over this
    one before any step runs, and on a GPU its first step runs out of memory before a warning after
    the step (``Runtime.check_budget``) could say why. So it warns here, at the caller's line. A plan
    without predictions (``Plan.uniform``, ``Plan.of``) says nothing to compare: still silent.
    ``include_params``: the parameters count too (streamed blocks' peak where the plan has one)."""
    meta = dict(plan.meta)
    peak = meta.get("predicted_peak_bytes")
    if not isinstance(peak, int):
        return
    what = "saved activations"
    params = meta.get("predicted_param_peak_bytes")
    if include_params and isinstance(params, int):
        peak += params
        what = "parameters and saved activations"
    if peak <= budget:
        return
    warnings.warn(
        f"this plan ({plan.name!r}) predicts a peak of {format_bytes(peak)} of {what} on the device, over "
        f"budget={format_bytes(budget)}: plan= wins over budget=, so the steps will go over it (on a GPU with only "
        "the budget free, the first step runs out of memory). To plan for this budget, leave plan= out: "
        "ooc.wrap(model, budget=..., sample=<a batch>) (NOTE [a given plan predicted over the budget] in ooc.api).",
        BudgetExceededWarning, stacklevel=3,  # the caller of ooc.wrap
    )


def wrap(
    model: nn.Module,
    plan: Plan | None = None,
    *,
    budget: int | str | None = None,
    sample: Any = None,
    blocks: object = None,
    backend: str | Backend = "auto",
    prefetch: int = 2,
    hardware: Hardware | str | None = None,
    planner: str = DEFAULT_PLANNER,
    profile: Profile | None = None,
    include_params: bool = False,
    check_recompute: bool = False,
) -> nn.Module:
    """Install ooc's runtime on ``model`` and return it; the training loop stays as it is.

    - ``plan``: one :class:`~ooc.scheduler.Plan` decision per block; it always wins over ``budget``.
    - ``budget``: plan so the predicted peak of device-resident saved activations stays within
      ``budget``. With ``sample`` (one input batch) the blocks are profiled now; without it the
      first training step runs with every block recomputed and is measured, and the plan takes over
      from the second step (if nothing fits, that step's ``backward()`` raises ``BudgetError`` and
      the model is unwrapped). With
      ``profile=`` (from ``ooc.profile`` or ``ooc profile``) nothing is measured; the profile must
      describe this model's blocks.
    - ``include_params``: ``budget`` covers the parameters on the device as well, and blocks may
      have them streamed from the host (needs ``sample`` or ``profile``).
    - Neither: every block keeps its activations (the runtime only measures).
    - ``blocks``: the chain (a list of submodules or a ModuleList/Sequential); found if omitted.
    - ``backend``: ``"auto"`` (CUDA if the model is there), ``"cpu"``, ``"chaos"``, ``"cuda"`` or a
      :class:`~ooc.backend.Backend`.

    - ``check_recompute``: a recomputed block's re-run must save the same values as its forward,
      bit for bit (each compared; a host copy of each is kept until the block's backward), else
      ``RecomputeError``. Without it only the count, shapes and dtypes are checked.

    Every check runs before anything is installed: after an error the model is unchanged.
    """
    check_trainable(model)
    _check_prefetch(prefetch)
    given_plan = plan
    # Without a sample the planner runs only when the first step's backward ends; a misspelt
    # name must fail here, before that step is spent and the model unwrapped.
    _planner(planner)
    if profile is not None and not isinstance(profile, Profile):
        raise WrapError(f"profile must be an ooc.scheduler.Profile (ooc.profile(...) or Profile.load(path)), got "
                        f"{profile!r:.80} ({type(profile).__name__})")
    for name, value in (("include_params", include_params), ("check_recompute", check_recompute)):
        checks.flag(value, name, WrapError)  # the string "no" would read as True
    if include_params and plan is None and budget is not None and sample is None and profile is None:
        raise WrapError("include_params=True plans parameters from a profile: pass sample= (one input batch) or "
                        "profile=, so the first step does not have to hold every parameter on the device")
    planned_from_sample = plan is None and budget is not None and profile is None and sample is not None
    chain = find_blocks(model, blocks, sample=sample if planned_from_sample else None)
    backend_obj = resolve_backend(backend, model)
    if plan is None:
        if budget is not None and profile is not None:
            profile.check_matches(list(chain.names), [sum(p.numel() * p.element_size() for p in m.parameters())
                                                      for m in chain.modules])
            plan = plan_for_profile(profile, budget, hardware=hardware_for(hardware, backend_obj), planner=planner,
                                    prefetch=prefetch, include_params=include_params)
        elif budget is not None and sample is None:
            # Plan from the first training step: it runs with every block recomputed (the least
            # memory any plan needs) and is measured; the plan is chosen when its backward ends.
            budget_bytes = parse_bytes(budget)
            hw = hardware_for(hardware, backend_obj)
            first = Plan.uniform(Policy.RECOMPUTE, len(chain), prefetch=prefetch)
            runtime = install(model, chain, first, backend_obj, owns_backend=not isinstance(backend, Backend),
                              check_recompute=check_recompute)
            recorder = FirstStepRecorder(model, chain, backend_obj, first.min_swap_bytes)
            runtime.begin_deferred(recorder, lambda prof: plan_for_profile(
                prof, budget_bytes, hardware=hw, planner=planner, prefetch=prefetch))
            runtime.budget = (budget_bytes, False)
            return model
        elif budget is not None:
            plan = _plan_from_sample(
                model, sample, budget=budget, hardware=hardware, planner=planner,
                blocks=list(chain.modules), backend=backend_obj, prefetch=prefetch, include_params=include_params,
            )
        else:
            plan = Plan.uniform(Policy.KEEP, len(chain), prefetch=prefetch)
    elif not isinstance(plan, Plan):
        raise WrapError(f"plan must be an ooc.scheduler.Plan, got {type(plan).__name__}{_plan_hint(plan)}")
    elif budget is not None:
        _warn_if_predicted_over(plan, parse_bytes(budget), include_params)
    planned_for = parse_bytes(budget) if budget is not None and plan is not given_plan else None
    runtime = install(model, chain, plan, backend_obj, owns_backend=not isinstance(backend, Backend),
                      check_recompute=check_recompute)
    if planned_for is not None:
        runtime.budget = (planned_for, include_params)  # NOTE [a plan is for the batch it measured] in ooc.runtime
    return model
