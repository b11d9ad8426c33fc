"""Which compression codecs a CUDA device can run, from its compute capability: a pure rule, so the
runtime can check a plan's codecs before the first swap and CPU tests can ask it for any device.

fp8 e4m3 (``fp8e4nv``) has hardware conversions from sm_89 (Ada, Hopper) on, and Triton refuses it
below; e5m2 and the integer codecs compile for sm_80 (the compile lane checks both).
"""

from __future__ import annotations

CODECS = ("int8", "int4", "fp8_e4m3", "fp8_e5m2")

# codec -> lowest (major, minor) compute capability whose Triton kernels compile and run
MIN_CAPABILITY = {"int8": (8, 0), "int4": (8, 0), "fp8_e5m2": (8, 0), "fp8_e4m3": (8, 9)}


class UnsupportedCodecError(ValueError):
    """A codec the device cannot run; the message names the codecs it can."""


def codec_supported(codec: str, capability: tuple[int, int]) -> bool:
    """Whether ``codec`` runs on a device of compute ``capability`` (major, minor)."""
    if codec not in MIN_CAPABILITY:
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
    return tuple(capability) >= MIN_CAPABILITY[codec]


def supported_codecs(capability: tuple[int, int]) -> tuple[str, ...]:
    """The codecs a device of compute ``capability`` runs, in ``CODECS`` order."""
    return tuple(c for c in CODECS if codec_supported(c, capability))


def check_codec(codec: str, capability: tuple[int, int]) -> None:
    """Raise :class:`UnsupportedCodecError` if ``codec`` does not run at ``capability``."""
    if codec_supported(codec, capability):
        return
    need, have = MIN_CAPABILITY[codec], tuple(capability)
    usable = supported_codecs(have)
    advice = f"use {', '.join(usable[:-1])} or {usable[-1]}" if len(usable) > 1 else (
        f"use {usable[0]}" if usable else "keep this tensor uncompressed")
    raise UnsupportedCodecError(
        f"{codec} needs compute capability {need[0]}.{need[1]}+ (this device: {have[0]}.{have[1]}); {advice}"
    )
