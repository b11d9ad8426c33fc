"""The cost model of ``costmodel.py`` as a mixed-integer program, solved by HiGHS through
``scipy.optimize.milp``: an independent, exact-bytes solver to check the DP against."""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from ooc.scheduler.costmodel import Options


def solve_milp(opts: Options, budget: int, prefetch: int, *, time_limit_s: float = 60.0,
               relax: bool = False) -> tuple[list[int], float] | None:
    """Options per block minimising the model cost with the exact peak <= budget, and that cost.
    ``relax``: the LP relaxation (each block's choice a fraction between options): its cost is a
    lower bound on every plan's (:func:`lower_bound`), its picks (each block's largest fraction)
    need not fit; ``None`` unless HiGHS reached the relaxation's optimum."""
    n, m = opts.n, opts.m
    nx = n * m
    nvar = nx + n  # one choice indicator per (block, option), one exposed copy-back time per block
    x = lambda i, c: i * m + c  # noqa: E731
    e = lambda j: nx + j  # noqa: E731

    objective = np.zeros(nvar)
    for i in range(n):
        for c in range(m):
            objective[x(i, c)] = opts.recompute_s[i, c] + max(0.0, opts.t_out[i, c] - opts.next_forward_s[i])
        objective[e(i)] = 1.0

    rows: list[tuple[dict[int, float], float, float]] = []
    for i in range(n):
        rows.append(({x(i, c): 1.0 for c in range(m)}, 1.0, 1.0))
    # Memory in MiB keeps the coefficients well scaled for the solver; exact in binary fractions.
    scale = 1.0 / 2**20
    cap = budget * scale
    for i in range(n):
        prefix: dict[int, float] = {}
        for j in range(i + 1):
            for c in range(m):
                prefix[x(j, c)] = prefix.get(x(j, c), 0.0) + (opts.A[j, c] - opts.X[j, c]) * scale
        forward = dict(prefix)
        for j in (i - 1, i):
            if j >= 0:
                for c in range(m):
                    forward[x(j, c)] = forward.get(x(j, c), 0.0) + opts.X[j, c] * scale
        rows.append((forward, -np.inf, cap))
        backward = dict(prefix)
        for j in range(max(0, i - prefetch), i + 1):
            for c in range(m):
                backward[x(j, c)] = backward.get(x(j, c), 0.0) + opts.X[j, c] * scale
        for c in range(m):
            backward[x(i, c)] = backward.get(x(i, c), 0.0) + float(opts.backward_extra[i, c]) * scale
        rows.append((backward, -np.inf, cap))
    for j in range(n):
        # e_j >= t_in(j) - sum of the backward compute hiding the copy back
        row = {e(j): 1.0}
        for c in range(m):
            row[x(j, c)] = -opts.t_in[j, c]
        for k in range(j + 1, min(j + prefetch, n - 1) + 1):
            for c in range(m):
                row[x(k, c)] = row.get(x(k, c), 0.0) + opts.comp[k, c]
        rows.append((row, 0.0, np.inf))

    matrix = lil_matrix((len(rows), nvar))
    lower, upper = np.empty(len(rows)), np.empty(len(rows))
    for r, (coeffs, lo, hi) in enumerate(rows):
        for col, value in coeffs.items():
            matrix[r, col] = value
        lower[r], upper[r] = lo, hi
    integrality = np.concatenate([np.zeros(nx) if relax else np.ones(nx), np.zeros(n)])
    allowed = np.ones(nx) if opts.allowed is None else opts.allowed.reshape(nx).astype(float)
    bounds = Bounds(np.zeros(nvar), np.concatenate([allowed, np.full(n, np.inf)]))  # a too-lossy codec: fixed at 0
    result = milp(
        objective,
        constraints=LinearConstraint(matrix.tocsr(), lower, upper),
        integrality=integrality,
        bounds=bounds,
        options={"time_limit": time_limit_s} if relax else {"time_limit": time_limit_s, "mip_rel_gap": 1e-6},
    )
    if result.x is None or (relax and result.status != 0):
        return None  # a relaxation stopped short of its optimum bounds nothing
    picks = [int(np.argmax(result.x[i * m : (i + 1) * m])) for i in range(n)]
    return picks, float(result.fun)


def lower_bound(opts: Options, budget: int, prefetch: int, *, time_limit_s: float = 60.0) -> float | None:
    """A lower bound on the model cost (``costmodel.model_cost``) of every plan over ``opts`` whose
    peak fits ``budget``: the optimum of the MILP's LP relaxation. Every plan is a 0/1 point of
    that LP with its model cost as the objective (the exposed copy-back ``e_j`` at its least is
    ``max(0, t_in - hiding compute)``), so no plan in this option space costs less; ``None`` when
    not even a fractional choice fits, or HiGHS stopped before the optimum (no bound is proven)."""
    result = solve_milp(opts, budget, prefetch, time_limit_s=time_limit_s, relax=True)
    return None if result is None else result[1]
