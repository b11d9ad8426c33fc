"""The additive cost model the ``optimal`` DP and the MILP both solve.

Per block, each option (keep, swap, recompute, recompute + swap its input; with codecs, each swap
once per codec; with an op-level profile, selective recomputes and their variants with some cached
outputs swapped, NOTE [window swaps] in ``ooc.scheduler.oplevel``) has device bytes allocated in the forward (``A``), bytes moved to the host (``X``),
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

from ooc.scheduler.codecs import CODEC_ERROR_BOUND, CODECS, codec_error_name
from ooc.scheduler.hardware import Hardware
from ooc.scheduler.oplevel import selective_sets, swapped_sets
from ooc.scheduler.plan import BlockPlan, Codec, Plan, Policy
from ooc.scheduler.profile import BlockProfile, Profile
from ooc.scheduler.schedule import block_bytes, selective_rerun_s

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
    selective: tuple[tuple[tuple[bool, tuple[int, ...], tuple[int, ...]], ...], ...] | None = None
    """Per block, its options after ``choices``: (swap_input, cached_ops, swapped_ops) of a selective RECOMPUTE,
    each block its own cached sets (NOTE [op-level options] in ``ooc.scheduler.oplevel``); ``None``:
    ``choices`` alone, the same for every block. Kept as plain tuples, made into a
    :class:`BlockPlan` only for the options a plan picks."""

    def allows(self, i: int, k: int) -> bool:
        return self.allowed is None or bool(self.allowed[i, k])

    def _key(self, i: int, k: int) -> tuple:
        if k < len(self.choices):
            c = self.choices[k]
            return c.policy, c.codec, c.swap_input, c.cached_ops, c.swapped_ops
        swap_input, cached, swapped = self.selective[i][k - len(self.choices)]
        return Policy.RECOMPUTE, Codec.NONE, swap_input, cached, swapped

    def choice(self, i: int, k: int) -> BlockPlan:
        """Option ``k`` of block ``i``."""
        if k < len(self.choices):
            return self.choices[k]
        swap_input, cached, swapped = self.selective[i][k - len(self.choices)]
        return BlockPlan(Policy.RECOMPUTE, swap_input=swap_input, cached_ops=cached, swapped_ops=swapped)

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
        picks = []
        for i, b in enumerate(plan.blocks):
            index = {self._key(i, k): k for k in reversed(range(self.m)) if self.allows(i, k)}
            picks.append(index[(b.policy, b.codec, b.swap_input, b.cached_ops, b.swapped_ops)])
        return picks


def _add_selective(profile: Profile, base: Options, count: int, swap_input: bool, hardware: Hardware | None = None,
                   swaps: int = 0) -> Options:
    """``base`` with, per block, up to ``count`` selective-recompute options appended, and as many
    again with the input swapped when ``swap_input``, then (with ``hardware``) up to ``swaps``
    variants of those with some cached outputs swapped, and as many again with the input swapped
    too; a block with fewer has its extra slots not allowed.

    A selective option's numbers are those of its plain RECOMPUTE (same ``swap_input``, taken from
    ``base``) with the cached outputs held from the forward (``A``), the re-run allocating less by
    the cached outputs autograd saves (``Rc``) and skipping the cached ops, less what recording
    and replaying its ops costs (``recompute_s``, ``comp``): ``block_bytes`` and the RECOMPUTE op's duration of ``ooc.scheduler.schedule``, in
    arrays, without a :class:`BlockPlan` per option (a test holds them equal). The swapped variants
    (NOTE [window swaps] in ``ooc.scheduler.oplevel``, :func:`~ooc.scheduler.oplevel.swapped_sets`)
    are few, so each is a :class:`BlockPlan` whose numbers are the schedule's own (``_numbers``)."""
    plain = {c.swap_input: k for k, c in reversed(list(enumerate(base.choices)))
             if c.policy is Policy.RECOMPUTE and c.codec is Codec.NONE and not c.cached_ops}
    variants = tuple(v for v in ((False, True) if swap_input else (False,)) if v in plain)  # a selective option varies a plain one
    if not variants:
        return base
    # The window is a time: no swapped variants on a bytes-only model; nor when ``choices`` swap
    # nothing (the caller kept the link out of the plan).
    swaps = swaps if hardware is not None and any(c.swaps_anything for c in base.choices) else 0
    ks = [plain[v] for v in variants for _ in range(count)]
    n, extra = base.n, len(ks)
    A, Rc, skipped = base.A[:, ks].copy(), base.Rc[:, ks].copy(), np.zeros((n, extra))
    allowed = np.zeros((n, extra), dtype=bool)
    width = swaps * len(variants)  # as ``count``: up to ``swaps`` per flavour of swap_input
    swapped_cols = [np.zeros((n, width), dtype=np.int64) for _ in range(5)] + [np.zeros((n, width)) for _ in range(4)]
    swapped_allowed = np.zeros((n, width), dtype=bool)
    memo: dict[tuple, tuple] = {}
    slots = []
    for i, b in enumerate(profile.blocks):
        # Everything ``selective_sets`` reads of the ops: what each reads too (the ops its re-run skips).
        replayed_s = b.replayed_s  # a plain re-run (selective_rerun_s)
        key = (b.saved_bytes - b.input_bytes, replayed_s,
               *((op.forward_s, op.output_bytes, op.saved_bytes, op.cacheable, op.returned, op.reads, op.replayed)
                 for op in b.ops))
        if key not in memo:
            memo[key] = selective_sets(b.ops, count, keep=(b.saved_bytes - b.input_bytes, replayed_s))
        sets, row = memo[key], []
        for v in variants:
            for j in range(count):
                col = len(row)
                if j < len(sets):
                    allowed[i, col] = True
                    A[i, col] += sets[j].bytes
                    Rc[i, col] -= sets[j].autograd_bytes
                    # A cache lookup is free; recording and replaying the ops is not (selective_rerun_s).
                    saved_s = min(sets[j].saved_s, replayed_s)
                    kernels_s = b.forward_s + replayed_s - saved_s
                    intercept = hardware.intercept_s(len(b.ops), kernels_s) if hardware is not None else 0.0
                    skipped[i, col] = saved_s - intercept
                row.append((v, sets[j].ops if j < len(sets) else (), ()))
        if swaps:
            found = _swapped_variants(b, sets, variants, swaps, float(base.next_forward_s[i]), hardware)
            for col, plan_block in enumerate(found):
                swapped_allowed[i, col] = True
                numbers = _numbers(plan_block, b, hardware)
                for arr, value in zip(swapped_cols, numbers[0] + numbers[1]):
                    arr[i, col] = value
                row.append((plan_block.swap_input, plan_block.cached_ops, plan_block.swapped_ops))
            row.extend((False, (), ()) for _ in range(width - len(found)))
        slots.append(tuple(row))
    grow = lambda arr, new: np.concatenate([arr, new], axis=1)  # noqa: E731
    same = lambda arr: grow(arr, arr[:, ks])  # noqa: E731
    base_allowed = base.allowed if base.allowed is not None else np.ones((n, base.m), dtype=bool)
    sA, sX, sRc, sD, sT, srec, sout, sin, scomp = swapped_cols
    return Options(base.choices, grow(grow(base.A, A), sA), grow(same(base.X), sX), grow(grow(base.Rc, Rc), sRc),
                   grow(same(base.D), sD), grow(same(base.T), sT),
                   grow(grow(base.recompute_s, base.recompute_s[:, ks] - skipped), srec), grow(same(base.t_out), sout),
                   grow(same(base.t_in), sin), grow(grow(base.comp, base.comp[:, ks] - skipped), scomp), base.next_forward_s,
                   grow(grow(base_allowed, allowed), swapped_allowed), tuple(slots))


def _swapped_variants(b: BlockProfile, sets: tuple, variants: tuple[bool, ...], swaps: int, window_s: float,
                      hardware: Hardware) -> list[BlockPlan]:
    """Up to ``swaps`` selective options of block ``b`` with cached outputs swapped (NOTE [window
    swaps] in ``ooc.scheduler.oplevel``), and as many again with the input swapped too (its copy
    takes its share of the window first), as ``selective`` counts its options."""
    bandwidth = min(hardware.d2h, hardware.h2d)
    found = []
    for v in variants:
        taken = b.input_swappable_bytes / bandwidth if v else 0.0
        for s in swapped_sets(b.ops, sets, swaps, window_s=window_s, bandwidth=bandwidth,
                              latency_s=hardware.copy_latency_s, taken_s=taken):
            found.append(BlockPlan(Policy.RECOMPUTE, swap_input=v, cached_ops=s.cached.ops, swapped_ops=s.swapped))
    return found


def _numbers(c: BlockPlan, b: BlockProfile, hardware: Hardware | None) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """One option's numbers on one block: (A, X, Rc, D, T) from the schedule's ``block_bytes``,
    and (recompute_s, t_out, t_in, comp) from its ops' durations (``_with_duration``)."""
    bytes_ = block_bytes(c, b)
    X, D = bytes_.swapped, bytes_.decoded
    rec = selective_rerun_s(c, b, hardware) if c.policy is Policy.RECOMPUTE else 0.0
    comp = b.backward_s + rec
    t_out = t_in = 0.0
    if X and hardware is not None:
        rec += 2 * bytes_.copies * hardware.copy_issue_s  # issued in the forward, again in the backward
        if c.codec is not Codec.NONE:
            rec += 2 * (X + D) / hardware.d2d  # encode + decode read/write the full tensor
        t_out = hardware.copy_latency_s + X / hardware.d2h
        t_in = hardware.copy_latency_s + X / hardware.h2d
    return (bytes_.forward_alloc, X, bytes_.recompute_alloc, D, bytes_.decode_transient), (rec, t_out, t_in, comp)


def _codec_allowed(block: BlockProfile, choice: BlockPlan, max_codec_error: float) -> bool:
    """Whether ``choice``'s codec moves ``block``'s gradients by at most ``max_codec_error``: a RECOMPUTE
    by its own measured error (its re-run starts from the dequantized input), read as the SWAP's where a
    profile predates that measurement; a codec the profile did not measure is allowed."""
    error = None
    if choice.policy is Policy.RECOMPUTE:
        error = block.codec_error_of(codec_error_name(choice.codec, recompute=True))
    if error is None:
        error = block.codec_error_of(codec_error_name(choice.codec))
    return error is None or error <= max_codec_error


def build_options(profile: Profile, hardware: Hardware | None, choices: tuple[BlockPlan, ...] = BASE_OPTIONS,
                  max_codec_error: float = CODEC_ERROR_BOUND, *, selective: int = 0,
                  selective_swap_input: bool = True, selective_swaps: int = 2) -> Options:
    """Every block's bytes and times under each of ``choices`` (bytes only, copy times zero, with
    ``hardware=None``: enough for ``model_peak``). A codec whose measured gradient error
    on a block exceeds ``max_codec_error`` is not allowed there (NOTE [codec error] in
    ``ooc.codec_error``); a codec the profile did not measure is allowed. ``selective > 0`` adds,
    per block with an op-level profile, up to that many selective-recompute options (each block its
    own cached sets, NOTE [op-level options] in ``ooc.scheduler.oplevel``), and as many again with the
    input swapped where ``selective_swap_input``, and (with ``hardware``) up to ``selective_swaps``
    variants of those with some cached outputs swapped to the host, and as many again with the
    input swapped too (NOTE [window swaps] in ``ooc.scheduler.oplevel``)."""
    n, m = len(profile), len(choices)
    allowed = np.ones((n, m), dtype=bool)
    A, X, Rc, D, T = (np.zeros((n, m), dtype=np.int64) for _ in range(5))
    rec, t_out, t_in, comp = (np.zeros((n, m)) for _ in range(4))
    for i, b in enumerate(profile.blocks):
        for k, c in enumerate(choices):
            if c.codec is not Codec.NONE:
                allowed[i, k] = _codec_allowed(b, c, max_codec_error)
            (A[i, k], X[i, k], Rc[i, k], D[i, k], T[i, k]), (rec[i, k], t_out[i, k], t_in[i, k], comp[i, k]) = _numbers(c, b, hardware)
    nxt = np.array([profile.blocks[i + 1].forward_s for i in range(n - 1)] + [profile.outside_forward_s + profile.outside_backward_s])
    base = Options(choices, A, X, Rc, D, T, rec, t_out, t_in, comp, nxt, allowed)
    return (_add_selective(profile, base, selective, selective_swap_input, hardware, selective_swaps) if selective > 0
            else base)


def model_cost(opts: Options, picks: list[int], prefetch: int) -> float:
    """Extra seconds over the in-core step, under the additive model."""
    n = opts.n
    idx = np.arange(n)
    picks = np.asarray(picks)
    cost = float(opts.recompute_s[idx, picks].sum())
    cost += float(np.maximum(0.0, opts.t_out[idx, picks] - opts.next_forward_s).sum())
    comp, t_in = opts.comp[idx, picks], opts.t_in[idx, picks]
    hidden = np.zeros(n)  # the backward compute of blocks j+1 .. j+prefetch, added in that order
    for k in range(1, prefetch + 1):
        hidden[: max(0, n - k)] += comp[k:]
    for exposed in np.maximum(0.0, t_in - hidden)[t_in > 0].tolist():  # one by one, in block order
        cost += exposed
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
