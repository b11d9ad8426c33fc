"""Numbers and flags enter planning from users and JSON files; a bad one raises an error naming the
field where it enters. NaN or infinity would otherwise pass every ``< 0`` check and make the
simulator loop forever (comparisons with NaN are all false, so its clock never advances), so each
case here asserts the constructor raises: no planner or simulation runs on the bad value."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from ooc.scheduler import (
    PLANNERS,
    BlockPlan,
    BlockProfile,
    Hardware,
    HardwareError,
    OocError,
    Plan,
    PlanError,
    Profile,
    ProfileError,
    SizeError,
    parse_bytes,
    plan_with_streaming,
    preset,
)

NAN, INF = math.nan, math.inf


def _profile() -> Profile:
    blocks = tuple(BlockProfile(f"b{i}", 1e-3, 2e-3, 4096, 4096, 512, 512, 512, 1024, 1024) for i in range(3))
    return Profile(blocks, outside_forward_s=1e-4)


def _through_json(data: dict) -> str:
    """What a file holding ``data`` reads back as: Python's json writes NaN and Infinity literals."""
    return json.dumps(data)


@pytest.mark.parametrize(
    "field, value",
    [("forward_s", NAN), ("forward_s", INF), ("backward_s", -INF), ("backward_s", "2e-3"), ("saved_bytes", NAN),
     ("saved_bytes", 1.5), ("input_bytes", "512"), ("param_bytes", INF), ("swappable_storages", True), ("name", 3)],
    ids=str,
)
def test_a_bad_block_number_in_a_profile_json_is_refused(field: str, value: object) -> None:
    data = _profile().to_dict()
    data["blocks"][1][field] = value
    with pytest.raises(ProfileError, match=f"{field}.*ooc profile"):
        Profile.from_json(_through_json(data))


@pytest.mark.parametrize(
    "field, value",
    [("outside_forward_s", NAN), ("outside_backward_s", INF), ("min_swap_bytes", 4096.5), ("min_swap_bytes", NAN),
     ("outside_param_bytes", "0"), ("model", None), ("machine", ["host"])],
    ids=str,
)
def test_a_bad_profile_field_is_refused(field: str, value: object) -> None:
    data = _profile().to_dict()
    data[field] = value
    with pytest.raises(ProfileError, match=f"{field}.*ooc profile"):
        Profile.from_json(_through_json(data))


@pytest.mark.parametrize("blocks", ["b0", [1, 2], None])
def test_profile_blocks_must_be_a_list_of_objects(blocks: object) -> None:
    data = _profile().to_dict()
    data["blocks"] = blocks
    with pytest.raises(ProfileError, match="blocks"):
        Profile.from_json(_through_json(data))


def test_a_bad_number_is_refused_when_a_profile_is_built_in_python() -> None:
    block = _profile().blocks[0]
    with pytest.raises(ProfileError, match="forward_s"):
        replace(block, forward_s=NAN)
    with pytest.raises(ProfileError, match="outside_backward_s"):
        replace(_profile(), outside_backward_s=INF)


@pytest.mark.parametrize(
    "field, value",
    [("h2d", INF), ("d2h_duplex", NAN), ("compute_slowdown", NAN), ("compute_slowdown", INF), ("copy_latency_s", NAN),
     ("host_contention", INF), ("net", NAN), ("flops", -INF), ("device_memory", 1.5), ("device_memory", INF),
     ("h2d", "9e9"), ("copy_issue_s", None), ("name", 7)],
    ids=str,
)
def test_a_bad_hardware_number_is_refused(field: str, value: object) -> None:
    data = preset("cpu").to_dict()
    data[field] = value
    with pytest.raises(HardwareError, match=f"{field}.*ooc calibrate"):
        Hardware.from_dict(json.loads(_through_json(data)))


def test_presets_and_valid_files_still_load() -> None:
    for hardware in (preset(name) for name in ("v100-16gb", "a100-40gb", "h100-sxm", "h200", "cpu")):
        assert Hardware.from_dict(json.loads(hardware.to_json())) == hardware
    assert Profile.from_json(_profile().to_json()) == _profile()
    plan = Plan.of([BlockPlan("recompute", swap_input=True), BlockPlan("swap", saved_bytes=10, device_bytes=0), "keep"])
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize(
    "field, value",
    [("swap_input", "false"), ("swap_input", "true"), ("swap_input", 1), ("swap_input", None),
     ("saved_bytes", "12"), ("saved_bytes", NAN), ("device_bytes", -1), ("device_bytes", 1.5),
     ("policy", "teleport"), ("codec", "int3"), ("params", "everywhere")],
    ids=str,
)
def test_a_bad_block_field_in_a_plan_json_is_refused(field: str, value: object) -> None:
    data = Plan.uniform("recompute", 3).to_dict()
    data["blocks"][1][field] = value
    with pytest.raises(PlanError, match=f"corrupt plan JSON: {field}.*ooc plan"):
        Plan.from_json(_through_json(data))


@pytest.mark.parametrize(
    "field, value",
    [("prefetch", 2.0), ("prefetch", "2"), ("min_swap_bytes", NAN), ("min_swap_bytes", "4096"), ("name", 1),
     ("blocks", "keep"), ("meta", [1])],
    ids=str,
)
def test_a_bad_plan_field_is_refused(field: str, value: object) -> None:
    data = Plan.uniform("keep", 2).to_dict()
    data[field] = value
    with pytest.raises(PlanError, match=f"corrupt plan JSON.*{field}"):
        Plan.from_json(_through_json(data))


def test_swap_input_must_be_a_bool_in_python_too() -> None:
    with pytest.raises(PlanError, match="swap_input must be true or false"):
        BlockPlan("recompute", swap_input="false")


@pytest.mark.parametrize("budget", [INF, NAN, -INF, "inf", "nan", "9" * 400], ids=lambda b: str(b)[:8])
def test_a_budget_that_is_not_a_finite_byte_count_names_the_budget(budget: object) -> None:
    with pytest.raises(SizeError, match="budget") as info:
        parse_bytes(budget)
    assert isinstance(info.value, ValueError) and isinstance(info.value, OocError)


@pytest.mark.parametrize("name", ["greedy", "karma", "optimal"])
@pytest.mark.parametrize("budget", [INF, NAN, -1.0, "1GiB"], ids=str)
def test_planners_refuse_a_budget_that_is_not_a_finite_byte_count(name: str, budget: object) -> None:
    with pytest.raises(SizeError, match="the budget"):
        PLANNERS[name](_profile(), preset("cpu"), budget)


@pytest.mark.parametrize("budget", [INF, NAN], ids=str)
def test_planning_with_streaming_refuses_a_budget_that_is_not_finite(budget: float) -> None:
    with pytest.raises(SizeError, match="the budget"):
        plan_with_streaming(_profile(), preset("cpu"), budget, PLANNERS["optimal"])


@pytest.mark.parametrize("load, given, says", [
    (lambda d: Profile.from_dict(d), {"format": "ooc.plan"}, "not an ooc profile: this JSON is an ooc plan (from `ooc plan --out`)"),
    (lambda d: Plan.from_dict(d), {"format": "ooc.profile"}, "not an ooc plan: this JSON is an ooc profile (from `ooc profile --out`)"),
    (lambda d: Hardware.from_dict(d), {"format": "ooc.plan"}, "not an ooc hardware description: this JSON is an ooc plan"),
    (lambda d: Plan.from_dict(d), {"format": "ooc.plann"}, "its \"format\" is 'ooc.plann', not 'ooc.plan'"),
    (lambda d: Profile.from_dict(d), [], "the JSON has no \"format\": \"ooc.profile\" field; an ooc profile comes from `ooc profile --out`"),
], ids=["plan-as-profile", "profile-as-plan", "plan-as-hardware", "misspelt-format", "no-format"])
def test_a_json_of_another_kind_is_named(load, given, says) -> None:  # noqa: ANN001
    """A plan passed to --profile said only that the JSON had no "format": "ooc.profile" field."""
    with pytest.raises(OocError) as info:
        load(given)
    assert says in str(info.value)
