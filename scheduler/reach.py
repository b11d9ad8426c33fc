"""How far any plan of per-tensor keep/swap/recompute can go on a profile: a lower bound on its step
time that no planner's restrictions shape (issue 15's option space, with swaps in any window).

NOTE [any plan's reach]
``milp.lower_bound`` bounds the plans over the options the planners generate; a goal below it may
still be reachable by options they do not offer (a cached output swapped over a longer window than
the next block's forward, NOTE [window swaps]). This bound covers every plan that, for each block,
keeps its saved tensors (KEEP), or re-runs its forward in the backward with any subset of its
cacheable op outputs held from the forward (RECOMPUTE with ``cached_ops``; its re-run leaves out
what the cache makes dead, NOTE [ops a re-run skips]), and that swaps ANY held bytes to the host,
in any window, whatever their size. It relaxes that set so that it is a linear program:

- memory: at the end of the forward every block holds what its choice holds (``block_bytes``: the
  saved bytes for KEEP, the input and the cached outputs for RECOMPUTE; less the storages it shares
  with other blocks, NOTE [storages shared between blocks], which another may count), less the bytes
  swapped out by then, ``X``; the schedule's peak is at least that, so it must fit the budget;
- link: ``X`` went out during the forward at ``hw.d2h`` and comes back during the backward at
  ``hw.h2d``; each phase lasts its compute (the profile's forwards and backwards and the time
  outside the chain, plus the backward's re-runs), and a plan may stall it to give the link more
  time (``stall_f``, ``stall_b``), each second of stall a second of step;
- time: the step is at least the compute of keep-all with unlimited memory (forwards, backwards,
  the time outside the chain) plus the re-runs (``selective_rerun_s`` without the per-op interception cost, which only adds) plus the
  stalls; nothing else a plan pays (a copy's latency, a block held twice at its backward) counts;
- each block takes a convex combination of its choices (the LP relaxation of picking one), blocks
  with the same choices as one variable group.
Every such plan is a feasible point with its cost at least the objective, so none costs less.
Exact in the choices: a block's cached subsets are enumerated (``2 ** k`` for ``k`` cacheable ops
with outputs; ``None`` above ``max_candidates``).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
from scipy.optimize import linprog

from ooc.scheduler.hardware import Hardware
from ooc.scheduler.plan import BlockPlan
from ooc.scheduler.profile import BlockProfile, Profile
from ooc.scheduler.schedule import block_bytes, selective_rerun_s

MAX_CANDIDATES = 16
"""Cacheable ops with outputs a block may have for its subsets to be enumerated (65,536)."""


def block_choices(block: BlockProfile, max_candidates: int = MAX_CANDIDATES) -> list[tuple[int, float]] | None:
    """``(bytes held at the end of the forward, re-run seconds)`` of every choice of one block:
    KEEP, and RECOMPUTE with each subset of its cacheable ops that have outputs (the empty subset:
    a plain re-run). ``None`` without op-level detail or with more than ``max_candidates`` such ops."""
    if not block.ops:
        return None
    candidates = [k for k, op in enumerate(block.ops) if op.cacheable and op.output_bytes > 0]
    if len(candidates) > max_candidates:
        return None
    # A storage other blocks hold too may be counted by one of them instead (NOTE [storages shared
    # between blocks]): taken off every holder here, which only lowers the bound.
    shared = sum(s.nbytes for s in block.shared)
    choices = [(max(0, block_bytes(BlockPlan("keep"), block).forward_alloc - shared), 0.0)]
    for size in range(len(candidates) + 1):
        for cached in itertools.combinations(candidates, size):
            plan = BlockPlan("recompute", cached_ops=cached)
            choices.append((max(0, block_bytes(plan, block).forward_alloc - shared), selective_rerun_s(plan, block, None)))
    return choices


def any_plan_step_bound(prof: Profile, hw: Hardware, budget: int, *, max_candidates: int = MAX_CANDIDATES) -> float | None:
    """Seconds of a step that every per-tensor keep/swap/recompute plan of ``prof`` whose saved
    activations at the end of the forward fit ``budget`` bytes takes at least, with swaps in any
    window (NOTE [any plan's reach]): the forwards, backwards and time outside the chain, plus the
    least re-run and stall time the relaxation allows. ``None`` when a block has no op-level
    detail or too many cacheable ops to enumerate, or no choice fits even fractionally."""
    alike: dict[BlockProfile, int] = {}  # a chain's blocks mostly differ in their names alone
    for block in prof.blocks:
        unnamed = replace(block, name="")
        alike[unnamed] = alike.get(unnamed, 0) + 1
    groups: dict[tuple[tuple[int, float], ...], int] = {}
    for block, count in alike.items():
        choices = block_choices(block, max_candidates)
        if choices is None:
            return None
        key = tuple(choices)
        groups[key] = groups.get(key, 0) + count
    forward_s = sum(b.forward_s for b in prof.blocks) + prof.outside_forward_s
    backward_s = sum(b.backward_s for b in prof.blocks) + prof.outside_backward_s
    # Variables: each group's choice weights (summing to the group's block count), then X (bytes
    # swapped), stall_f, stall_b.
    cost: list[float] = []
    held: list[float] = []
    rerun: list[float] = []
    rows_eq: list[tuple[int, int, int]] = []
    for choices, count in groups.items():
        start = len(cost)
        for nbytes, seconds in choices:
            cost.append(seconds)
            held.append(float(nbytes))
            rerun.append(seconds)
        rows_eq.append((start, len(cost), count))
    n = len(cost)
    x, stall_f, stall_b = n, n + 1, n + 2
    c = np.zeros(n + 3)
    c[:n] = cost
    c[stall_f] = c[stall_b] = 1.0
    a_ub = np.zeros((3, n + 3))
    b_ub = np.zeros(3)
    a_ub[0, :n], a_ub[0, x], b_ub[0] = held, -1.0, budget  # held - swapped fits the budget
    a_ub[1, x], a_ub[1, stall_f], b_ub[1] = 1.0, -hw.d2h, hw.d2h * forward_s  # out during the forward
    # back during the backward, which the re-runs lengthen
    a_ub[2, :n], a_ub[2, x], a_ub[2, stall_b], b_ub[2] = [-hw.h2d * s for s in rerun], 1.0, -hw.h2d, hw.h2d * backward_s
    a_eq = np.zeros((len(rows_eq), n + 3))
    b_eq = np.zeros(len(rows_eq))
    for row, (start, stop, count) in enumerate(rows_eq):
        a_eq[row, start:stop] = 1.0
        b_eq[row] = count
    result = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=[(0, None)] * (n + 3), method="highs")
    return forward_s + backward_s + float(result.fun) if result.status == 0 else None
