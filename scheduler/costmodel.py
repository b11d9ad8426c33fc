"""The additive cost model the ``optimal`` DP and the MILP both solve.

Per block, each option (keep, swap, recompute, recompute + swap its input; with codecs, each swap
once per codec) has device bytes allocated in the forward (``A``), bytes moved to the host (``X``),
bytes the recomputation allocates (``Rc``) and the decoding of compressed copies adds (``D``), all
from the schedule's ``block_bytes``, and times. The step time is modelled as the in-core time
plus, per block:
- ``recompute``: the block's forward again (less its cached ops' time, for a selective recompute);
- ``exposed_out``: the part of the copy out not hidden under the next block's forward (the runtime
  makes that copy end before the block after next starts: the RELEASE op in ``build_schedule``);
- ``exposed_in``: the part of the copy back not hidden under the compute of the ``prefetch`` blocks
  whose backward runs between its issue and its use.
The peak constraints are exact (they follow the schedule's memory walk):
``F_i = P_i + X_{i-1} + X_i <= B`` in the forward and ``M_b = P_b + sum_{j=b-p..b} X_j + D_b + max(Rc_b, T_b) <= B``
in the backward, where ``P_i = sum_{j<=i} (A_j - X_j)``. The simulator, not this model, is the judge
of a plan; the model is what makes an exact search over all plans tractable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ooc.scheduler.codecs import CODEC_ERROR_BOUND, CODECS
from ooc.scheduler.hardware import Hardware
from ooc.scheduler.oplevel import selective_sets
from ooc.scheduler.plan import BlockPlan, Codec, Plan, Policy
from ooc.scheduler.profile import Profile
from ooc.scheduler.schedule import block_bytes, cached_ops_cost

BASE_OPTIONS: tuple[BlockPlan, ...] = (
    BlockPlan(Policy.KEEP),
    BlockPlan(Policy.SWAP),
    BlockPlan(Policy.RECOMPUTE),
    BlockPlan(Policy.RECOMPUTE, swap_input=True),
)
CODEC_OPTIONS: tuple[BlockPlan, ...] = tuple(
    BlockPlan(policy, codec=codec, swap_input=policy is Policy.RECOMPUTE)
    for codec in CODECS
    for policy in (Policy.SWAP, Policy.RECOMPUTE)
)
"""Lossy options, one SWAP and one RECOMPUTE+swap_input per entry of ``ooc.scheduler.codecs.CODECS``: the
planner considers them only when asked (``choices=BASE_OPTIONS + CODEC_OPTIONS``)."""


@dataclass(frozen=True)
class Options:
    """Per block and option: arrays of shape (n, m)."""

    choices: tuple[BlockPlan, ...]
    A: np.ndarray
    X: np.ndarray
    Rc: np.ndarray
    D: np.ndarray
    """Growth when compressed storages are decoded as the block's backward starts."""
    T: np.ndarray
    """Decoding's transient: the last decoded storage's codes."""
    recompute_s: np.ndarray
    """Compute the option adds: the forward again (recompute), issuing copies, encoding/decoding."""
    t_out: np.ndarray
    t_in: np.ndarray
    comp: np.ndarray
    """Backward-phase compute of the block under each option (backward + recomputation)."""
    next_forward_s: np.ndarray
    """(n,): compute the copy out of block i hides under (block i+1's forward; the rest of the model for the last)."""
    allowed: np.ndarray | None = None
    """(n, m) bool: False where an option's codec moves the block's gradients by more than the
    bound (the profile's ``codec_error``), or where a block has fewer selective options than the
    others; ``None``: every option is allowed."""
    block_choices: tuple[tuple[BlockPlan, ...], ...] | None = None
    """Per block, its ``m`` options, where they differ between blocks (selective recompute: each
    block's own cached sets, NOTE [op-level options] in ``ooc.scheduler.oplevel``); ``None``:
    ``choices`` for every block."""

    def choice(self, i: int, k: int) -> BlockPlan:
        """Option ``k`` of block ``i``."""
        return self.choices[k] if self.block_choices is None else self.block_choices[i][k]

    def allows(self, i: int, k: int) -> bool:
        return self.allowed is None or bool(self.allowed[i, k])

    @property
    def backward_extra(self) -> np.ndarray:
        """What the block adds at its backward's peak: decoded bytes, then the larger of the
        recomputation and decoding's transient (they never overlap)."""
        return self.D + np.maximum(self.Rc, self.T)

    @property
    def n(self) -> int:
        return self.A.shape[0]

    @property
    def m(self) -> int:
        return self.A.shape[1]

    def plan(self, picks: list[int] | np.ndarray, *, prefetch: int, min_swap_bytes: int, name: str) -> Plan:
        return Plan(blocks=tuple(self.choice(i, int(c)) for i, c in enumerate(picks)), prefetch=prefetch,
                    min_swap_bytes=min_swap_bytes, name=name)

    def picks_of(self, plan: Plan) -> list[int]:
        key = lambda c: (c.policy, c.codec, c.swap_input, c.cached_ops)  # noqa: E731
        picks = []
        for i, b in enumerate(plan.blocks):
            index = {key(self.choice(i, k)): k for k in reversed(range(self.m)) if self.allows(i, k)}
            picks.append(index[key(b)])
        return picks


def _selective_choices(profile: Profile, choices: tuple[BlockPlan, ...], selective: int,
                       swap_input: bool) -> tuple[tuple[tuple[BlockPlan, ...], ...], np.ndarray]:
    """Per block: ``choices`` then ``selective`` RECOMPUTE options with cached ops (and as many with
    ``swap_input`` too), padded with plain RECOMPUTE where a block has fewer; (n, m) allowed mask."""
    variants = (False, True) if swap_input else (False,)
    m = len(choices) + selective * len(variants)
    blocks, allowed = [], np.ones((len(profile), m), dtype=bool)
    memo: dict[tuple, tuple] = {}
    for i, b in enumerate(profile.blocks):
        key = tuple((op.forward_s, op.output_bytes, op.cacheable) for op in b.ops)
        if key not in memo:
            memo[key] = tuple(s.ops for s in selective_sets(b.ops, selective))
        sets = memo[key]
        row = list(choices)
        for v in variants:
            for j in range(selective):
                if j < len(sets):
                    row.append(BlockPlan(Policy.RECOMPUTE, swap_input=v, cached_ops=sets[j]))
                else:
                    allowed[i, len(row)] = False
                    row.append(BlockPlan(Policy.RECOMPUTE, swap_input=v))
        blocks.append(tuple(row))
    return tuple(blocks), allowed


def build_options(profile: Profile, hardware: Hardware | None, choices: tuple[BlockPlan, ...] = BASE_OPTIONS,
                  max_codec_error: float = CODEC_ERROR_BOUND, *, selective: int = 0,
                  selective_swap_input: bool = True) -> Options:
    """Every block's bytes and times under each of ``choices`` (bytes only, copy times zero, with
    ``hardware=None``: enough for ``model_peak``). A codec whose measured gradient error
    on a block exceeds ``max_codec_error`` is not allowed there (NOTE [codec error] in
    ``ooc.codec_error``); a codec the profile did not measure is allowed. ``selective > 0`` adds,
    per block with an op-level profile, up to that many selective-recompute options (each block its
    own cached sets, NOTE [op-level options] in ``ooc.scheduler.oplevel``), and as many again with the
    input swapped where ``selective_swap_input``."""
    n = len(profile)
    block_choices = None
    allowed = np.ones((n, len(choices)), dtype=bool)
    if selective > 0:
        block_choices, allowed = _selective_choices(profile, choices, selective, selective_swap_input)
    m = allowed.shape[1]
    A, X, Rc, D, T = (np.zeros((n, m), dtype=np.int64) for _ in range(5))
    rec, t_out, t_in, comp = (np.zeros((n, m)) for _ in range(4))
    for i, b in enumerate(profile.blocks):
        for k in range(m):
            c = choices[k] if block_choices is None else block_choices[i][k]
            bytes_ = block_bytes(c, b)
            if c.codec is not Codec.NONE:
                error = b.codec_error_of(c.codec.value)
                allowed[i, k] = error is None or error <= max_codec_error
            A[i, k], X[i, k], Rc[i, k], D[i, k] = bytes_.forward_alloc, bytes_.swapped, bytes_.recompute_alloc, bytes_.decoded
            T[i, k] = bytes_.decode_transient
            rec[i, k] = b.forward_s if c.policy is Policy.RECOMPUTE else 0.0
            if c.cached_ops:
                rec[i, k] = max(0.0, b.forward_s - cached_ops_cost(c, b)[2])  # a cache lookup is free
            comp[i, k] = b.backward_s + rec[i, k]
            if X[i, k] and hardware is not None:
                rec[i, k] += 2 * bytes_.copies * hardware.copy_issue_s  # issued in the forward, again in the backward
                if c.codec is not Codec.NONE:
                    rec[i, k] += 2 * (X[i, k] + D[i, k]) / hardware.d2d  # encode + decode read/write the full tensor
                t_out[i, k] = hardware.copy_latency_s + X[i, k] / hardware.d2h
                t_in[i, k] = hardware.copy_latency_s + X[i, k] / hardware.h2d
    nxt = np.array([profile.blocks[i + 1].forward_s for i in range(n - 1)] + [profile.outside_forward_s + profile.outside_backward_s])
    return Options(choices, A, X, Rc, D, T, rec, t_out, t_in, comp, nxt, allowed, block_choices)


def model_cost(opts: Options, picks: list[int], prefetch: int) -> float:
    """Extra seconds over the in-core step, under the additive model."""
    n = opts.n
    idx = np.arange(n)
    picks = np.asarray(picks)
    cost = float(opts.recompute_s[idx, picks].sum())
    cost += float(np.maximum(0.0, opts.t_out[idx, picks] - opts.next_forward_s).sum())
    comp = opts.comp[idx, picks]
    for j in range(n):
        t = opts.t_in[j, picks[j]]
        if t > 0:
            cost += max(0.0, t - float(comp[j + 1 : min(j + prefetch, n - 1) + 1].sum()))
    return cost


def model_peak(opts: Options, picks: list[int], prefetch: int) -> int:
    """The peak of the schedule's memory walk, from the same formulas the DP and MILP constrain."""
    n = opts.n
    idx = np.arange(n)
    picks = np.asarray(picks)
    A, X = opts.A[idx, picks], opts.X[idx, picks]
    Rc = opts.backward_extra[idx, picks]
    P = np.cumsum(A - X)
    previous = np.concatenate([[0], X[:-1]])
    forward = P + previous + X
    cumulative = np.concatenate([[0], np.cumsum(X)])
    window = cumulative[idx + 1] - cumulative[np.maximum(0, idx - prefetch)]  # X[i-p .. i]
    backward = P + window + Rc
    return int(max(forward.max(), backward.max()))
