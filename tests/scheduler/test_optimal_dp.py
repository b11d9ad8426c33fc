"""The ``optimal`` DP over merged states (NOTE [merged states] in ``ooc.scheduler.optimal``): the
same optimum as the DP whose state is the tuple of the last blocks' options, the MILP's optimum where
the buckets are exact, and the memory it keeps."""

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from ooc.scheduler import BlockPlan, Plan, Profile, build_schedule, preset
from ooc.scheduler import optimal as optimal_module
from ooc.scheduler.costmodel import Options, build_options, model_cost
from ooc.scheduler.milp import solve_milp
from ooc.scheduler.optimal import _digits, _merge_states, _pairs, _relax, _step_tables, _tail_cost, solve_dp

MiB = 2**20
GPT2 = Path(__file__).resolve().parents[2] / "profiles" / "analytic-h100-sxm-gpt2-xl-s1024.json"


def _random_options(rng: np.random.Generator, n: int, m: int, *, bytes_unit: int = 1) -> Options:
    """``m`` options per block drawn so that many move nothing (X = 0) or the same bytes (the states
    the DP merges), with copy times from the bytes, compute >= 0, some options not allowed, and every
    byte count a multiple of ``bytes_unit``."""
    sizes = rng.integers(1, 40, size=(n, 1)) * MiB
    X = rng.choice([0, 0, 1, 2], size=(n, m)) * sizes // 2
    A = X + rng.integers(0, 30, size=(n, m)) * MiB // 4
    Rc = rng.integers(0, 20, size=(n, m)) * MiB // 2
    A, X, Rc = (v // bytes_unit * bytes_unit for v in (A, X, Rc))
    t_in = X / 4e10
    rec = np.where(rng.random((n, m)) < 0.5, 0.0, rng.uniform(0, 3e-4, size=(n, m)))
    comp = rng.uniform(1e-4, 6e-4, size=(n, 1)) + rec
    allowed = rng.random((n, m)) < 0.8
    allowed[:, 0] = True
    zeros = np.zeros((n, m), dtype=np.int64)
    return Options(tuple(BlockPlan("keep") for _ in range(m)), A, X, Rc, zeros, zeros, rec, t_in.copy(), t_in, comp,
                   rng.uniform(1e-4, 6e-4, size=n), allowed)


def _tuple_dp(opts: Options, budget: int, prefetch: int, buckets: int) -> float | None:
    """The optimum of the DP whose state is the tuple of the last ``max(prefetch, 1)`` blocks' options
    (the DP before NOTE [merged states]): m^lags states per bucket, the spec the merged DP must meet."""
    lags = max(prefetch, 1)
    M = opts.m**lags
    digits = _digits(M, opts.m, lags)
    unit = budget / buckets
    Q = buckets + 1
    delta = np.rint((opts.A - opts.X) / unit).astype(np.int64)
    cost = np.full((Q, M), np.inf)
    cost[0, 0] = 0.0
    qs = np.arange(Q)[:, None]
    for i in range(opts.n):
        add, room = _step_tables(opts, i, prefetch, digits, budget)
        limit = np.floor(room / unit)
        new = np.full((Q, M), np.inf)
        for c in range(opts.m):
            cand = np.full((Q, M), np.inf)
            d = int(delta[i, c])
            if d < Q:
                cand[d:] = cost[: Q - d] + add[None, :, c]
            cand[qs > limit[None, :, c]] = np.inf
            targets = np.arange(M // opts.m) * opts.m + c
            new[:, targets] = np.minimum(new[:, targets], cand.reshape(Q, opts.m, M // opts.m).min(axis=1))
        cost = new
    best = float((cost + _tail_cost(opts, prefetch, digits)[None, :]).min())
    return best if np.isfinite(best) else None


def _fits_buckets(opts: Options, picks: list[int], budget: int, prefetch: int, buckets: int) -> bool:
    """Whether ``picks`` meet the DP's constraints: each block's resident buckets within the room the
    peak constraints leave it (``costmodel``'s F_i and M_i, in buckets of ``budget / buckets``)."""
    unit = budget / buckets
    idx = np.arange(opts.n)
    X = opts.X[idx, picks].astype(float)
    q = np.cumsum(np.rint((opts.A[idx, picks] - opts.X[idx, picks]) / unit))
    for i in range(opts.n):
        previous = X[i - 1] if i else 0.0
        window = X[max(0, i - prefetch) : i].sum()
        room = min(budget - previous - X[i], budget - window - X[i] - opts.backward_extra[i, picks[i]])
        if q[i] > np.floor(room / unit):
            return False
    return True


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_merged_states_reach_the_option_tuple_dps_optimum(prefetch, seed):
    rng = np.random.default_rng(seed)
    opts = _random_options(rng, 7, 5 if prefetch == 3 else 6)
    keep = int(opts.A[:, 0].sum())
    for fraction in np.geomspace(1.0, 0.04, 16):  # down to where nothing fits: the tight budgets bind every limit
        budget, buckets = int(keep * fraction), 64
        expected = _tuple_dp(opts, budget, prefetch, buckets)
        picks = solve_dp(opts, budget, prefetch, buckets)
        assert (picks is None) == (expected is None)
        if picks is None:
            continue
        assert all(opts.allows(i, k) for i, k in enumerate(picks))
        assert _fits_buckets(opts, picks, budget, prefetch, buckets)
        assert model_cost(opts, picks, prefetch) == pytest.approx(expected, rel=1e-9, abs=1e-15)
        # Backtracking through 1-byte back pointers instead of the kept tables finds the same plan.
        assert solve_dp(opts, budget, prefetch, buckets, table_bytes=0) == picks


@pytest.mark.parametrize("prefetch", [1, 2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_dp_equals_the_milp_where_the_buckets_are_exact(prefetch, seed):
    """Every byte count a multiple of the bucket: rounding loses nothing, so the DP's optimum is the
    MILP's (which HiGHS proves to 1e-6)."""
    rng = np.random.default_rng(100 + seed)
    buckets = 256
    opts = _random_options(rng, 10, 6, bytes_unit=MiB // 4)
    keep = int(opts.A[:, 0].sum())
    for fraction in (0.6, 0.35, 0.2):
        budget = int(keep * fraction) // (MiB // 4) // buckets * buckets * (MiB // 4)
        if budget == 0:
            continue
        picks = solve_dp(opts, budget, prefetch, buckets)
        solved = solve_milp(opts, budget, prefetch)
        assert (picks is None) == (solved is None)
        if picks is None:
            continue
        dp_cost, milp_cost = model_cost(opts, picks, prefetch), solved[1]
        assert dp_cost <= milp_cost + 1e-12
        assert dp_cost == pytest.approx(milp_cost, rel=1e-6, abs=1e-12)


def test_merge_states_groups_equal_keys_in_their_given_order():
    rng = np.random.default_rng(0)
    keys = rng.choice([0.0, 1.5, 3.0], size=(200, 3))
    order, starts, ends = _merge_states(keys)
    assert sorted(order.tolist()) == list(range(200))
    assert starts[0] == 0 and ends[-1] == 200 and (starts[1:] == ends[:-1]).all()
    groups = [order[a:b] for a, b in zip(starts, ends)]
    assert len(groups) == len({tuple(k) for k in keys.tolist()})
    for rows in groups:
        assert (keys[rows] == keys[rows[0]]).all() and (np.diff(rows) > 0).all()
    firsts = [tuple(keys[rows[0]]) for rows in groups]
    assert firsts == sorted(firsts)


def test_options_that_move_nothing_lead_to_one_state():
    """After a state with nothing to copy back, keep and recompute (nothing moved, nothing to copy
    back) lead to one state and a swap to another; after a swap, the copy back left exposed is the
    state's: 1 ms of 2 ms under keep's backward, none under the recompute's 3 ms."""
    zeros = np.zeros((2, 3), dtype=np.int64)
    X = np.array([[0, 0, 8 * MiB]] * 2)
    t_in = np.array([[0.0, 0.0, 2e-3]] * 2)
    comp = np.array([[1e-3, 3e-3, 1e-3]] * 2)
    A = np.array([[8 * MiB, MiB, 8 * MiB]] * 2)
    opts = Options(tuple(BlockPlan("keep") for _ in range(3)), A, X, zeros, zeros, zeros, np.zeros((2, 3)), t_in, t_in,
                   comp, np.full(2, 1e-3))
    states = np.array([[0.0, 0.0, 0.0, 0.0], [8.0 * MiB, 0.0, 2e-3, 0.0]])  # (X, X, residual, residual), newest first
    source, option, _, _, _, keys = _pairs(opts, 1, states, 2, 1e12, 1e6, 0, 10**6)
    after = {(int(s), int(k)): tuple(row) for s, k, row in zip(source, option, keys)}
    assert after[0, 0] == after[0, 1] == (0.0, 0.0, 0.0, 0.0)
    assert after[0, 2] == (8.0 * MiB, 0.0, 2e-3, 0.0)
    assert after[1, 0] == (0.0, 8.0 * MiB, 0.0, 2e-3 - 1e-3)
    assert after[1, 1] == (0.0, 8.0 * MiB, 0.0, 0.0)
    assert after[1, 2] == (8.0 * MiB, 8.0 * MiB, 2e-3, 1e-3)
    _, starts, _ = _merge_states(keys)
    assert len(starts) == 5  # of 6 pairs


def test_relax_shifts_each_pair_and_cuts_it_past_its_limit():
    """Buckets 5..8 of one state's costs, three pairs: each candidate row is the costs ``shift``
    buckets on plus ``add``, infinite past the pair's limit and where the source has no bucket; each
    new state takes the least of its pairs, over the buckets the pairs reach."""
    cost = np.array([[0.0, 1.0, 2.0, 3.0]])
    shift, add, limit = np.array([0, 2, 1]), np.array([0.5, 0.25, 1.0]), np.array([6, 9, 100])
    cand, new, lo = _relax(cost, 5, shift, add, limit, np.zeros(3, dtype=np.int64), np.array([0, 2]), np.array([2, 3]))
    inf = np.inf
    assert lo == 5
    assert cand.tolist() == [[0.5, 1.5, inf, inf, inf, inf],
                             [inf, inf, 0.25, 1.25, 2.25, inf],
                             [inf, 1.0, 2.0, 3.0, 4.0, inf]]
    assert new.tolist() == [[0.5, 1.5, 0.25, 1.25, 2.25, inf], [inf, 1.0, 2.0, 3.0, 4.0, inf]]


def test_gpt2_xl_op_level_at_prefetch_3_keeps_its_memory():
    """16 options per block and 3 blocks of lag: the option-tuple DP's back pointers alone took
    48 blocks x 769 buckets x 16^3 states x 2 bytes (302 MB); the merged states (about 290) with
    1-byte back pointers take a fraction."""
    prof, hw = Profile.load(GPT2), preset("h100-sxm")
    opts = build_options(prof, hw, selective=4, selective_swaps=2)
    budget = build_schedule(Plan.uniform("keep", len(prof)), prof).peak_bytes // 2
    tracemalloc.start()
    try:
        picks = solve_dp(opts, budget, 3, 768, table_bytes=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert picks is not None and _fits_buckets(opts, picks, budget, 3, 768)
    assert peak < 120 * MiB


def test_the_tables_kept_stay_under_their_cap(monkeypatch):
    """Past ``table_bytes`` the DP stores back pointers instead of cost tables, and from then on only."""
    rng = np.random.default_rng(7)
    opts = _random_options(rng, 12, 6)
    budget = int(opts.A[:, 0].sum() * 0.4)
    steps = []
    real = optimal_module._Step
    monkeypatch.setattr(optimal_module, "_Step", lambda *a: steps.append(real(*a)) or steps[-1])
    picks = solve_dp(opts, budget, 2, 64, table_bytes=3000)
    kept = [s.cost is not None for s in steps]
    assert picks is not None and 0 < sum(kept) < len(kept) and kept == sorted(kept, reverse=True)
    assert sum(s.cost.nbytes for s in steps if s.cost is not None) <= 3000
    assert all(s.back is not None and s.back.dtype == np.uint8 for s in steps if s.cost is None)
    assert picks == solve_dp(opts, budget, 2, 64)


def _model_cost_by_block(opts: Options, picks: list[int], prefetch: int) -> float:
    """``model_cost`` written as the sum over blocks it is: the spec of the vectorised one."""
    n = len(picks)
    t_out = np.array([opts.t_out[i, k] for i, k in enumerate(picks)])
    cost = float(np.array([opts.recompute_s[i, k] for i, k in enumerate(picks)]).sum())
    cost += float(np.maximum(0.0, t_out - opts.next_forward_s).sum())
    for j in range(n):
        t = opts.t_in[j, picks[j]]
        if t > 0:
            hidden = 0.0
            for k in range(j + 1, min(j + prefetch, n - 1) + 1):
                hidden += opts.comp[k, picks[k]]
            cost += max(0.0, t - hidden)
    return cost


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_model_cost_is_the_sum_over_blocks_to_the_last_bit(prefetch):
    """The DP's bucket search and the polish compare plans by ``model_cost``, ties included, so the
    vectorised sum adds the same floats in the same order as the loop over blocks."""
    prof, hw = Profile.load(GPT2), preset("h100-sxm")
    opts = build_options(prof, hw, selective=4, selective_swaps=2)
    rng = np.random.default_rng(prefetch)
    for _ in range(50):
        picks = [int(rng.choice(np.flatnonzero(opts.allowed[i]))) for i in range(opts.n)]
        assert model_cost(opts, picks, prefetch) == _model_cost_by_block(opts, picks, prefetch)
    short = _random_options(rng, 2, 4)  # fewer blocks than the prefetch window
    for picks in ([0, 0], [1, 2], [3, 3]):
        assert model_cost(short, picks, prefetch) == _model_cost_by_block(short, picks, prefetch)
