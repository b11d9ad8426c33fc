"""The op-level profile and the selective-recompute plan field: round trips and bad input."""

import pytest

from ooc.scheduler.errors import PlanError, ProfileError
from ooc.scheduler.plan import BlockPlan, Plan, Policy
from ooc.scheduler.profile import BlockProfile, OpProfile, Profile


def _block(ops):
    return BlockProfile(name="b0", forward_s=1e-3, backward_s=2e-3, saved_bytes=4096, swappable_bytes=4096,
                        input_bytes=1024, input_swappable_bytes=1024, output_bytes=1024, param_bytes=0,
                        grad_bytes=0, ops=ops)


def test_op_profile_round_trips_through_json():
    ops = (OpProfile("aten.mm", 5e-4, 2048, 2048), OpProfile("aten.native_dropout", 1e-4, 3072, 1024, cacheable=False),
           OpProfile("aten.t", 0.0, 0))
    profile = Profile(blocks=(_block(ops),))
    again = Profile.from_json(profile.to_json())
    assert again == profile
    assert again.blocks[0].ops[1] == OpProfile("aten.native_dropout", 1e-4, 3072, 1024, cacheable=False)


@pytest.mark.parametrize("op, message", [
    ({"name": "aten.mm", "forward_s": 1e-3}, "corrupt op"),
    ({"name": "aten.mm", "forward_s": 1e-3, "output_bytes": 10, "flops": 3}, "corrupt op"),
    ({"name": "aten.mm", "forward_s": -1.0, "output_bytes": 10}, "forward_s"),
    ({"name": "aten.mm", "forward_s": 1e-3, "output_bytes": 10, "saved_bytes": 11}, "saved_bytes exceeds"),
    ({"name": "aten.mm", "forward_s": 1e-3, "output_bytes": 10, "cacheable": "yes"}, "cacheable"),
    ("aten.mm", "must be an object"),
], ids=["missing", "unknown", "negative", "saved>output", "flag", "not-an-object"])
def test_a_corrupt_op_is_a_profile_error(op, message):
    data = Profile(blocks=(_block(()),)).to_dict()
    data["blocks"][0]["ops"] = [op]
    with pytest.raises(ProfileError, match=message):
        Profile.from_dict(data)


def test_cached_ops_round_trip_and_label():
    plan = Plan.of([BlockPlan(Policy.RECOMPUTE, cached_ops=(0, 3)), "keep"])
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.blocks[0].cached_ops == (0, 3)
    assert "cache 2 ops" in plan.blocks[0].label()
    assert Plan.from_dict({**plan.to_dict(), "blocks": [{"policy": "keep"}]}).blocks[0].cached_ops == ()


@pytest.mark.parametrize("kwargs, message", [
    ({"policy": Policy.KEEP, "cached_ops": (1,)}, "only applies to RECOMPUTE"),
    ({"policy": Policy.RECOMPUTE, "cached_ops": (3, 1)}, "increasing"),
    ({"policy": Policy.RECOMPUTE, "cached_ops": (1, 1)}, "increasing"),
    ({"policy": Policy.RECOMPUTE, "cached_ops": (-1,)}, "cached op index"),
    ({"policy": Policy.RECOMPUTE, "cached_ops": "0,1"}, "sequence of op indices"),
], ids=["keep", "unsorted", "repeat", "negative", "string"])
def test_bad_cached_ops_are_plan_errors(kwargs, message):
    with pytest.raises(PlanError, match=message):
        BlockPlan(**kwargs)
