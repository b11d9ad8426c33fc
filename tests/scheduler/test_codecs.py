"""The codec table is the one place that says what compresses and into how many bytes."""

from __future__ import annotations

import pytest

from ooc.scheduler import BlockProfile
from ooc.scheduler.codecs import CODECS, SWAP_GROUP_SIZE, codec_spec, nominal_ratio, swapped_nbytes, unsupported
from ooc.scheduler.costmodel import CODEC_OPTIONS
from ooc.scheduler.plan import Codec, Policy


def test_the_cost_model_considers_every_codec_in_the_table() -> None:
    assert {b.codec for b in CODEC_OPTIONS} == set(CODECS)
    for codec in CODECS:
        options = [(b.policy, b.swap_input) for b in CODEC_OPTIONS if b.codec is codec]
        assert sorted(options) == sorted([(Policy.SWAP, False), (Policy.RECOMPUTE, True)])


def test_every_codec_but_none_has_an_entry() -> None:
    assert set(CODECS) == set(Codec) - {Codec.NONE}
    assert all(spec.codec is codec for codec, spec in CODECS.items())


@pytest.mark.parametrize(("codec", "ratio"), [("none", 1.0), ("int8", 0.25 + 4 / 256), ("int4", 0.125 + 4 / 256),
                                              ("fp8", 0.25 + 4 / 256)])
def test_nominal_ratios_follow_from_bits_and_groups(codec: str, ratio: float) -> None:
    assert nominal_ratio(codec) == ratio


@pytest.mark.parametrize("codec", [c.value for c in CODECS])
def test_a_profile_without_bytes_for_a_codec_is_charged_its_nominal_ratio(codec: str) -> None:
    block = BlockProfile("b", 1e-3, 2e-3, 1000, 800, 300, 200, 300, 0, 0)
    assert block.compressed_bytes(codec, inputs=False) == (int(800 * nominal_ratio(codec)), 0)
    assert block.compressed_bytes(codec, inputs=True) == (int(200 * nominal_ratio(codec)), 0)


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
