"""Bytes a swapped storage occupies under each codec (codes + fp32 scales, one group of
``SWAP_GROUP_SIZE`` values per scale): pure arithmetic shared by the profiler, the schedule and the
runtime, so all three count the same bytes."""

from __future__ import annotations

from ooc.scheduler.plan import Codec

SWAP_GROUP_SIZE = 64
"""Values per scale when a swapped storage is compressed (the kernels' default group)."""

KERNEL_CODEC = {Codec.INT8: "int8", Codec.INT4: "int4", Codec.FP8: "fp8_e4m3"}
COMPRESSIBLE_ELEMENT_SIZES = {2, 4}
"""fp16/bf16 and fp32 storages compress; anything else (ints, bools, fp64) is moved as it is."""


def compressed_nbytes(nbytes: int, element_size: int, is_floating: bool, codec: Codec) -> int:
    """Device/host bytes of one storage of ``nbytes`` under ``codec`` (``nbytes`` if it does not compress)."""
    if codec is Codec.NONE or not is_floating or element_size not in COMPRESSIBLE_ELEMENT_SIZES or nbytes % element_size:
        return nbytes
    elements = nbytes // element_size
    scales = 4 * -(-elements // SWAP_GROUP_SIZE)
    codes = -(-elements // 2) if codec is Codec.INT4 else elements
    return scales + codes
