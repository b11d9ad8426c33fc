from __future__ import annotations

import json

import pytest

from ooc.scheduler import BlockPlan, Plan, PlanError, Policy, format_bytes, parse_bytes
from ooc.scheduler.plan import op_signature


def test_json_round_trip() -> None:
    plan = Plan(
        blocks=(BlockPlan("keep"), BlockPlan("swap", codec="int8"), BlockPlan("recompute", swap_input=True)),
        prefetch=3,
        min_swap_bytes=512,
        name="mine",
    )
    assert Plan.from_json(plan.to_json()) == plan


def test_a_selective_block_keeps_its_op_signature_through_json() -> None:
    signature = op_signature(["aten.mm.default", "aten.tanh.default"])
    plan = Plan(blocks=(BlockPlan("recompute", cached_ops=(0,), op_signature=signature), BlockPlan("keep")))
    data = plan.to_dict()
    assert data["blocks"][0]["op_signature"] == signature and "op_signature" not in data["blocks"][1]
    assert Plan.from_json(plan.to_json()) == plan


def test_op_signature_is_the_ops_in_order() -> None:
    assert op_signature(["aten.mm.default", "aten.tanh.default"]) != op_signature(["aten.tanh.default", "aten.mm.default"])
    assert op_signature(["aten.mm.default"]) == op_signature(iter(["aten.mm.default"]))
    with pytest.raises(PlanError, match="op_signature must be 16 hex digits"):
        BlockPlan("recompute", cached_ops=(0,), op_signature="not a digest")


def test_table_shows_each_block() -> None:
    plan = Plan(blocks=(BlockPlan("keep", saved_bytes=2048, device_bytes=2048), BlockPlan("recompute")))
    text = str(plan)
    assert "keep" in text and "recompute" in text and "2.00 KiB" in text
    assert plan.table(["layer.a", "layer.b"]).count("layer.") == 2


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(version=99), "newer than this ooc"),
        (lambda d: d.update(format="x"), "not an ooc plan"),
        (lambda d: d["blocks"][0].update(policy="teleport"), "corrupt plan"),
        (lambda d: d.pop("blocks"), "corrupt plan"),
        # A misspelt key was dropped without a word: a plan meant to swap inputs ran without.
        (lambda d: d["blocks"][0].update(swap_inputs=True), r"unknown fields \['swap_inputs'\]"),
        (lambda d: d.update(version=-1), "version.*>= 1"),
        (lambda d: d.update(version=True), "version.*>= 1"),
    ],
)
def test_bad_json(mutate, message) -> None:
    data = Plan.uniform("keep", 2).to_dict()
    mutate(data)
    with pytest.raises(PlanError, match=message):
        Plan.from_json(json.dumps(data))


def test_not_json() -> None:
    with pytest.raises(PlanError, match="corrupt"):
        Plan.from_json("{nope")


def test_validation() -> None:
    with pytest.raises(PlanError):
        Plan(blocks=())
    with pytest.raises(PlanError, match="prefetch"):
        Plan.uniform("keep", 2, prefetch=-1)
    with pytest.raises(PlanError, match="swap_input"):
        BlockPlan("keep", swap_input=True)
    with pytest.raises(PlanError, match="codec"):
        BlockPlan("keep", codec="int8")
    with pytest.raises(ValueError):
        BlockPlan("nonsense")
    assert Plan.of(["keep", Policy.SWAP]).policies == (Policy.KEEP, Policy.SWAP)


@pytest.mark.parametrize("text, expected", [("20GiB", 20 * 2**30), ("1.5 GB", 1_500_000_000), ("512", 512), (4096, 4096), ("3MiB", 3 * 2**20)])
def test_parse_bytes(text, expected) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["20 GiBs", "lots", "-3", True])
def test_parse_bytes_rejects(text) -> None:
    with pytest.raises((ValueError, TypeError)):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["0.5", 0.5, "0.4 B"])
def test_a_fraction_is_not_read_as_zero_bytes(text) -> None:
    """``--budget 0.5`` meant as half: it read as 0 bytes, and the error said no plan fits 0 B."""
    with pytest.raises(ValueError, match="not a fraction"):
        parse_bytes(text, what="the budget")


@pytest.mark.parametrize("text", ["1.5", "2.5 B", "1000000000.5"])
def test_a_size_without_a_unit_is_a_whole_number_of_bytes(text) -> None:
    """``--budget 1.5`` read as 1 byte, which nothing fits, and only the first backward said so."""
    with pytest.raises(ValueError, match="whole number of bytes"):
        parse_bytes(text, what="the budget")
    # A unit, or a float computed in code (half of some bytes), rounds down as before.
    assert parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes(1e9 + 0.5) == 1_000_000_000


def test_format_bytes() -> None:
    assert format_bytes(100) == "100 B"
    assert format_bytes(1536) == "1.50 KiB"
