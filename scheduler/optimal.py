"""``optimal``: a dynamic program over the chain with discretised memory (in the spirit of Rotor and
POFO) that picks one option per block to minimise the additive cost model under the budget, then
polishes the plan against the simulator on short chains.

State after block ``i``: the bucket of ``P_i`` (resident bytes after releases) and, of the last
``max(prefetch, 1)`` blocks, what the forward and backward peak constraints and the copy-back
overlap term read of their options (NOTE [merged states]). A block's transitions are vectorised
over all (state, option) pairs and buckets.

On long chains the memory buckets would be coarser than a block, so there the memory dimension is
dropped: resident bytes get a price, and the price is bisected until the exact peak fits
(Lagrangian relaxation; near-optimal when blocks are small against the budget).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ooc.scheduler.codecs import CODEC_ERROR_BOUND
from ooc.scheduler.costmodel import BASE_OPTIONS, Options, build_options, model_cost, model_peak
from ooc.scheduler.errors import InfeasibleBudget
from ooc.scheduler.hardware import Hardware
from ooc.scheduler.plan import BlockPlan, Plan
from ooc.scheduler.profile import Profile
from ooc.scheduler.simulate import predict
from ooc.scheduler.units import check_budget

_INF = np.inf
_TABLE_BYTES = 64 * 2**20
"""The DP keeps its cost tables for the backtrack up to this many bytes (GPT-2 XL's 48 blocks of
op-level options take 12 MiB), then stores one back-pointer byte per entry instead."""


def _digits(num_states: int, m: int, lags: int) -> np.ndarray:
    """``digits[s, L-1]``: the option of the block ``L`` steps back, encoded newest-last in base m."""
    s = np.arange(num_states)
    return np.stack([(s // m ** (L - 1)) % m for L in range(1, lags + 1)], axis=1)


def _step_tables(opts: Options, i: int, prefetch: int, digits: np.ndarray, budget: float) -> tuple[np.ndarray, np.ndarray]:
    """For block ``i``: the added model cost and the room left for ``P_i`` under the peak
    constraints, per (state of the previous blocks, option of block i): two (M, m) arrays."""
    M, lags = digits.shape
    xlag = np.zeros((M, lags))
    for L in range(1, lags + 1):
        if i - L >= 0:
            xlag[:, L - 1] = opts.X[i - L][digits[:, L - 1]]
    window_x = xlag[:, :prefetch].sum(axis=1)
    f_room = budget - xlag[:, :1] - opts.X[i][None, :]
    m_room = budget - window_x[:, None] - opts.X[i][None, :] - opts.backward_extra[i][None, :]
    add = np.broadcast_to(opts.recompute_s[i] + np.maximum(0.0, opts.t_out[i] - opts.next_forward_s[i]), (M, opts.m)).copy()
    if opts.allowed is not None:
        add[:, ~opts.allowed[i]] = _INF  # a codec too lossy for this block (NOTE [codec error] in ooc.codec_error)
    if prefetch == 0:
        add += opts.t_in[i][None, :]  # copied back on demand, when its own backward starts
    elif i - prefetch >= 0:
        # The copy back of block i-prefetch hides under the backward of blocks i-prefetch+1 .. i.
        tin = opts.t_in[i - prefetch][digits[:, prefetch - 1]]
        between = np.zeros(M)
        for L in range(1, prefetch):
            between += opts.comp[i - L][digits[:, L - 1]]
        add += np.maximum(0.0, tin[:, None] - between[:, None] - opts.comp[i][None, :])
    return add, np.minimum(f_room, m_room)


def _tail_cost(opts: Options, prefetch: int, digits: np.ndarray) -> np.ndarray:
    """Per final state: what the copies back of the last blocks expose (issued as the backward starts)."""
    n = opts.n
    M, lags = digits.shape
    tail = np.zeros(M)
    if prefetch == 0:
        return tail
    for s in range(M):
        picks = {n - L: digits[s, L - 1] for L in range(1, min(lags, n) + 1)}
        for j in range(max(0, n - prefetch), n):
            t = opts.t_in[j, picks[j]]
            if t > 0:
                later = sum(opts.comp[k, picks[k]] for k in range(j + 1, n))
                tail[s] += max(0.0, t - later)
    return tail


# NOTE [merged states]
# The DP's state after block i holds what the rest of the chain reads of the last
# ``max(prefetch, 1)`` blocks' options, and only that: per block, the bytes it moved (``X``: the
# forward and backward peak constraints) and the part of its copy back not yet hidden (its
# ``t_in`` less the backward compute of the blocks after it so far, at least 0: what the copy back
# still exposes). Options with equal such values have the same future, so a state is those values,
# not the option indices: keep, recompute and every selective set that swaps nothing are one state
# (nothing moved, nothing to copy back), and a residual that the compute after it already hides is
# 0 whichever option hid it. On GPT-2 XL's op-level options (16 per block) that is at most 34
# states instead of 16^2 at prefetch 2, 291 instead of 16^3 at prefetch 3. The DP's optimum is the
# option-tuple DP's (tests/scheduler/test_optimal_dp.py holds them equal), since
# ``max(0, max(0, t - a) - b) == max(0, t - a - b)`` for compute ``a, b >= 0``; up to prefetch 2
# it adds the same floats too. Plans of equal cost may tie-break otherwise: of the 18 analytic
# H100 presets x budgets in ``benchmarks/bench_oplevel.py``, one plan (GPT-2 XL flash at 50%)
# differs, in three blocks, at the same peak and the same cost but for the last bit.
# The states are made block by block from the pairs (state, option) the chain reaches, and the
# buckets of memory from the range the chain reaches, so neither is walked where nothing is.


@dataclass(frozen=True)
class _Step:
    """One block's transitions, grouped by the state they lead to: pair ``p`` takes state
    ``source[p]`` of the previous block with option ``option[p]`` (``shift[p]`` buckets more resident,
    ``add[p]`` seconds more, allowed up to bucket ``limit[p]``); the pairs into new state ``t`` are
    ``starts[t]:ends[t]``."""

    source: np.ndarray
    option: np.ndarray
    shift: np.ndarray
    add: np.ndarray
    limit: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    lo: int
    """The bucket of column 0 of this step's cost table."""
    cost: np.ndarray | None
    """(states, buckets) cost table, kept for the backtrack while the tables are small."""
    back: np.ndarray | None
    """Else (states, buckets): ``ends[t] - p`` of the pair that reached each entry first."""


def _pairs(opts: Options, i: int, keys: np.ndarray, prefetch: int, budget: float, unit: float, lo: int,
           top: int) -> tuple[np.ndarray, ...]:
    """Block ``i``'s transitions from the states ``keys`` (S, 2L: the L blocks' X, newest first, then
    their residual copy-back times) whose first bucket ``lo`` can be reached: source, option, shift,
    added cost, bucket limit (at most ``top``) and the new state's key, per pair (NOTE [merged states])."""
    lags = keys.shape[1] // 2
    xs, rs = keys[:, :lags], keys[:, lags:]
    cs = np.flatnonzero(opts.allowed[i]) if opts.allowed is not None else np.arange(opts.m)
    source, option = np.repeat(np.arange(len(keys)), len(cs)), np.tile(cs, len(keys))
    x = opts.X[i, option].astype(np.float64)
    f_room = budget - xs[source, 0] - x
    m_room = budget - xs[:, :prefetch].sum(axis=1)[source] - x - opts.backward_extra[i, option]
    limit = np.minimum(np.floor(np.minimum(f_room, m_room) / unit), top).astype(np.int64)
    # Nearest rounding of each block's resident bytes keeps the error unbiased along the chain;
    # the caller checks the exact peak of the result.
    shift = np.rint((opts.A[i, option] - opts.X[i, option]) / unit).astype(np.int64)
    ok = limit >= shift + lo
    source, option, shift, limit, x = source[ok], option[ok], shift[ok], limit[ok], x[ok]
    add = opts.recompute_s[i, option] + np.maximum(0.0, opts.t_out[i, option] - opts.next_forward_s[i])
    if prefetch == 0:
        add = add + opts.t_in[i, option]  # copied back on demand, when its own backward starts
    elif i - prefetch >= 0:
        # The copy back of block i-prefetch hides under the backward of blocks i-prefetch+1 .. i.
        add = add + np.maximum(0.0, rs[source, lags - 1] - opts.comp[i, option])
    newest = opts.t_in[i, option] if prefetch else np.zeros(len(x))  # without prefetch nothing waits to be hidden
    hidden = np.maximum(0.0, rs[source, :-1] - opts.comp[i, option][:, None])
    new_keys = np.concatenate([x[:, None], xs[source, :-1], newest[:, None], hidden], axis=1)
    return source, option, shift, add, limit, new_keys


def _merge_states(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pairs' new states, merged (NOTE [merged states]): for ``keys`` (pairs, k), the order that
    sorts them by key, rows in their given order among equal keys (so ties keep the per-option
    DP's order), and per distinct key the range ``starts[t]:ends[t]`` of that order holding it."""
    order = np.lexsort(keys.T[::-1])
    ordered = keys[order]
    starts = np.flatnonzero(np.r_[True, (ordered[1:] != ordered[:-1]).any(axis=1)])
    return order, starts, np.r_[starts[1:], len(order)]


def _relax(cost: np.ndarray, lo: int, shift: np.ndarray, add: np.ndarray, limit: np.ndarray, source: np.ndarray,
           starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The candidates ``cand`` (pairs, buckets): the source's cost ``shift`` buckets on, plus ``add``,
    infinite past ``limit``; the new table (states, buckets), each state's least candidate; and the
    new table's first bucket."""
    states, width = cost.shape
    new_lo = lo + int(shift.min())
    new_width = int(min(limit.max(), lo + width - 1 + shift.max())) - new_lo + 1
    offset = new_lo - shift - lo  # column of the source table that lands in new column 0
    left, right = max(0, -int(offset.min())), max(0, int(offset.max()) + new_width - width)
    padded = np.full((states, left + width + right), _INF)
    padded[:, left : left + width] = cost
    cand = sliding_window_view(padded, new_width, axis=1)[source, offset + left]
    cand += add[:, None]
    first_cut = max(0, int(limit.min()) + 1 - new_lo)  # no pair is cut before this column
    if first_cut < new_width:
        columns = np.arange(new_lo + first_cut, new_lo + new_width)
        np.putmask(cand[:, first_cut:], columns[None, :] > limit[:, None], _INF)
    new = np.empty((len(starts), new_width))
    for t, (a, b) in enumerate(zip(starts, ends)):
        new[t] = cand[a:b].min(axis=0)
    return cand, new, new_lo


def _back(cand: np.ndarray, new: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per new state and bucket, ``ends[t] - p`` for the first pair ``p`` of its group whose candidate
    is the least (so ties go to the earliest pair, as the per-option DP broke them)."""
    sizes = ends - starts
    dtype = np.min_scalar_type(int(sizes.max()))
    target = np.repeat(np.arange(len(starts)), sizes)
    marked = (cand == new[target]) * (ends[target] - np.arange(len(cand))).astype(dtype)[:, None]
    back = np.empty(new.shape, dtype)
    for t, (a, b) in enumerate(zip(starts, ends)):
        back[t] = marked[a:b].max(axis=0)
    return back


def _pick(step: _Step, previous: _Step | None, t: int, q: int) -> int:
    """The pair of ``step`` that reached state ``t`` at bucket ``q`` first."""
    if step.back is not None:
        return int(step.ends[t]) - int(step.back[t, q - step.lo])
    target = step.cost[t, q - step.lo]
    before, before_lo = (previous.cost, previous.lo) if previous is not None else (np.zeros((1, 1)), 0)
    for p in range(int(step.starts[t]), int(step.ends[t])):
        col = q - int(step.shift[p]) - before_lo
        if q <= step.limit[p] and 0 <= col < before.shape[1] and before[step.source[p], col] + step.add[p] == target:
            return p
    raise RuntimeError(f"the DP's backtrack found no pair into state {t} at bucket {q}: "
                       "a bug in ooc.scheduler.optimal, please report it")


def solve_dp(opts: Options, budget: int, prefetch: int, buckets: int, *,
             table_bytes: int = _TABLE_BYTES) -> list[int] | None:
    """Options per block minimising the model cost with the discretised peak <= budget; None if none.
    Over merged states (NOTE [merged states]); the cost tables are kept for the backtrack up to
    ``table_bytes``, then each block stores which pair reached each entry instead (1 byte each)."""
    n = opts.n
    lags = max(prefetch, 1)
    unit = budget / buckets if budget > 0 else 1.0
    keys = np.zeros((1, 2 * lags))  # before block 0: no bytes moved, nothing to copy back
    cost, lo, kept = np.zeros((1, 1)), 0, 0
    steps: list[_Step] = []
    for i in range(n):
        source, option, shift, add, limit, new_keys = _pairs(opts, i, keys, prefetch, budget, unit, lo, buckets)
        if len(source) == 0:
            return None
        order, starts, ends = _merge_states(new_keys)
        new_keys = new_keys[order]
        source, option, shift, add, limit = source[order], option[order], shift[order], add[order], limit[order]
        cand, cost, lo = _relax(cost, lo, shift, add, limit, source, starts, ends)
        keep_table = kept + cost.nbytes <= table_bytes and (not steps or steps[-1].cost is not None)
        kept += cost.nbytes if keep_table else 0
        steps.append(_Step(source, option, shift, add, limit, starts, ends, lo, cost if keep_table else None,
                           None if keep_table else _back(cand, cost, starts, ends)))
        keys = new_keys[starts]
    # What the copies back of the last blocks expose, issued as the backward starts: their residuals.
    tail = keys[:, lags:].sum(axis=1) if prefetch else np.zeros(len(keys))
    final = cost + tail[:, None]
    q, t = np.unravel_index(int(np.argmin(final.T)), final.T.shape)  # the least bucket, then state, of the least cost
    if not np.isfinite(final[t, q]):
        return None
    q += lo
    picks = [0] * n
    for i in range(n - 1, -1, -1):
        p = _pick(steps[i], steps[i - 1] if i else None, int(t), int(q))
        picks[i], t, q = int(steps[i].option[p]), int(steps[i].source[p]), q - int(steps[i].shift[p])
    return picks


def _cost_tables(opts: Options, prefetch: int) -> tuple[np.ndarray, np.ndarray]:
    """All blocks' added-cost tables, (n, M, m), and the final states' tail costs, (M,)."""
    lags = max(prefetch, 1)
    digits = _digits(opts.m**lags, opts.m, lags)
    adds = np.stack([_step_tables(opts, i, prefetch, digits, 0.0)[0] for i in range(opts.n)])
    return adds, _tail_cost(opts, prefetch, digits)


def solve_lagrange(opts: Options, price: float, prefetch: int, tables: tuple[np.ndarray, np.ndarray] | None = None) -> list[int]:
    """Options minimising model cost + ``price`` x resident bytes, with no memory state: the DP for
    long chains, where the budget is met by bisecting the price (``optimal`` does)."""
    n, m = opts.n, opts.m
    lags = max(prefetch, 1)
    M = m**lags
    rows = M // m
    adds, tail = tables if tables is not None else _cost_tables(opts, prefetch)
    cost = np.full(M, _INF)
    cost[0] = 0.0
    back = np.zeros((n, M), dtype=np.int16)
    resident = (opts.A - opts.X) * price
    for i in range(n):
        cand = cost[:, None] + adds[i] + resident[i][None, :]  # (M, m)
        grouped = cand.reshape(m, rows, m)  # [oldest, rest, c]
        best_old = np.argmin(grouped, axis=0)  # (rows, m)
        best = grouped.min(axis=0)  # the values at best_old (cheaper than gathering them)
        cost = best.reshape(M)  # target state rest*m + c
        back[i] = best_old.reshape(M)
    s = int(np.argmin(cost + tail))
    picks = [0] * n
    for i in range(n - 1, -1, -1):
        picks[i] = s % m
        s = int(back[i, s]) * rows + s // m
    return picks


def _lagrange_plan(opts: Options, budget: int, prefetch: int) -> list[int] | None:
    """The cheapest price whose plan fits the budget, by bisection on a log scale."""
    tables = _cost_tables(opts, prefetch)
    scale = max(1e-30, float(opts.recompute_s.max() + opts.t_in.max() + opts.t_out.max())) / max(1.0, float(opts.A.max()))
    lo, hi = 0.0, scale
    picks = solve_lagrange(opts, 0.0, prefetch, tables)
    if model_peak(opts, picks, prefetch) <= budget:
        return picks
    best = None
    for _ in range(30):  # find a price high enough
        picks = solve_lagrange(opts, hi, prefetch, tables)
        if model_peak(opts, picks, prefetch) <= budget:
            best = picks
            break
        lo, hi = hi, hi * 8
    if best is None:
        return None
    cheaper = solve_lagrange(opts, lo, prefetch, tables)
    for _ in range(16):  # the price to 2^-16 of its bracket: the plan stops changing well before
        mid = (lo + hi) / 2
        picks = solve_lagrange(opts, mid, prefetch, tables)
        if model_peak(opts, picks, prefetch) <= budget:
            hi, best = mid, picks
        else:
            lo, cheaper = mid, picks
    return _repair(opts, best, cheaper, budget, prefetch)


def _repair(opts: Options, feasible: list[int], cheaper: list[int], budget: int, prefetch: int) -> list[int]:
    """Close the Lagrangian gap: identical blocks tie at the critical price, so the feasible plan
    may give up more than it must. Move blocks to the cheaper (over-budget) plan's choice, most time
    saved per resident byte first, while the exact peak still fits."""
    picks = list(feasible)
    idx = np.arange(opts.n)
    f, c = np.asarray(feasible), np.asarray(cheaper)
    saved_s = opts.recompute_s[idx, f] - opts.recompute_s[idx, c] + np.maximum(0, opts.t_in[idx, f] - opts.t_in[idx, c])
    extra_bytes = (opts.A[idx, c] - opts.X[idx, c]) - (opts.A[idx, f] - opts.X[idx, f])
    candidates = [i for i in range(opts.n) if f[i] != c[i] and saved_s[i] > 0]
    candidates.sort(key=lambda i: -saved_s[i] / max(1, extra_bytes[i]))
    for i in candidates:
        picks[i] = int(c[i])
        if model_peak(opts, picks, prefetch) > budget:
            picks[i] = int(f[i])
    return picks


def _polish(plan: Plan, opts: Options, profile: Profile, hardware: Hardware, budget: int, deadline: float) -> Plan:
    """First-improvement local search over single-block changes, judged by the simulator. Only
    changes that fit (``model_peak``: the schedule's peak, in numpy) and that the additive model
    rates no worse than the current plan reach the simulator: the search settles the additive
    model's ties and near-ties by the simulator, it is not a second search of the whole space (that
    made ``optimal`` spend its whole 2 s polishing 48 blocks, 10x the MILP's time)."""
    picks = opts.picks_of(plan)
    best_time = predict(plan, profile, hardware).step_time_s
    cost = model_cost(opts, picks, plan.prefetch)
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for i in range(len(picks)):
            for k in range(opts.m):
                if k == picks[i] or not opts.allows(i, k) or time.perf_counter() >= deadline:
                    continue
                choice = opts.choice(i, k)
                trial_picks = picks[:i] + [k] + picks[i + 1 :]
                if model_peak(opts, trial_picks, plan.prefetch) > budget:
                    continue
                trial_cost = model_cost(opts, trial_picks, plan.prefetch)
                if trial_cost > cost:
                    continue
                trial = plan.with_(blocks=plan.blocks[:i] + (choice,) + plan.blocks[i + 1 :])
                t = predict(trial, profile, hardware).step_time_s
                if t < best_time * (1 - 1e-9):
                    plan, picks, best_time, cost, improved = trial, trial_picks, t, trial_cost, True
    return plan


def solve_options(opts: Options, budget: int, prefetch: int, exact_blocks: int) -> list[int] | None:
    """``optimal``'s search over given options, before it polishes the plan: options per block
    whose exact peak fits ``budget`` at the least model cost found (:func:`_solve_all`), or None.
    A column no block is allowed (a selective slot no block fills, a codec too lossy everywhere)
    only widens the Lagrangian DP's state (``m`` options of ``max(prefetch, 1)`` blocks), so it is
    left out and the picks mapped back."""
    if opts.allowed is None or opts.allowed.any(axis=0).all():
        return _solve_all(opts, budget, prefetch, exact_blocks)
    cols = np.flatnonzero(opts.allowed.any(axis=0))
    sub = replace(opts, A=opts.A[:, cols], X=opts.X[:, cols], Rc=opts.Rc[:, cols], D=opts.D[:, cols], T=opts.T[:, cols],
                  recompute_s=opts.recompute_s[:, cols], t_out=opts.t_out[:, cols], t_in=opts.t_in[:, cols],
                  comp=opts.comp[:, cols], allowed=opts.allowed[:, cols], selective=None)
    picks = _solve_all(sub, budget, prefetch, exact_blocks)
    return None if picks is None else [int(cols[k]) for k in picks]


def _solve_all(opts: Options, budget: int, prefetch: int, exact_blocks: int) -> list[int] | None:
    """Options whose exact peak fits ``budget`` at the least model cost found, or None.

    NOTE [bucketed budget]
    The DP rounds each block's resident bytes to a bucket (nearest, so the error is unbiased), so
    its peak is off by up to about ``sqrt(n)`` buckets either way: a plan it accepts may exceed the
    budget, and one that fits may look over it (the cheapest, often: it fills the budget). So the
    first try aims a little above the budget (half of ``sqrt(n)`` buckets); while the plan found
    does not fit, the target drops by the overshoot and a step that doubles each time (so the
    tries end quickly even when rounding pushes back); once one fits, two bisections between the
    last target that did not fit and the one that did look for a cheaper plan that still fits (the
    cheapest fitting plan of all tries is the answer). When none fits (or the DP sees no plan
    under a tightened target), the Lagrangian plan, which meets the exact peak, is the answer."""
    n = opts.n
    if n > exact_blocks:
        return _lagrange_plan(opts, budget, prefetch)
    buckets = min(2048, max(256, 16 * n))
    unit = budget / buckets if budget > 0 else 1.0

    def attempt(target: int) -> tuple[list[int] | None, bool]:
        picks = solve_dp(opts, target, prefetch, buckets)
        return picks, picks is not None and model_peak(opts, picks, prefetch) <= budget

    slack = unit * np.sqrt(n) / 2  # about the rounding error of a peak summed over n blocks
    target, step, missed = budget + int(slack), slack, None
    for _ in range(8):
        picks, fits = attempt(target)
        if picks is None:
            break
        if fits:
            if missed is None:
                return picks
            best, cost = picks, model_cost(opts, picks, prefetch)
            under, over = target, missed
            for _ in range(2):
                mid = (under + over) // 2
                picks, fits = attempt(mid)
                if not fits:
                    over = mid
                    continue
                under, trial = mid, model_cost(opts, picks, prefetch)
                if trial < cost:
                    best, cost = picks, trial
            return best
        missed = target
        target -= (model_peak(opts, picks, prefetch) - budget) + int(step)
        step *= 2
    return _lagrange_plan(opts, budget, prefetch)


def optimal(
    profile: Profile,
    hardware: Hardware,
    budget: int | None = None,
    *,
    prefetch: int = 2,
    choices: tuple[BlockPlan, ...] = BASE_OPTIONS,
    polish_blocks: int = 48,
    polish_seconds: float = 2.0,
    exact_blocks: int = 200,
    max_codec_error: float = CODEC_ERROR_BOUND,
    selective: int = 0,
    selective_swaps: int = 2,
    name: str = "optimal",
) -> Plan:
    """The fastest plan the cost model finds whose peak fits ``budget``, choosing per block among
    ``choices`` (keep, swap, recompute, recompute + swap input; with ``CODEC_OPTIONS``, compressed
    swaps too, but never a codec whose measured gradient error on the block exceeds
    ``max_codec_error``); ``PLANNERS["optimal"]``.

    Chains of up to ``exact_blocks`` get the DP over discretised memory (then a local search
    against the simulator up to ``polish_blocks``); longer chains the Lagrangian DP. ``selective``:
    up to that many selective-recompute options per block with an op-level profile, and as many
    with the input swapped (``PLANNERS["op-level"]``, NOTE [op-level options] in
    ``ooc.scheduler.oplevel``), and up to ``selective_swaps`` of those with some cached outputs
    swapped (NOTE [window swaps]). Raises :class:`InfeasibleBudget` when no plan fits."""
    check_budget(budget)
    opts = build_options(profile, hardware, choices, max_codec_error, selective=selective, selective_swaps=selective_swaps)
    kw = dict(prefetch=prefetch, min_swap_bytes=profile.min_swap_bytes, name=name)
    if budget is None:
        return opts.plan([0] * opts.n, **kw)
    picks = solve_options(opts, budget, prefetch, exact_blocks)
    if picks is None:
        # A selective option holds at least what its plain RECOMPUTE holds at every point of the
        # step, so the least peak is the block-level options' (a smaller search).
        least = opts if not selective else build_options(profile, hardware, choices, max_codec_error)
        raise InfeasibleBudget(budget, minimum_peak(least, prefetch, exact_blocks))
    plan = opts.plan(picks, **kw)
    if opts.n <= polish_blocks:
        plan = _polish(plan, opts, profile, hardware, budget, time.perf_counter() + polish_seconds)
    return plan


def minimum_peak(opts: Options, prefetch: int, exact_blocks: int = 200) -> int:
    """The smallest budget ``optimal`` can meet: a bisection over budgets with the planner's own
    solver, so a budget equal to this minimum is always accepted."""
    lo, hi = 0, model_peak(opts, [0] * opts.n, prefetch)
    while lo < hi:
        mid = (lo + hi) // 2
        if solve_options(opts, mid, prefetch, exact_blocks) is not None:
            hi = mid
        else:
            lo = mid + 1
    return hi
