"""The codecs a swapped storage may be compressed with: one table, read by the runtime (what it
compresses, and into how many bytes), the profiler (the bytes it records per codec), the profile
(nominal ratios on its activations' dtype where it recorded none) and the cost model (the options the
planner considers).

Adding a codec is one entry in ``CODECS`` (plus its ``Codec`` member and its kernel in
``ooc.kernels.quant``); the byte counts of the prediction and of the run then agree by construction.
Pure arithmetic: no torch, so a dtype is named by its string (``"float32"``; a ``torch.dtype`` is
accepted too, through its ``str``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ooc.scheduler.plan import Codec

SWAP_GROUP_SIZE = 64
"""Values per fp32 scale when a swapped storage is compressed (the kernels' default group)."""

SCALE_BYTES = 4
"""One fp32 scale per group."""

FLOAT_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
"""Bytes per value of the dtypes a codec may take; anything else (ints, bools, fp64) moves as it is."""


def dtype_name(dtype: object) -> str:
    """``"float32"`` for ``torch.float32`` or ``"float32"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CodecSpec:
    """One lossy codec: how it is launched, how many bytes it makes, what it takes, where it runs.

    A storage of ``n`` values is encoded per group of ``SWAP_GROUP_SIZE`` values into
    ``ceil(n * bits / 8)`` bytes of codes and ``ceil(n / SWAP_GROUP_SIZE)`` fp32 scales.
    """

    codec: Codec
    kernel: str
    """The codec's name in ``ooc.kernels.quant.quantize(codec=...)``."""
    bits: int
    """Bits per value in the codes."""
    dtypes: frozenset[str] = frozenset(FLOAT_ITEMSIZE)
    """Dtypes (by name) it compresses; a storage of another dtype is swapped as it is."""
    min_cuda_capability: tuple[int, int] | None = None
    """The oldest CUDA compute capability whose kernels it runs on; ``None``: any GPU (and the CPU)."""

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"codec {self.codec.value}: bits must be 4 or 8, got {self.bits}")
        if not self.dtypes <= set(FLOAT_ITEMSIZE):
            raise ValueError(f"codec {self.codec.value}: dtypes must be among {sorted(FLOAT_ITEMSIZE)}")

    def encoded_nbytes(self, elements: int) -> int:
        """Bytes of the codes and scales of ``elements`` values (scales first in the runtime's buffer)."""
        scales = SCALE_BYTES * -(-elements // SWAP_GROUP_SIZE)
        codes = -(-elements * self.bits // 8)
        return scales + codes

    def compresses(self, nbytes: int, dtype: object) -> bool:
        """Whether a storage of ``nbytes`` viewed as ``dtype`` is encoded: a dtype it takes, holding
        whole values."""
        name = dtype_name(dtype)
        return name in self.dtypes and nbytes % FLOAT_ITEMSIZE[name] == 0

    def storage_nbytes(self, nbytes: int, dtype: object) -> int:
        """Device/host bytes of one swapped storage of ``nbytes`` viewed as ``dtype`` (``nbytes`` if it
        does not compress)."""
        if not self.compresses(nbytes, dtype):
            return nbytes
        return self.encoded_nbytes(nbytes // FLOAT_ITEMSIZE[dtype_name(dtype)])

    def ratio(self, dtype: object) -> float:
        """Encoded over raw bytes for whole groups of ``dtype`` values: the codes' bytes per value plus
        one fp32 scale per group, over the dtype's bytes per value (int8 keeps 0.266 of fp32's bytes
        and 0.531 of bf16's or fp16's: the codes shrink with the input, the scales do not); 1.0 for a
        dtype it does not compress."""
        name = dtype_name(dtype)
        if name not in self.dtypes:
            return 1.0
        return self.encoded_nbytes(SWAP_GROUP_SIZE) / (SWAP_GROUP_SIZE * FLOAT_ITEMSIZE[name])

    def supported(self, cuda_capability: tuple[int, int] | None) -> bool:
        """Whether it runs on a GPU of this compute capability (``None``: not a CUDA device)."""
        return cuda_capability is None or self.min_cuda_capability is None or cuda_capability >= self.min_cuda_capability


CODECS: dict[Codec, CodecSpec] = {
    spec.codec: spec
    for spec in (
        CodecSpec(Codec.INT8, kernel="int8", bits=8),
        CodecSpec(Codec.INT4, kernel="int4", bits=4),
        # e4m3 arithmetic is in hardware from Ada/Hopper (sm_89) on.
        CodecSpec(Codec.FP8, kernel="fp8_e4m3", bits=8, min_cuda_capability=(8, 9)),
    )
}
"""Every lossy codec, in the order the planner considers them. ``Codec.NONE`` has no entry."""


CODEC_ERROR_BOUND = 0.02
"""The largest gradient error a codec may cause on one block for the planner to give it that codec:
the relative L2 distance of the block's input and parameter gradients from the exact ones, measured
by the profiler (NOTE [codec error] in ``ooc.codec_error``). Measured on the CPU: int8 moves a
transformer block's gradients by 0.5% and fp8 by 1.6%, int4 by 8%; int8 on the BatchNorm blocks of a
ResNet-18 at 32x32 moves them by 4-13%. ``optimal(max_codec_error=...)`` sets another bound."""


def codec_error_name(codec: Codec | str, *, recompute: bool = False) -> str:
    """The name a codec's measured gradient error has in a profile (``BlockProfile.codec_error``):
    ``int8`` for a SWAP whose saved tensors go through it, ``int8:recompute`` for a RECOMPUTE whose
    swapped input goes through it and whose re-run then starts from the dequantized input (NOTE [codec
    error] in ``ooc.codec_error``)."""
    name = Codec(codec).value
    return f"{name}:recompute" if recompute else name


def codec_spec(codec: Codec | str) -> CodecSpec:
    """The table's entry for ``codec`` (a ``Codec`` or its value); ``KeyError`` for ``none``."""
    return CODECS[Codec(codec)]


def swapped_nbytes(codec: Codec | str, nbytes: int, dtype: object) -> int:
    """Bytes one swapped storage of ``nbytes`` viewed as ``dtype`` occupies under ``codec``."""
    codec = Codec(codec)
    return nbytes if codec is Codec.NONE else CODECS[codec].storage_nbytes(nbytes, dtype)


def swapped_sizes(codec: Codec | str, storages: Iterable[tuple[int, object]]) -> tuple[int, int]:
    """Bytes the storages (``(nbytes, dtype)`` each) occupy once swapped under ``codec``, and the
    largest compressed one's (what decoding it adds as the block's backward starts; 0 where none
    compresses): a profile's ``BlockProfile.compressed`` entry for them."""
    spec = codec_spec(codec)
    total = largest = 0
    for nbytes, dtype in storages:
        size = spec.storage_nbytes(nbytes, dtype)
        total += size
        if spec.compresses(nbytes, dtype):  # only compressed storages are decoded
            largest = max(largest, size)
    return total, largest


def nominal_ratio(codec: Codec | str, dtype: object | None) -> float:
    """Encoded over raw bytes of ``dtype`` values under ``codec`` (``CodecSpec.ratio``; 1.0 for
    ``none``); ``dtype=None``: not known, the largest ratio among the dtypes the codec takes (that of
    2-byte values), which no floating-point storage's codes exceed."""
    codec = Codec(codec)
    if codec is Codec.NONE:
        return 1.0
    spec = CODECS[codec]
    return max(spec.ratio(d) for d in spec.dtypes) if dtype is None else spec.ratio(dtype)


def unsupported(codecs: object, cuda_capability: tuple[int, int] | None) -> list[CodecSpec]:
    """The entries among ``codecs`` (an iterable of ``Codec``) that do not run on this device."""
    return [CODECS[c] for c in dict.fromkeys(codecs) if c is not Codec.NONE and not CODECS[c].supported(cuda_capability)]
