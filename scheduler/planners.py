"""Planners: pure functions ``(profile, hardware, budget) -> Plan``."""

from __future__ import annotations

import math
from dataclasses import replace

from ooc.scheduler.costmodel import build_options, model_peak
from ooc.scheduler.errors import InfeasibleBudget
from ooc.scheduler.hardware import Hardware
from ooc.scheduler.optimal import optimal
from ooc.scheduler.plan import Plan, Policy
from ooc.scheduler.profile import Profile
from ooc.scheduler.schedule import build_schedule, cached_ops_cost, swapped_ops_bytes
from ooc.scheduler.units import check_budget


def annotate(plan: Plan, profile: Profile) -> Plan:
    """Fill each block's expected saved and device bytes from the profile (shown in the plan table),
    and a selective block's ``op_signature`` (the profiled forward its op indices refer to)."""
    schedule = build_schedule(plan, profile)
    blocks = []
    for decision, prof in zip(plan.blocks, profile.blocks):
        if decision.policy is Policy.KEEP:
            on_device = prof.saved_bytes
        elif decision.policy is Policy.SWAP:
            on_device = prof.saved_bytes - prof.swappable_bytes
        else:
            on_device = prof.input_bytes - (prof.input_swappable_bytes if decision.swap_input else 0)
            if decision.cached_ops:
                on_device += cached_ops_cost(decision, prof)[0]
            # Swapped cached outputs are on the host between release and copy-back, like a swapped input.
            on_device -= swapped_ops_bytes(decision, prof)[0]
        signature = prof.op_signature if decision.cached_ops else None
        blocks.append(replace(decision, saved_bytes=prof.saved_bytes, device_bytes=on_device,
                              op_signature=signature or decision.op_signature))
    meta = [("predicted_peak_bytes", schedule.peak_bytes)]
    if any(b.streamed for b in plan.blocks):
        meta.append(("predicted_param_peak_bytes", schedule.param_peak_bytes))
    return plan.with_(blocks=tuple(blocks), meta=tuple(meta))


def keep_all(profile: Profile, hardware: Hardware | None = None, budget: int | None = None, *, prefetch: int = 2) -> Plan:
    return Plan.uniform(Policy.KEEP, len(profile), prefetch=prefetch, min_swap_bytes=profile.min_swap_bytes)


def recompute_all(profile: Profile, hardware: Hardware | None = None, budget: int | None = None, *, prefetch: int = 2) -> Plan:
    return Plan.uniform(Policy.RECOMPUTE, len(profile), prefetch=prefetch, min_swap_bytes=profile.min_swap_bytes)


def swap_all(profile: Profile, hardware: Hardware | None = None, budget: int | None = None, *, prefetch: int = 2) -> Plan:
    """vDNN-style: every block swaps, with ``prefetch`` blocks copied back ahead."""
    return Plan.uniform(Policy.SWAP, len(profile), prefetch=prefetch, min_swap_bytes=profile.min_swap_bytes)


def sqrt_checkpoint(profile: Profile, hardware: Hardware | None = None, budget: int | None = None, *, prefetch: int = 2) -> Plan:
    """``checkpoint_sequential`` with sqrt(n) segments: the last segment runs plainly, the rest recompute."""
    n = len(profile)
    kept = max(1, math.ceil(n / max(1, round(math.sqrt(n)))))
    policies = [Policy.RECOMPUTE] * (n - kept) + [Policy.KEEP] * kept
    return Plan.of(policies, prefetch=prefetch, min_swap_bytes=profile.min_swap_bytes, name="sqrt-checkpoint")


def greedy(profile: Profile, hardware: Hardware | None = None, budget: int | None = None, *, prefetch: int = 2) -> Plan:
    """Keep what fits: swap blocks from the first on (their copies have the most compute to hide
    under), then recompute from the first on, then also swap recomputed inputs; the first plan of
    that sequence whose peak fits the budget."""
    check_budget(budget)
    n = len(profile)
    kw = dict(prefetch=prefetch, min_swap_bytes=profile.min_swap_bytes, name="greedy")
    opts = build_options(profile, None)  # peaks only: model_peak is the schedule's peak, in O(n) numpy
    KEEP, SWAP, RECOMPUTE, RECOMPUTE_SWAP_INPUT = range(4)
    candidates = [[KEEP] * n]
    for first, rest in ((SWAP, KEEP), (RECOMPUTE, SWAP), (RECOMPUTE_SWAP_INPUT, RECOMPUTE)):
        candidates += [[first] * k + [rest] * (n - k) for k in range(1, n + 1)]
    if budget is None:
        return opts.plan(candidates[0], **kw)
    least = None
    for picks in candidates:
        peak = model_peak(opts, picks, prefetch)
        if peak <= budget:
            return opts.plan(picks, **kw)
        least = peak if least is None else min(least, peak)
    raise InfeasibleBudget(budget, least)


def karma(profile: Profile, hardware: Hardware, budget: int | None = None, *, prefetch: int = 2) -> Plan:
    """KARMA's capacity-based rule: walking from the first block (whose copies have the most compute
    to hide under), swap a block where its copies hide under the compute of the prefetch window, and
    recompute it where the exposed transfer would cost more than recomputing; stop once the peak fits.
    """
    check_budget(budget)
    opts = build_options(profile, hardware)
    n = opts.n
    KEEP, SWAP, RECOMPUTE, RECOMPUTE_SWAP_INPUT = range(4)
    picks = [KEEP] * n
    kw = dict(prefetch=prefetch, min_swap_bytes=profile.min_swap_bytes, name="karma")
    if budget is None or model_peak(opts, picks, prefetch) <= budget:
        return opts.plan(picks, **kw)
    for i in range(n):
        hidden_under = float(opts.comp[i + 1 : i + prefetch + 1, KEEP].sum())
        swap_cost = max(0.0, opts.t_out[i, SWAP] - opts.next_forward_s[i]) + max(0.0, opts.t_in[i, SWAP] - hidden_under)
        picks[i] = SWAP if swap_cost <= opts.recompute_s[i, RECOMPUTE] else RECOMPUTE
        if model_peak(opts, picks, prefetch) <= budget:
            return opts.plan(picks, **kw)
    for i in range(n):  # still over: keep only inputs, and move those to the host too
        picks[i] = RECOMPUTE_SWAP_INPUT
        if model_peak(opts, picks, prefetch) <= budget:
            return opts.plan(picks, **kw)
    return opts.plan(picks, **kw)


def op_level(profile: Profile, hardware: Hardware, budget: int | None = None, *, prefetch: int = 2,
             options_per_block: int = 4, swapped_per_block: int = 2) -> Plan:
    """``optimal`` with each block's selective-recompute options besides keep/swap/recompute: per
    block up to ``options_per_block`` Pareto-optimal sets of op outputs to cache (the re-run skips
    those ops), with and without the input swapped (NOTE [op-level options] in
    ``ooc.scheduler.oplevel``), and up to ``swapped_per_block`` of those with the cached outputs
    that the link hides under the next block's forward swapped to the host (NOTE [window swaps]).
    On a profile without op-level detail it is ``optimal``."""
    return optimal(profile, hardware, budget, prefetch=prefetch, selective=options_per_block,
                   selective_swaps=swapped_per_block, name="op-level")


PLANNERS = {
    "keep-all": keep_all,
    "recompute-all": recompute_all,
    "swap-all": swap_all,
    "sqrt-checkpoint": sqrt_checkpoint,
    "greedy": greedy,
    "karma": karma,
    "optimal": optimal,
    "op-level": op_level,
}
