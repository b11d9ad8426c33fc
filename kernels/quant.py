"""Per-group absmax quantization to int8 / int4 / fp8 in Triton, and dequantization.

Anatomy: ``@triton.jit`` kernels -> launchers that validate and pick block sizes -> public
``quantize`` / ``dequantize``. The spec and CPU path is ``quant_reference.py``; on CUDA tensors the
launcher runs Triton, elsewhere the reference; ``OOC_KERNELS=triton`` forces Triton (the interpreter
on CPU, with ``TRITON_INTERPRET=1`` set before this module is imported) and ``OOC_KERNELS=reference``
forces torch.
"""

from __future__ import annotations

import contextlib
import numbers
import os

import torch
import triton
import triton.language as tl

from ooc.kernels.capability import CODECS, check_codec
from ooc.kernels.quant_reference import (
    FLOAT_INPUTS,
    FP8,
    MAX_SCALE,
    MIN_SCALE,
    QMAX,
    Quantized,
    as_rows,
    torch_dequantize,
    torch_quantize,
)

# Groups per program: 32 groups of 64 values is a 2048-element tile, which keeps the interpreter's
# per-program cost low (PLATFORM.md: cost is per program) and gives each GPU program 8 KiB of fp32
# input to stream; tuned for the interpreter, not yet measured on a GPU.
GROUPS_PER_PROGRAM = 32
NUM_WARPS = 4
"""Warps per program of the four kernels (Triton's default); ``benchmarks/sweep_quant.py`` times others."""


@triton.jit
def _uniform(index, seed):
    """murmur3's finaliser on uint32 (``quant_reference.hash_uniform``)."""
    h = index.to(tl.uint32) * 0x9E3779B1 + seed.to(tl.uint32)
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _group_tile(pid, cols, groups_per_row, total, GROUP: tl.constexpr, GPP: tl.constexpr):
    """This program's GPP whole groups: group ids, liveness, row offsets, columns and their mask.
    Each group is GROUP contiguous columns of one row, so loads and stores of a tile vectorize."""
    g = pid.to(tl.int64) * GPP + tl.arange(0, GPP)  # int64: a row may hold 2^31 elements or more
    live = g < total
    col = (g % groups_per_row)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    base = (g // groups_per_row)[:, None] * cols
    return g, live, base, col, live[:, None] & (col < cols)


@triton.jit
def _packed_tile(g, live, packed_cols, groups_per_row, GROUP: tl.constexpr):
    """int4 bytes of the same groups: byte k of a group holds columns 2k (low nibble) and 2k+1
    (high); offsets into the (rows, packed_cols = ceil(cols / 2)) codes and their mask. packed_cols
    is an argument, not computed, so the JIT sees when it is 16-divisible and vectorizes."""
    pcol = (g % groups_per_row)[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
    return (g // groups_per_row)[:, None] * packed_cols + pcol, live[:, None] & (pcol < packed_cols)


# MIN_SCALE is an fp32 subnormal, and Triton types a Python float below 2^-126 as fp64: the kernels
# build it from its bits.
MIN_SCALE_BITS = tl.constexpr(int(torch.tensor(MIN_SCALE, dtype=torch.float32).view(torch.int32)))


@triton.jit
def _group_scale(amax, DIVISOR: tl.constexpr, MAX_SCALE: tl.constexpr):
    """(GPP,) scales of groups of absmax ``amax``: ``amax / DIVISOR`` (IEEE) held between MIN_SCALE
    (NOTE [smallest scale]) and MAX_SCALE (NOTE [largest scale]); 0 for an all-zero group."""
    # div_rn, not fdiv(ieee_rounding=True): Triton 3.7 ignores that flag and emits approximate division.
    low = tl.full(amax.shape, MIN_SCALE_BITS, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(amax > 0, tl.minimum(tl.maximum(tl.div_rn(amax, DIVISOR), low), MAX_SCALE), 0.0)


@triton.jit
def _finite_absmax(x):
    """(GPP,) per row of the (GPP, N) tile ``x``: how many values are NaN or Inf, and the absmax of
    the others."""
    finite = tl.abs(x) < float("inf")  # false for NaN and Inf
    return tl.sum(tl.where(finite, 0, 1), axis=1), tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1)


@triton.jit
def _int_codes(v, inv, index, seed, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """int32 codes of values ``v`` times their group's reciprocal ``inv`` (NOTE [one division per
    group]): rounded to nearest, or up with probability the remainder from the hash of element ``index``."""
    v = v * inv
    if STOCHASTIC:
        v = v + _uniform(index, seed)
    else:
        v = v + 0.5
    return tl.minimum(tl.maximum(tl.floor(v), -QMAX * 1.0), QMAX * 1.0).to(tl.int32)


@triton.jit
def _count_nonfinite(flag_ptr, bad):
    """NOTE [the NaN/Inf count in the kernel]
    Adds this program's count of groups holding NaN or Inf (``bad``: (GPP,) values per group) to the
    caller's 1-element flag. Counted by ``isnan(scales).sum()`` and ``flag.add_`` after the kernel, it
    was three more launches per call, whose host time outlasted the kernel: the swap engine's int8
    encode ran at 0.51 of the D2D copy's bandwidth with the flag and 0.97 with it counted here (H200,
    256 MiB, 20 calls queued). The atomic is masked off in a program without such a group, so a
    finite input issues none."""
    n = tl.sum((bad > 0).to(tl.int32), axis=0)
    tl.atomic_add(flag_ptr, n.to(flag_ptr.dtype.element_ty), mask=n > 0)


# The JIT turns an int argument equal to 1 into a constant (and ``seed.to`` then fails to compile):
# the seed is a runtime value, never specialised.
@triton.jit(do_not_specialize=["seed"])
def _quantize_int_kernel(
    x_ptr, codes_ptr, scales_ptr, flag_ptr, total, cols, packed_cols, groups_per_row, seed,
    QMAX: tl.constexpr, MAX_SCALE: tl.constexpr, GROUP: tl.constexpr, GPP: tl.constexpr, PACK4: tl.constexpr,
    STOCHASTIC: tl.constexpr, FLAG: tl.constexpr,
):
    g, live, base, col, m = _group_tile(tl.program_id(0), cols, groups_per_row, total, GROUP, GPP)
    x = tl.load(x_ptr + base + col, mask=m, other=0.0).to(tl.float32)
    bad, amax = _finite_absmax(x)
    scale = _group_scale(amax, QMAX * 1.0, MAX_SCALE)
    safe = tl.where(scale > 0, scale, 1.0)
    # NOTE [one division per group]: the reciprocal, correctly rounded, then a multiply per value.
    q = _int_codes(x, tl.div_rn(tl.zeros_like(safe) + 1.0, safe)[:, None], base + col, seed, QMAX, STOCHASTIC)
    tl.store(scales_ptr + g, tl.where(bad > 0, float("nan"), scale), mask=live)
    if PACK4:
        even, odd = tl.split(tl.reshape(q, (GPP, GROUP // 2, 2)))
        offsets, pm = _packed_tile(g, live, packed_cols, groups_per_row, GROUP)
        tl.store(codes_ptr + offsets, ((even & 0xF) | ((odd & 0xF) << 4)).to(tl.uint8), mask=pm)
    else:
        tl.store(codes_ptr + base + col, q.to(tl.int8), mask=m)
    if FLAG:
        _count_nonfinite(flag_ptr, bad)


# NOTE [int4 from pairs]
# The general int kernel packs int4 by reshaping its (GPP, GROUP) tile of codes to (GPP, GROUP // 2, 2)
# and splitting it, and Triton moves the tile through shared memory to do that (six barriers, four
# times the reductions' shuffles): 0.63-0.65 of the D2D copy's bandwidth on an H200 whatever the
# tile (groups per program 8-128, warps 1-8). A row of even length is read instead as pairs of
# values, an int64 per fp32 pair or an int32 per 16-bit pair (little-endian: the low half is the even
# column), split into the two values by bits; every value, code and offset then stays in one
# (GPP, GROUP // 2) tile and the byte of codes is stored where the pair was read: 0.96 of the copy
# (fp32, 256 MiB, 20 calls queued), codes and scales equal to the general kernel's bit for bit.
PAIR_SOURCES = {torch.float32: (torch.int64, 0), torch.float16: (torch.int32, 1), torch.bfloat16: (torch.int32, 2)}
"""Input dtype -> (the integer dtype holding two of its values, the kernel's SOURCE code)."""


@triton.jit
def _pair_values(v, SOURCE: tl.constexpr):
    """The even and odd columns' values (fp32) of an int64 (SOURCE 0: fp32) or int32 (1: fp16, 2: bf16) pair."""
    if SOURCE == 0:
        even = v.to(tl.int32).to(tl.float32, bitcast=True)
        odd = (v >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    elif SOURCE == 1:
        even = v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        odd = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        even = v.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
        odd = (v >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    return even, odd


@triton.jit(do_not_specialize=["seed"])
def _quantize_int4_pairs_kernel(
    pairs_ptr, codes_ptr, scales_ptr, flag_ptr, total, packed_cols, groups_per_row, seed,
    QMAX: tl.constexpr, MAX_SCALE: tl.constexpr, GROUP: tl.constexpr, GPP: tl.constexpr, SOURCE: tl.constexpr,
    STOCHASTIC: tl.constexpr, FLAG: tl.constexpr,
):
    """NOTE [int4 from pairs]: rows of even length; ``pairs_ptr`` is the (rows, packed_cols) input
    read as pairs, ``codes_ptr`` the (rows, packed_cols) bytes of codes at the same offsets."""
    g = tl.program_id(0).to(tl.int64) * GPP + tl.arange(0, GPP)
    live = g < total
    pcol = (g % groups_per_row)[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
    offsets = (g // groups_per_row)[:, None] * packed_cols + pcol
    m = live[:, None] & (pcol < packed_cols)
    even, odd = _pair_values(tl.load(pairs_ptr + offsets, mask=m, other=0), SOURCE)
    bad_even, amax_even = _finite_absmax(even)
    bad_odd, amax_odd = _finite_absmax(odd)
    bad = bad_even + bad_odd
    scale = _group_scale(tl.maximum(amax_even, amax_odd), QMAX * 1.0, MAX_SCALE)
    safe = tl.where(scale > 0, scale, 1.0)
    inv = tl.div_rn(tl.zeros_like(safe) + 1.0, safe)[:, None]  # NOTE [one division per group]
    low = _int_codes(even, inv, 2 * offsets, seed, QMAX, STOCHASTIC)  # element index 2k of pair k (cols = 2 * packed_cols)
    high = _int_codes(odd, inv, 2 * offsets + 1, seed, QMAX, STOCHASTIC)
    tl.store(scales_ptr + g, tl.where(bad > 0, float("nan"), scale), mask=live)
    tl.store(codes_ptr + offsets, ((low & 0xF) | ((high & 0xF) << 4)).to(tl.uint8), mask=m)
    if FLAG:
        _count_nonfinite(flag_ptr, bad)


@triton.jit
def _dequantize_int_kernel(
    codes_ptr, scales_ptr, out_ptr, total, cols, packed_cols, groups_per_row,
    GROUP: tl.constexpr, GPP: tl.constexpr, PACK4: tl.constexpr,
):
    g, live, base, col, m = _group_tile(tl.program_id(0), cols, groups_per_row, total, GROUP, GPP)
    scale = tl.load(scales_ptr + g, mask=live, other=0.0)
    if PACK4:
        offsets, pm = _packed_tile(g, live, packed_cols, groups_per_row, GROUP)
        byte = tl.load(codes_ptr + offsets, mask=pm, other=0).to(tl.int32)
        lo = byte & 0xF
        hi = (byte >> 4) & 0xF
        q = tl.reshape(tl.join(tl.where(lo > 7, lo - 16, lo), tl.where(hi > 7, hi - 16, hi)), (GPP, GROUP)).to(tl.float32)
    else:
        q = tl.load(codes_ptr + base + col, mask=m, other=0).to(tl.float32)
    tl.store(out_ptr + base + col, (q * scale[:, None]).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _quantize_fp8_kernel(x_ptr, codes_ptr, scales_ptr, flag_ptr, total, cols, groups_per_row, FP8_MAX: tl.constexpr,
                         GROUP: tl.constexpr, GPP: tl.constexpr, FLAG: tl.constexpr):
    g, live, base, col, m = _group_tile(tl.program_id(0), cols, groups_per_row, total, GROUP, GPP)
    x = tl.load(x_ptr + base + col, mask=m, other=0.0).to(tl.float32)
    bad, amax = _finite_absmax(x)
    scale = _group_scale(amax, FP8_MAX, float("inf"))
    safe = tl.where(scale > 0, scale, 1.0)
    v = x * tl.div_rn(tl.zeros_like(safe) + 1.0, safe)[:, None]  # NOTE [one division per group]
    tl.store(codes_ptr + base + col, v.to(codes_ptr.dtype.element_ty), mask=m)
    tl.store(scales_ptr + g, tl.where(bad > 0, float("nan"), scale), mask=live)
    if FLAG:
        _count_nonfinite(flag_ptr, bad)


@triton.jit
def _dequantize_fp8_kernel(codes_ptr, scales_ptr, out_ptr, total, cols, groups_per_row, GROUP: tl.constexpr, GPP: tl.constexpr):
    g, live, base, col, m = _group_tile(tl.program_id(0), cols, groups_per_row, total, GROUP, GPP)
    v = tl.load(codes_ptr + base + col, mask=m, other=0.0).to(tl.float32)
    scale = tl.load(scales_ptr + g, mask=live, other=0.0)
    tl.store(out_ptr + base + col, (v * scale[:, None]).to(out_ptr.dtype.element_ty), mask=m)


def use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA tensors, the reference elsewhere, unless ``OOC_KERNELS`` says otherwise."""
    choice = os.environ.get("OOC_KERNELS", "auto")
    if choice not in ("auto", "triton", "reference"):
        raise ValueError(f"OOC_KERNELS must be auto, triton or reference, got {choice!r}")
    if choice == "reference":
        return False
    if choice == "triton":
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "OOC_KERNELS=triton on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                "before ooc.kernels is imported"
            )
        return True
    return x.is_cuda


def launch_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """The context a Triton launch on ``t`` runs in: ``t``'s CUDA device made current.

    NOTE [Triton launches on the current device]
    Triton launches on ``torch.cuda.current_device()``'s current stream, whatever device the tensors
    are on. A model on cuda:1 in a thread whose current device is cuda:0 (``model.to("cuda:1")``
    without ``torch.cuda.set_device``) had its codes written by a kernel on cuda:0: an illegal address
    without peer access, and otherwise a kernel on a stream that neither the producer of its input
    (cuda:1's stream) nor the copy out of its codes waits for. PyTorch's own ops run on the current
    stream of their tensors' device, which this makes the launch's too.
    """
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``; None elsewhere (the interpreter runs every codec)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def _check_device_runs(codec: str, device: torch.device) -> None:
    capability = device_capability(device)
    if capability is not None:
        check_codec(codec, capability)


def _check_group_size(group_size: int) -> None:
    if not isinstance(group_size, numbers.Integral) or not 32 <= group_size <= 256 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two from 32 to 256, got {group_size}")


def quantize(x: torch.Tensor, *, bits: int = 8, group_size: int = 64, stochastic: bool = False, seed: int | None = None,
             codec: str | None = None, check_finite: bool = True, nonfinite_flag: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> Quantized:
    """Quantize ``x`` (any shape; fp32, fp16 or bf16) per group of ``group_size`` values along its last
    dimension. ``bits`` 8 or 4, or ``codec`` one of ``int8``, ``int4``, ``fp8_e4m3``, ``fp8_e5m2``.
    ``stochastic=True`` rounds up with probability equal to the remainder (unbiased), reproducibly
    from ``seed``. Raises ``ValueError`` if ``x`` holds NaN or Inf (found from the group scales), and
    :class:`~ooc.kernels.capability.UnsupportedCodecError` (a ``ValueError``) if the device cannot run
    ``codec`` (fp8_e4m3 below compute capability 8.9).

    The NaN/Inf check reads the scales back to the host: one device sync per call. A caller that
    quantizes many tensors per step passes ``check_finite=False`` and ``nonfinite_flag``, a 1-element
    int32/int64 tensor on ``x``'s device to which the count of non-finite groups is added on the device
    (by the kernel itself under Triton), and reads it once per step (a group holding NaN or Inf gets a
    NaN scale).

    ``out``: a contiguous 1-D ``uint8`` tensor of :func:`encoded_nbytes` bytes on ``x``'s device, starting
    a multiple of 4 bytes into its storage; the scales (fp32, first) and then the codes are written into
    it, and the result's ``scales`` and ``codes`` are views of it (on GPUs the kernel writes there
    directly: no second copy of the codes).

    Returns a :class:`Quantized`: codes (int8 (rows, cols); int4 packed (rows, ceil(cols/2)) uint8;
    fp8 (rows, cols)), fp32 scales (rows, ceil(cols/group_size)), and the shape and dtype of ``x``.
    """
    codec = codec or {8: "int8", 4: "int4"}.get(bits)
    if codec not in CODECS:
        raise ValueError(f"bits must be 8 or 4, or codec one of {CODECS}; got bits={bits}, codec={codec!r}")
    if x.dtype not in FLOAT_INPUTS:
        raise TypeError(f"quantize takes fp32, fp16 or bf16 tensors, got {x.dtype}")
    _check_group_size(group_size)
    if stochastic and codec not in ("int8", "int4"):
        raise ValueError("stochastic rounding applies to int8 and int4 codecs")
    if stochastic and seed is None:
        raise ValueError("stochastic=True needs seed=<int> so the rounding is reproducible")
    if nonfinite_flag is not None and (nonfinite_flag.numel() != 1 or nonfinite_flag.device != x.device
                                       or nonfinite_flag.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"nonfinite_flag must be a 1-element int32 or int64 tensor on {x.device}, e.g. "
                         f"torch.zeros(1, dtype=torch.int64, device={str(x.device)!r})")
    seed = int(seed or 0) & 0xFFFFFFFF
    if x.numel() == 0:
        raise ValueError("quantize got an empty tensor")
    views = None if out is None else _out_views(out, x, codec, group_size)
    if use_triton(x):
        _check_device_runs(codec, x.device)
        with launch_device(x):
            q = _quantize_triton(x, codec, group_size, stochastic, seed, views, nonfinite_flag)
    else:
        q = torch_quantize(x, codec=codec, group_size=group_size, stochastic=stochastic, seed=seed)
        if views is not None:
            q = Quantized(views[0].copy_(q.codes), views[1].copy_(q.scales), q.shape, q.dtype, q.codec, q.group_size)
        if nonfinite_flag is not None:
            nonfinite_flag.add_(nonfinite_groups(q))
    if not check_finite:
        return q
    # One flag per group, so the check reads 1/group_size of the input's bytes; int() syncs.
    bad = int(nonfinite_groups(q))
    if bad:
        raise ValueError(f"quantize: {bad} group(s) of the input hold NaN or Inf; a swapped activation "
                         "must be finite (check the loss scale, or keep this tensor uncompressed)")
    return q


def _layout(x: torch.Tensor, codec: str, group_size: int) -> tuple[tuple[int, int], torch.dtype, tuple[int, int]]:
    """Shape and dtype of the codes, and shape of the scales, that quantizing ``x`` gives."""
    cols = x.shape[-1] if x.dim() else 1
    rows = x.numel() // cols
    groups = -(-cols // group_size)
    if codec in FP8:
        return (rows, cols), FP8[codec][0], (rows, groups)
    if codec == "int4":
        return (rows, (cols + 1) // 2), torch.uint8, (rows, groups)
    return (rows, cols), torch.int8, (rows, groups)


def encoded_nbytes(x: torch.Tensor, *, codec: str, group_size: int) -> int:
    """Bytes of the scales and codes of ``x`` quantized with ``codec``: the size of ``quantize``'s ``out``."""
    codes_shape, codes_dtype, scales_shape = _layout(x, codec, group_size)
    itemsize = torch.empty(0, dtype=codes_dtype).element_size()
    return 4 * scales_shape[0] * scales_shape[1] + itemsize * codes_shape[0] * codes_shape[1]


def _out_views(out: torch.Tensor, x: torch.Tensor, codec: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) as views of ``out``: scales first, codes after them."""
    nbytes = encoded_nbytes(x, codec=codec, group_size=group_size)
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous() or out.numel() != nbytes or out.device != x.device:
        raise ValueError(f"out must be a contiguous 1-D uint8 tensor of {nbytes} bytes on {x.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if out.storage_offset() % 4:  # the fp32 scales come first
        raise ValueError(f"out must start a multiple of 4 bytes into its storage (the fp32 scales come first), got "
                         f"{out.storage_offset()}: slice a byte arena at an offset divisible by 4")
    codes_shape, codes_dtype, scales_shape = _layout(x, codec, group_size)
    scale_bytes = 4 * scales_shape[0] * scales_shape[1]
    return out[scale_bytes:].view(codes_dtype).view(codes_shape), out[:scale_bytes].view(torch.float32).view(scales_shape)


def nonfinite_groups(q: Quantized) -> torch.Tensor:
    """How many groups of the quantized input held NaN or Inf: a 0-dim int64 tensor on the scales'
    device, computed without a host sync."""
    return torch.isnan(q.scales).sum()


def _quantize_triton(x: torch.Tensor, codec: str, group_size: int, stochastic: bool, seed: int,
                     views: tuple[torch.Tensor, torch.Tensor] | None = None, flag: torch.Tensor | None = None) -> Quantized:
    """The kernels' launch; ``flag``, if given, gets the count of non-finite groups added in the
    kernel (NOTE [the NaN/Inf count in the kernel])."""
    x2 = as_rows(x)
    rows, cols = x2.shape
    groups = -(-cols // group_size)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device) if views is None else views[1]
    grid = (triton.cdiv(rows * groups, GROUPS_PER_PROGRAM),)
    flag_ptr = scales if flag is None else flag  # without a flag the kernel never reads its pointer
    if codec in FP8:
        fp8_dtype, fp8_max = FP8[codec]
        codes = torch.empty(rows, cols, dtype=fp8_dtype, device=x.device) if views is None else views[0]
        _quantize_fp8_kernel[grid](x2, codes, scales, flag_ptr, rows * groups, cols, groups, FP8_MAX=fp8_max, GROUP=group_size, GPP=GROUPS_PER_PROGRAM,
                                   FLAG=flag is not None, num_warps=NUM_WARPS, enable_fp_fusion=False)  # NOTE [one division per group]
    else:
        pack4 = codec == "int4"
        qmax = QMAX[4 if pack4 else 8]
        if views is None:
            codes = torch.empty(rows, (cols + 1) // 2 if pack4 else cols, dtype=torch.uint8 if pack4 else torch.int8, device=x.device)
        else:
            codes = views[0]
        pairs = _as_pairs(x2) if pack4 else None
        if pairs is not None:
            _quantize_int4_pairs_kernel[grid](pairs, codes, scales, flag_ptr, rows * groups, cols // 2, groups, seed, QMAX=qmax,
                                              MAX_SCALE=MAX_SCALE[qmax], GROUP=group_size, GPP=GROUPS_PER_PROGRAM,
                                              SOURCE=PAIR_SOURCES[x2.dtype][1], STOCHASTIC=stochastic, FLAG=flag is not None,
                                              num_warps=NUM_WARPS, enable_fp_fusion=False)  # NOTE [one division per group]
            return Quantized(codes, scales, x.shape, x.dtype, codec, group_size)
        _quantize_int_kernel[grid](x2, codes, scales, flag_ptr, rows * groups, cols, (cols + 1) // 2, groups, seed, QMAX=qmax,
                                   MAX_SCALE=MAX_SCALE[qmax], GROUP=group_size, GPP=GROUPS_PER_PROGRAM, PACK4=pack4, STOCHASTIC=stochastic,
                                   FLAG=flag is not None, num_warps=NUM_WARPS, enable_fp_fusion=False)  # NOTE [one division per group]
    return Quantized(codes, scales, x.shape, x.dtype, codec, group_size)


def _as_pairs(x2: torch.Tensor) -> torch.Tensor | None:
    """The (rows, cols) input as (rows, cols / 2) integer pairs (NOTE [int4 from pairs]), or None
    where the row length is odd or the storage offset splits a pair."""
    if x2.shape[1] % 2:
        return None
    try:
        return x2.view(PAIR_SOURCES[x2.dtype][0])
    except RuntimeError:  # an odd storage offset: the view would straddle two pairs
        return None


def dequantize(q: Quantized, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor ``q`` came from, to within the codec's error: ``q.shape``, ``q.dtype``. ``out``, if
    given, must be a contiguous tensor of that shape and dtype on the codes' device."""
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous() or out.device != q.codes.device):
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)} on {q.codes.device}")
    if not use_triton(q.codes):
        result = torch_dequantize(q)
        if out is None:
            return result
        return out.copy_(result)
    _check_device_runs(q.codec, q.codes.device)
    rows, groups = q.scales.shape
    cols = q.cols
    result = out if out is not None else torch.empty(q.shape, dtype=q.dtype, device=q.codes.device)
    grid = (triton.cdiv(rows * groups, GROUPS_PER_PROGRAM),)
    with launch_device(result):  # NOTE [Triton launches on the current device]
        if q.codec in FP8:
            _dequantize_fp8_kernel[grid](q.codes, q.scales, result, rows * groups, cols, groups, GROUP=q.group_size, GPP=GROUPS_PER_PROGRAM, num_warps=NUM_WARPS)
        else:
            _dequantize_int_kernel[grid](q.codes, q.scales, result, rows * groups, cols, (cols + 1) // 2, groups, GROUP=q.group_size, GPP=GROUPS_PER_PROGRAM,
                                         PACK4=q.codec == "int4", num_warps=NUM_WARPS)
    return result
