"""The codec table is the one place that says what compresses and into how many bytes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ooc.scheduler import BlockPlan, BlockProfile, Plan, Profile, ProfileError, preset
from ooc.scheduler.analytic import gpt2_xl, transformer, wide_resnet
from ooc.scheduler.codecs import CODECS, SWAP_GROUP_SIZE, codec_spec, nominal_ratio, swapped_nbytes, unsupported
from ooc.scheduler.costmodel import CODEC_OPTIONS
from ooc.scheduler.plan import Codec, Policy
from ooc.scheduler.simulate import predict

PROFILES = Path(__file__).resolve().parents[2] / "profiles"


def test_the_cost_model_considers_every_codec_in_the_table() -> None:
    assert {b.codec for b in CODEC_OPTIONS} == set(CODECS)
    for codec in CODECS:
        options = [(b.policy, b.swap_input) for b in CODEC_OPTIONS if b.codec is codec]
        assert sorted(options) == sorted([(Policy.SWAP, False), (Policy.RECOMPUTE, True)])


def test_every_codec_but_none_has_an_entry() -> None:
    assert set(CODECS) == set(Codec) - {Codec.NONE}
    assert all(spec.codec is codec for codec, spec in CODECS.items())


# Codes per value plus one 4-byte scale per 64 values, over the input's bytes per value.
FP32 = {"none": 1.0, "int8": (1 + 4 / 64) / 4, "int4": (0.5 + 4 / 64) / 4, "fp8": (1 + 4 / 64) / 4}
TWO_BYTE = {"none": 1.0, "int8": (1 + 4 / 64) / 2, "int4": (0.5 + 4 / 64) / 2, "fp8": (1 + 4 / 64) / 2}


@pytest.mark.parametrize("codec", sorted(FP32))
def test_nominal_ratios_follow_from_bits_groups_and_the_inputs_bytes_per_value(codec: str) -> None:
    assert nominal_ratio(codec, "float32") == FP32[codec]
    assert FP32["int8"] == 0.25 + 4 / 256 and FP32["int4"] == 0.125 + 4 / 256  # the ratios charged before dtypes counted
    assert nominal_ratio(codec, "bfloat16") == nominal_ratio(codec, "torch.float16") == TWO_BYTE[codec]
    assert nominal_ratio(codec, None) == TWO_BYTE[codec]  # not known: the largest, never fewer bytes than a run's
    assert nominal_ratio(codec, "float64") == nominal_ratio(codec, "int64") == 1.0  # moved as they are


@pytest.mark.parametrize("codec", [c.value for c in CODECS])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", None])
def test_a_profile_without_bytes_for_a_codec_is_charged_its_ratio_on_the_blocks_dtype(codec: str, dtype: str | None) -> None:
    block = BlockProfile("b", 1e-3, 2e-3, 1000, 800, 300, 200, 300, 0, 0, activation_dtype=dtype)
    ratio = FP32[codec] if dtype == "float32" else TWO_BYTE[codec]
    assert block.compressed_bytes(codec, inputs=False) == (int(800 * ratio), 0)
    assert block.compressed_bytes(codec, inputs=True) == (int(200 * ratio), 0)


@pytest.mark.parametrize("codec", [c.value for c in CODECS])
def test_analytic_blocks_name_their_activations_dtype_for_the_codecs_ratio(codec: str) -> None:
    """A bf16 activation holds half an fp32 one's bytes but as many codes and scales: int8 keeps
    0.531 of its bytes, not fp32's 0.266. An analytic block records each codec's bytes (NOTE
    [analytic codec bytes]); without them, it is charged the ratio on the dtype it names."""
    hw = preset("h100-sxm")
    on_disk = Profile.load(PROFILES / "analytic-h100-sxm-gpt2-xl-s1024.json")
    fp32 = transformer(name="t", layers=2, hidden=64, heads=2, seq=32, batch=2, vocab=100, hardware=hw, bytes_per_value=4)
    for prof, dtype, ratio in ((gpt2_xl(1024, 8, hw), "bfloat16", TWO_BYTE), (on_disk, "bfloat16", TWO_BYTE),
                               (fp32, "float32", FP32), (wide_resnet(batch=8, hardware=hw), "float32", FP32)):
        block = dataclasses.replace(prof.blocks[0], compressed=())
        assert block.activation_dtype == dtype
        assert block.compressed_bytes(codec, inputs=False) == (int(block.swappable_bytes * ratio[codec]), 0)
        assert block.compressed_bytes(codec, inputs=True) == (int(block.input_swappable_bytes * ratio[codec]), 0)
    with pytest.raises(ValueError, match="bytes_per_value must be one of"):
        transformer(name="t", layers=2, hidden=64, heads=2, seq=32, batch=2, vocab=100, hardware=hw, bytes_per_value=1)


def test_an_fp32_measured_profile_predicts_as_before() -> None:
    """Pinned from the code before activations' dtypes counted: the same bytes, step time and peak."""
    prof = Profile.load(PROFILES / "measured-cpu-gpt-tiny.json")
    hw, n = preset("v100-16gb"), len(prof)
    assert {b.activation_dtype for b in prof.blocks} == {"float32"} and not any(b.compressed for b in prof.blocks)
    assert prof.blocks[0].compressed_bytes("int8", inputs=False) == (3347776, 0)
    assert prof.blocks[0].compressed_bytes("int4", inputs=True) == (73728, 0)
    swap = predict(Plan.of([BlockPlan("swap", codec="int8")] * n), prof, hw)
    assert (swap.step_time_s, swap.peak_bytes) == (float.fromhex("0x1.df8c783251080p-4"), 19298944)
    recompute = predict(Plan.of([BlockPlan("recompute", swap_input=True, codec="int4")] * n), prof, hw)
    assert (recompute.step_time_s, recompute.peak_bytes) == (float.fromhex("0x1.5d6bfba57eb5fp-3"), 13275136)


def test_a_profile_file_without_activation_dtype_is_charged_the_2_byte_ratio() -> None:
    """Profiles from before the field: their dtype is not known, so a codec is charged its largest
    ratio (a plan then never holds more codes than predicted; an fp32 one is over-charged)."""
    data = json.loads((PROFILES / "measured-cpu-gpt-tiny.json").read_text())
    for block in data["blocks"]:
        del block["activation_dtype"]
    block = Profile.from_dict(data).blocks[0]
    assert block.activation_dtype is None
    assert block.compressed_bytes("int8", inputs=False) == (int(block.swappable_bytes * TWO_BYTE["int8"]), 0)


@pytest.mark.parametrize("dtype", ["bf16", "float64", 2])
def test_an_activation_dtype_a_codec_does_not_know_is_refused(dtype: object) -> None:
    block = BlockProfile("b", 1e-3, 2e-3, 1000, 800, 300, 200, 300, 0, 0)
    with pytest.raises(ProfileError, match="activation_dtype"):
        dataclasses.replace(block, activation_dtype=dtype)


@pytest.mark.parametrize(("elements", "int8", "int4"), [(1, 4 + 1, 4 + 1), (7, 4 + 7, 4 + 4), (64, 4 + 64, 4 + 32),
                                                         (65, 8 + 65, 8 + 33), (4097, 4 * 65 + 4097, 4 * 65 + 2049)])
def test_encoded_bytes_are_codes_plus_one_fp32_scale_per_group(elements: int, int8: int, int4: int) -> None:
    assert SWAP_GROUP_SIZE == 64
    assert codec_spec("int8").encoded_nbytes(elements) == codec_spec("fp8").encoded_nbytes(elements) == int8
    assert codec_spec("int4").encoded_nbytes(elements) == int4


def test_what_compresses() -> None:
    int8 = codec_spec(Codec.INT8)
    assert int8.storage_nbytes(4 * 65, "float32") == 8 + 65
    assert int8.storage_nbytes(2 * 65, "bfloat16") == int8.storage_nbytes(2 * 65, "torch.float16") == 8 + 65
    for dtype in ("int64", "bool", "float64", "uint8"):
        assert not int8.compresses(4096, dtype)
        assert int8.storage_nbytes(4096, dtype) == 4096
    assert int8.storage_nbytes(4 * 65 + 2, "float32") == 4 * 65 + 2  # not whole values: moved as it is
    assert swapped_nbytes("none", 4096, "float32") == 4096


def test_fp8_needs_sm_89() -> None:
    fp8 = codec_spec(Codec.FP8)
    assert fp8.supported(None) and fp8.supported((8, 9)) and fp8.supported((9, 0))
    assert not fp8.supported((8, 0))
    assert unsupported([Codec.NONE, Codec.INT8, Codec.FP8, Codec.FP8], (8, 0)) == [fp8]
    assert unsupported(list(Codec), (9, 0)) == unsupported(list(Codec), None) == []
