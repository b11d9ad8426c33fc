"""The rule of NOTE [storages shared between blocks], on hand-made profiles."""

import pytest

from ooc.scheduler import build_schedule
from ooc.scheduler.errors import ProfileError
from ooc.scheduler.plan import BlockPlan, Plan
from ooc.scheduler.profile import BlockProfile, Profile, SharedStorage
from ooc.scheduler.sharing import SharedAdjustment, shared_adjustments

MiB = 2**20


def _profile(dtype="float32"):
    """Two blocks of 3 MiB saved each; block 0's output (1 MiB) is saved by both and is block 1's input."""
    out = SharedStorage(id=0, nbytes=MiB, dtype=dtype, saved=True, input=False)
    inp = SharedStorage(id=0, nbytes=MiB, dtype=dtype, saved=True, input=True)

    def block(name, shared):
        return BlockProfile(name=name, forward_s=1e-3, backward_s=2e-3, saved_bytes=3 * MiB, swappable_bytes=3 * MiB,
                            input_bytes=MiB, input_swappable_bytes=MiB, output_bytes=MiB, param_bytes=0, grad_bytes=0,
                            swappable_storages=3, input_swappable_storages=1, shared=shared)

    return Profile(blocks=(block("b0", (out,)), block("b1", (inp,))), min_swap_bytes=4096)


KEEP, SWAP, RECOMPUTE = BlockPlan("keep"), BlockPlan("swap"), BlockPlan("recompute")


@pytest.mark.parametrize("first, second, expected", [
    (KEEP, KEEP, SharedAdjustment(kept=MiB)),            # block 0 counts it, block 1 does not
    (SWAP, KEEP, SharedAdjustment()),                    # block 0 swaps it: block 1 is the first keeper
    (KEEP, SWAP, SharedAdjustment(swapped=MiB)),         # copied, but its device bytes stay block 0's
    (KEEP, BlockPlan("swap", codec="int8"), SharedAdjustment()),  # the codes are new bytes
    (KEEP, RECOMPUTE, SharedAdjustment(kept=MiB)),       # the input a recompute keeps is block 0's
    (KEEP, BlockPlan("recompute", swap_input=True), SharedAdjustment(swapped=MiB)),
    (RECOMPUTE, KEEP, SharedAdjustment()),               # block 0 holds only its own input
], ids=["KK", "SK", "KS", "KS-int8", "KR", "Kr", "RK"])
def test_the_first_keeper_counts_a_shared_storage(first, second, expected):
    plan = Plan(blocks=(first, second), min_swap_bytes=4096)
    assert shared_adjustments(plan, _profile()) == [SharedAdjustment(), expected]


def test_a_storage_below_the_swap_threshold_is_kept_by_a_swapping_block():
    plan = Plan(blocks=(KEEP, SWAP), min_swap_bytes=2 * MiB)
    assert shared_adjustments(plan, _profile()) == [SharedAdjustment(), SharedAdjustment(kept=MiB)]


def test_an_int_storage_is_swapped_uncompressed_even_with_a_codec():
    plan = Plan(blocks=(KEEP, BlockPlan("swap", codec="int8")), min_swap_bytes=4096)
    assert shared_adjustments(plan, _profile("int64")) == [SharedAdjustment(), SharedAdjustment(swapped=MiB)]


@pytest.mark.parametrize("code", ["KK", "KS", "KR", "SS", "RR"])
def test_the_schedule_counts_a_shared_storage_once(code):
    kinds = {"K": KEEP, "S": SWAP, "R": RECOMPUTE}
    plan = Plan(blocks=tuple(kinds[c] for c in code), min_swap_bytes=4096)
    shared = build_schedule(plan, _profile()).peak_bytes
    alone = build_schedule(plan, Profile(blocks=tuple(b.__class__(**{**b.__dict__, "shared": ()}) for b in _profile().blocks),
                                         min_swap_bytes=4096)).peak_bytes
    saved = sum(a.kept for a in shared_adjustments(plan, _profile()))
    assert shared <= alone
    if code in ("KK", "KR"):
        assert alone - shared == MiB == saved  # both blocks' bytes are alive at the backward's start


def test_shared_storages_round_trip_and_refuse_corruption():
    prof = _profile()
    assert Profile.from_json(prof.to_json()) == prof
    data = prof.to_dict()
    data["blocks"][1]["shared"] = [{"id": 0, "nbytes": MiB, "dtype": "float32", "saved": True}]
    with pytest.raises(ProfileError, match="corrupt shared storage"):
        Profile.from_dict(data)
    data["blocks"][1]["shared"] = [{"id": -1, "nbytes": MiB, "dtype": "float32", "saved": True, "input": False}]
    with pytest.raises(ProfileError, match="id"):
        Profile.from_dict(data)
