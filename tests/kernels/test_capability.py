"""Which codecs a device runs, from its compute capability: the pure rule, and the launchers'
clear error (instead of Triton's at first use) on a device that lacks a codec."""

from __future__ import annotations

import os

import pytest
import torch

from ooc.kernels import quant
from ooc.kernels.capability import UnsupportedCodecError, check_codec, codec_supported, supported_codecs
from ooc.kernels.quant_reference import torch_quantize
from tests.conftest import HAS_GPU


@pytest.mark.parametrize(
    "capability, codecs",
    [
        ((7, 5), ()),
        ((8, 0), ("int8", "int4", "fp8_e5m2")),
        ((8, 6), ("int8", "int4", "fp8_e5m2")),
        ((8, 9), ("int8", "int4", "fp8_e4m3", "fp8_e5m2")),
        ((9, 0), ("int8", "int4", "fp8_e4m3", "fp8_e5m2")),
        ((10, 0), ("int8", "int4", "fp8_e4m3", "fp8_e5m2")),
    ],
    ids=lambda v: ".".join(map(str, v)) if v and isinstance(v[0], int) else None,
)
def test_supported_codecs_by_capability(capability, codecs) -> None:
    assert supported_codecs(capability) == codecs
    assert all(codec_supported(c, capability) == (c in codecs) for c in ("int8", "int4", "fp8_e4m3", "fp8_e5m2"))


def test_the_error_names_what_the_device_can_run() -> None:
    with pytest.raises(UnsupportedCodecError, match=r"fp8_e4m3 needs compute capability 8\.9\+ \(this device: 8\.0\); "
                                                      r"use int8, int4 or fp8_e5m2"):
        check_codec("fp8_e4m3", (8, 0))
    assert issubclass(UnsupportedCodecError, ValueError)
    check_codec("fp8_e4m3", (9, 0))
    with pytest.raises(ValueError, match="codec must be one of"):
        codec_supported("int2", (9, 0))


@pytest.mark.skipif(not HAS_GPU and os.environ.get("TRITON_INTERPRET") != "1", reason="Triton needs a GPU or TRITON_INTERPRET=1")
def test_launchers_refuse_fp8_e4m3_on_an_sm80_device(monkeypatch) -> None:
    # The Triton path asks the device's capability before launching; an A100 (8.0) is faked here.
    monkeypatch.setenv("OOC_KERNELS", "triton")
    monkeypatch.setattr(quant, "device_capability", lambda device: (8, 0))
    x = torch.randn(2, 64)
    with pytest.raises(UnsupportedCodecError, match="fp8_e4m3 needs compute capability 8.9"):
        quant.quantize(x, codec="fp8_e4m3")
    with pytest.raises(UnsupportedCodecError, match="fp8_e4m3 needs compute capability 8.9"):
        quant.dequantize(torch_quantize(x, codec="fp8_e4m3"))
    assert quant.quantize(x, codec="fp8_e5m2").codec == "fp8_e5m2"
    assert quant.quantize(x, codec="int8").codec == "int8"
