"""The ops a selective re-run leaves out (NOTE [ops a re-run skips] in ``ooc.scheduler.oplevel``): the
rule against a fixpoint written from its definition, what the profile must record, and how the
options and the schedule price it."""

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from ooc.scheduler import BlockPlan, Plan, Profile, build_schedule, preset
from ooc.scheduler.analytic import gpt2_xl, preact_resnet_bottleneck, wide_resnet
from ooc.scheduler.costmodel import build_options
from ooc.scheduler.errors import ProfileError
from ooc.scheduler.oplevel import dead_ops, rerun_saved_s, rerun_skipped, selective_sets
from ooc.scheduler.plan import Policy
from ooc.scheduler.profile import OpProfile
from ooc.scheduler.schedule import cached_ops_cost
from ooc.scheduler.simulate import predict

MiB = 2**20
PROFILES = Path(__file__).resolve().parents[2] / "profiles"
HW = preset("h100-sxm")


def _gpt_block():
    return gpt2_xl(1024, 8, HW).blocks[1]


def _index(ops, name):
    return next(k for k, op in enumerate(ops) if op.name == name)


def _random_ops(r: random.Random, n: int) -> tuple[OpProfile, ...]:
    ops = []
    for k in range(n):
        out = r.choice([0, r.randint(1, 9) * MiB, r.randint(1, 9) * MiB])
        saved = out if out and r.random() < 0.3 else 0
        reads = tuple(sorted(r.sample(range(k), min(k, r.randint(0, 2)))))
        ops.append(OpProfile(f"op{k}", r.uniform(1e-6, 1e-4), out, saved, r.random() > 0.2, reads=reads))
    return tuple(ops)


def _by_fixpoint(ops, cached) -> set[int]:
    """The definition, solved the slow way: start from every op that could be left out and drop
    those some op still needs (a computing reader that runs) or that no computing op reads, until
    nothing changes."""
    last_storing = max((k for k, op in enumerate(ops) if op.output_bytes > 0), default=None)
    returned = {len(ops) - 1, last_storing}
    view = lambda r: False  # noqa: E731  (a profile records no reads for a view op: every recorded reader computes)
    dead = {k for k, op in enumerate(ops) if k not in cached and op.cacheable and op.output_bytes > 0
            and op.saved_bytes == 0 and k not in returned}
    changed = True
    while changed:
        changed = False
        for k in sorted(dead):
            computing = [r for r, op in enumerate(ops) if k in op.reads and not view(r)]
            if not computing or any(r not in cached and r not in dead for r in computing):
                dead.discard(k)
                changed = True
    return dead


@pytest.mark.parametrize("seed", range(30))
def test_the_one_pass_rule_is_the_definitions_fixpoint(seed):
    r = random.Random(seed)
    ops = _random_ops(r, r.randint(2, 14))
    cacheable = [k for k, op in enumerate(ops) if op.cacheable]
    cached = set(r.sample(cacheable, r.randint(0, len(cacheable))))
    assert rerun_skipped(ops, cached) == _by_fixpoint(ops, cached)


def test_a_chain_is_left_out_back_to_what_something_else_reads():
    # 0 -> 1 -> 2 -> 3 (cached); 0 is also read by 4, which must run (random, say): 1 and 2 go, 0 stays.
    readers = [[1, 4], [2], [3], [], []]
    skippable = [True, True, True, True, False]
    passive = [False] * 5
    assert dead_ops(frozenset({3}), readers, skippable, passive) == {1, 2}
    assert dead_ops(frozenset({3, 4}), readers, skippable, passive) == {0, 1, 2}
    # Read by nothing: the block may store it aside, so it runs, and so does what it reads.
    assert dead_ops(frozenset(), readers, skippable, passive) == set()
    # A view (4, of 0 and of 1) reads without computing: what reads through it would be a reader of
    # the same storage, so it does not keep them; an output only a view reads may be stored aside
    # through the view: it runs.
    assert dead_ops(frozenset({3}), [[1, 4], [2, 4], [3], [], []], skippable, [False] * 4 + [True]) == {0, 1, 2}
    assert dead_ops(frozenset({3}), [[4], [2], [3], [], []], skippable, [False] * 4 + [True]) == {1, 2}
    # An op that cannot be left out keeps its inputs.
    assert dead_ops(frozenset({3}), readers, [True, True, False, True, False], passive) == set()


def test_what_autograd_saves_the_block_returns_or_a_random_op_makes_is_never_left_out():
    ops = (OpProfile("mm", 1e-4, MiB, reads=()), OpProfile("softmax", 1e-5, MiB, MiB, reads=(0,)),
           OpProfile("out", 1e-5, MiB, reads=(1,), returned=True))
    assert rerun_skipped(ops, {1}) == {0}
    assert rerun_skipped(replace_op(ops, 0, saved_bytes=MiB), {1}) == set()
    assert rerun_skipped(replace_op(ops, 0, cacheable=False), {1}) == set()
    assert rerun_skipped(replace_op(ops, 0, returned=True), {1}) == set()
    assert rerun_skipped(replace_op(ops, 0, outlives_forward=True), {1}) == set()  # held, as autocast's weight casts
    assert rerun_skipped(replace_op(ops, 0, output_bytes=0), {1}) == set()  # a view: nothing to skip
    # Read by an op that runs in the re-run (not cached, and itself needed: random, say): needed.
    assert rerun_skipped(ops + (OpProfile("sample", 1e-6, 4, cacheable=False, reads=(0,)),), {1}) == set()
    # Read by an op whose output nothing reads (it may be stored aside): both run.
    assert rerun_skipped(ops + (OpProfile("sum", 1e-6, 4, reads=(0,)),), {1}) == set()
    assert rerun_skipped(ops + (OpProfile("sum", 1e-6, 4, reads=(0,)),), {1, 3}) == {0}


def test_a_profile_without_reads_skips_nothing():
    ops = tuple(replace(op, reads=None) for op in _gpt_block().ops)
    softmax = _index(ops, "softmax")
    assert rerun_skipped(ops, {softmax}) == set()
    assert rerun_saved_s(ops, {softmax}) == ops[softmax].forward_s


def test_nothing_cached_saves_nothing():
    assert rerun_saved_s(_gpt_block().ops, ()) == 0.0


def replace_op(ops, k, **changes):
    return ops[:k] + (replace(ops[k], **changes),) + ops[k + 1:]


def test_caching_the_softmax_skips_the_scores_in_the_schedule():
    b = _gpt_block()
    softmax, scores = _index(b.ops, "softmax"), _index(b.ops, "scores")
    assert rerun_skipped(b.ops, {softmax}) == {scores}
    held, _, skipped_s = cached_ops_cost(BlockPlan(Policy.RECOMPUTE, cached_ops=(softmax,)), b)
    assert held == b.ops[softmax].output_bytes
    assert skipped_s == pytest.approx(b.ops[softmax].forward_s + b.ops[scores].forward_s, rel=1e-12)
    # The simulated step (all compute: nothing moves) is shorter by the scores' time too.
    n = 4
    prof = Profile(gpt2_xl(1024, 8, HW).blocks[:n], outside_forward_s=1e-3)
    plain = Plan(tuple(BlockPlan(Policy.RECOMPUTE) for _ in range(n)))
    cached = Plan(tuple(BlockPlan(Policy.RECOMPUTE, cached_ops=(softmax,)) for _ in range(n)))
    step = predict(plain, prof, HW).step_time_s - predict(cached, prof, HW).step_time_s
    assert step == pytest.approx(n * skipped_s, rel=1e-9)


def test_no_option_holds_a_cached_output_its_rerun_would_skip_anyway():
    b = _gpt_block()
    sets = selective_sets(b.ops, 8, keep=(b.saved_bytes - b.input_bytes, b.forward_s))
    assert sets
    for s in sets:
        for k in s.ops:
            assert k not in rerun_skipped(b.ops, set(s.ops) - {k}), (s.ops, b.ops[k].name)
        assert s.saved_s == pytest.approx(rerun_saved_s(b.ops, s.ops), rel=1e-12)
        assert s.bytes == sum(b.ops[k].output_bytes for k in s.ops)
    assert [s.bytes for s in sets] == sorted(s.bytes for s in sets)
    # The largest option caches the softmax without the scores it was computed from.
    scores, softmax = _index(b.ops, "scores"), _index(b.ops, "softmax")
    assert softmax in sets[-1].ops and scores not in sets[-1].ops


def _assert_selective_options_skip_what_their_reruns_skip(prof: Profile, opts) -> list[tuple[int, int]]:  # noqa: ANN001
    """Each block's selective options cost its backward plus its forward up to its last save (NOTE
    [a re-run stops at the last save]) less what the re-run skips (``HW`` charges nothing for
    recording ops); the (block, option) pairs checked."""
    checked = []
    for i, b in enumerate(prof.blocks):
        for k in range(len(opts.choices), opts.m):
            if not opts.allows(i, k):
                continue
            c = opts.choice(i, k)
            skipped = rerun_saved_s(b.ops, c.cached_ops)
            assert opts.recompute_s[i, k] >= 0
            assert opts.comp[i, k] == pytest.approx(b.backward_s + max(0.0, b.replayed_s - skipped), rel=1e-12), \
                (b.name, c.cached_ops)
            checked.append((i, k))
    return checked


def test_the_planners_numbers_are_the_schedules_with_skipped_ops():
    prof = Profile(gpt2_xl(1024, 8, HW).blocks[:3], outside_forward_s=1e-3)
    assert _assert_selective_options_skip_what_their_reruns_skip(prof, build_options(prof, HW, selective=4))


def test_blocks_that_differ_only_in_what_their_ops_read_get_their_own_options():
    """Two blocks with the same op numbers, one whose profile records no ``reads`` (its forward ran
    a kernel no dispatch showed): the second's options are its own, not the first's (whose re-run
    would skip ops the second's does not), and priced as the schedule prices them."""
    b = gpt2_xl(1024, 8, HW).blocks[1]
    blind = replace(b, name="blind", ops=tuple(replace(op, reads=None) for op in b.ops))
    prof = Profile((b, blind), outside_forward_s=1e-3)
    opts = build_options(prof, HW, selective=4)
    assert _assert_selective_options_skip_what_their_reruns_skip(prof, opts)
    # Not vacuous: the first block's options rely on skipping.
    assert any(rerun_skipped(b.ops, opts.choice(0, k).cached_ops) for k in range(len(opts.choices), opts.m)
               if opts.allows(0, k))


def test_analytic_profiles_record_what_each_op_reads():
    for prof in (gpt2_xl(1024, 8, HW), gpt2_xl(1024, 8, HW, flash_attention=True), wide_resnet(batch=64, hardware=HW),
                 preact_resnet_bottleneck(depth=164, batch=64, hardware=HW)):
        for b in prof.blocks:
            assert all(op.reads is not None for op in b.ops)
            assert all(all(j < k for j in op.reads) for k, op in enumerate(b.ops))
    b = _gpt_block()
    assert b.ops[_index(b.ops, "scores_v")].reads == (_index(b.ops, "qkv"), _index(b.ops, "attention_dropout"))
    assert b.ops[-1].reads == (8, 13)  # the block's output: the first add (residual) and the MLP's dropout


def test_the_stored_analytic_profiles_carry_reads():
    prof = Profile.load(PROFILES / "analytic-h100-sxm-gpt2-xl-s1024.json")
    fresh = gpt2_xl(1024, 8, HW)
    assert [op.reads for op in prof.blocks[0].ops] == [op.reads for op in fresh.blocks[0].ops]


def test_reads_round_trip_and_old_profiles_load(tmp_path):
    prof = Profile(gpt2_xl(1024, 8, HW).blocks[:2], outside_forward_s=1e-3)
    path = tmp_path / "p.json"
    prof.save(path)
    assert Profile.load(path) == prof
    data = json.loads(path.read_text())
    for block in data["blocks"]:
        for op in block["ops"]:
            del op["reads"]
    path.write_text(json.dumps(data))
    assert all(op.reads is None for op in Profile.load(path).blocks[0].ops)


def test_outlives_forward_round_trips_and_is_a_flag(tmp_path):
    block = _gpt_block()
    prof = Profile((replace(block, ops=replace_op(block.ops, 0, outlives_forward=True)),))
    path = tmp_path / "p.json"
    prof.save(path)
    assert Profile.load(path).blocks[0].ops[0].outlives_forward
    with pytest.raises(ProfileError, match="outlives_forward"):
        replace_op(block.ops, 0, outlives_forward="yes")


@pytest.mark.parametrize("reads, match", [
    ((1, 0), "increasing"), ((0, 0), "increasing"), ((-1,), "reads"), ("0", "list of op indices"), ((2,), "earlier op"),
])
def test_bad_reads_are_refused_with_a_fix(reads, match):
    with pytest.raises(ProfileError, match=match):
        block = _gpt_block()
        ops = replace_op(block.ops, 2, reads=reads)
        replace(block, ops=ops)


def test_a_plan_that_caches_the_softmax_keeps_its_peak():
    """Skipping changes no byte of the schedule: the re-run allocates what the ops would."""
    prof = Profile(gpt2_xl(1024, 8, HW).blocks[:3], outside_forward_s=1e-3)
    softmax = _index(prof.blocks[0].ops, "softmax")
    with_reads = Plan(tuple(BlockPlan(Policy.RECOMPUTE, cached_ops=(softmax,)) for _ in range(3)))
    without = Profile(tuple(replace(b, ops=tuple(replace(op, reads=None) for op in b.ops)) for b in prof.blocks),
                      outside_forward_s=1e-3)
    assert build_schedule(with_reads, prof).peak_bytes == build_schedule(with_reads, without).peak_bytes


def test_an_option_drops_a_cached_output_its_reader_makes_redundant():
    """A matmul worth caching on its own (most seconds per byte) is worth nothing once the norm that
    reads it is cached: the option caches the norm alone and skips both."""
    ops = (OpProfile("mm", 100e-6, 10 * MiB, reads=()), OpProfile("norm", 10e-6, 10 * MiB, 10 * MiB, reads=(0,)),
           OpProfile("out", 1e-6, MiB, cacheable=False, reads=(1,), returned=True))
    sets = selective_sets(ops, 4)
    assert [(s.ops, s.bytes) for s in sets] == [((1,), 10 * MiB)]
    assert sets[0].saved_s == pytest.approx(110e-6)


@pytest.mark.parametrize("seed", range(30))
def test_dropping_redundant_cached_outputs_in_one_pass_is_dropping_them_one_by_one(seed):
    """``_without_skipped`` decides in one pass what trying each cached op from the last back, with
    the rule itself, decides (the way it was written first: cubic in the ops per block)."""
    from ooc.scheduler.oplevel import _rerun_graph, _without_skipped

    r = random.Random(seed)
    ops = _random_ops(r, r.randint(2, 14))
    cacheable = [k for k, op in enumerate(ops) if op.cacheable]
    cached = sorted(r.sample(cacheable, r.randint(0, len(cacheable))))
    kept = set(cached)
    for d in sorted(cached, reverse=True):
        if ops[d].saved_bytes == 0 and ops[d].output_bytes > 0 and d in rerun_skipped(ops, kept - {d}):
            kept.discard(d)
    assert _without_skipped(_rerun_graph(ops), cached) == sorted(kept)
