"""Plain-torch reference of per-group absmax quantization: the specification the Triton kernels in
``quant.py`` match bit for bit, and the CPU path.

Layout: ``x`` is viewed as (rows, cols) with cols its last dimension; each row is cut into groups of
``group_size`` columns (the last one may be short). Per group:

    scale = clamp(absmax / QMAX, MIN_SCALE, MAX_SCALE[QMAX])   (fp32, IEEE division; 0 for an all-zero group)
    q     = clamp(floor(x / scale + r), -QMAX, QMAX)   r = 0.5, or a uniform draw (stochastic)
    x'    = q * scale

int8 codes are (rows, cols) int8; int4 codes pack two per byte, column 2k in the low nibble and 2k+1
in the high one: (rows, ceil(cols / 2)) uint8. fp8 codes are ``x / scale`` cast to e4m3 or e5m2 with
``scale = max(absmax / FP8_MAX, MIN_SCALE)``. A group holding NaN or Inf gets a NaN scale; the launcher raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QMAX = {8: 127, 4: 7}


def _max_scale(qmax: int) -> float:
    """The largest fp32 scale whose ``qmax`` multiple is finite in fp32.

    NOTE [largest scale]
    ``FLT_MAX / 127`` rounds up, and ``127 * scale`` then overflows: a group holding -FLT_MAX (the mask
    value of fp32 attention masks, ``torch.finfo(torch.float32).min``) came back -inf. Capped one ulp
    lower, the value dequantizes to within two ulps of FLT_MAX; groups below the cap are unchanged.
    """
    scale = torch.tensor(torch.finfo(torch.float32).max, dtype=torch.float32) / qmax
    while not torch.isfinite(scale * qmax):
        scale = torch.nextafter(scale, torch.zeros((), dtype=torch.float32))
    return float(scale)


MAX_SCALE = {qmax: _max_scale(qmax) for qmax in QMAX.values()}


def _min_scale() -> float:
    """The smallest fp32 scale whose reciprocal is finite in fp32.

    NOTE [smallest scale]
    Values are multiplied by the reciprocal of their group's scale (NOTE [one division per group]).
    For an absmax below QMAX * 2^-128 (FP8_MAX * 2^-128 for fp8) the scale's reciprocal is inf: the
    group's zeros became 0 * inf = NaN before rounding, and every other value a saturated code, so
    an fp8 group of finite values (zeros and one 1e-37) came back NaN and inf, with no NaN scale to
    count it, and int codes were off by the whole absmax. A nonzero scale is raised to this floor;
    the codes then stay below QMAX (FP8_MAX), and groups above it are unchanged.
    """
    one = torch.ones((), dtype=torch.float32)
    scale = one / torch.finfo(torch.float32).max
    while not torch.isfinite(one / scale):
        scale = torch.nextafter(scale, one)
    return float(scale)


MIN_SCALE = _min_scale()
FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}
FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Quantized:
    """Codes, per-group fp32 scales, and what ``dequantize`` needs to restore the input."""

    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    codec: str
    """``int8``, ``int4``, ``fp8_e4m3`` or ``fp8_e5m2``."""
    group_size: int

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    @property
    def cols(self) -> int:
        return self.shape[-1] if len(self.shape) else 1


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous (rows, cols) view; a scalar is one row of one column."""
    x = x.contiguous()
    return x.reshape(1, 1) if x.dim() == 0 else x.reshape(-1, x.shape[-1])


def hash_uniform(index: torch.Tensor, seed: int) -> torch.Tensor:
    """Uniform [0, 1) fp32 draws from int64 element indices: murmur3's 32-bit finaliser of
    ``index * golden + seed``, top 24 bits. Cheap, counter-based, identical in Triton."""
    mask = 0xFFFFFFFF
    h = (index * 0x9E3779B1 + (seed & mask)) & mask
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & mask
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & mask
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float32) * (1.0 / 16777216.0)


def _groups(x2: torch.Tensor, group_size: int) -> torch.Tensor:
    rows, cols = x2.shape
    groups = -(-cols // group_size)
    padded = torch.zeros(rows, groups * group_size, dtype=torch.float32, device=x2.device)
    padded[:, :cols] = x2.float()
    return padded.view(rows, groups, group_size)


def torch_quantize(x: torch.Tensor, *, codec: str = "int8", group_size: int = 64, stochastic: bool = False, seed: int = 0) -> Quantized:
    x2 = as_rows(x)
    rows, cols = x2.shape
    g = _groups(x2, group_size)
    finite = torch.isfinite(g)
    absmax = torch.where(finite, g.abs(), torch.zeros((), device=g.device)).amax(-1)
    bad = (~finite).any(-1)
    if codec in FP8:
        fp8_dtype, fp8_max = FP8[codec]
        scale = torch.where(absmax > 0, torch.clamp(absmax / fp8_max, min=MIN_SCALE), 0.0)  # NOTE [smallest scale]
        safe = torch.where(scale > 0, scale, torch.ones((), device=g.device))
        codes = (g * (1.0 / safe)[..., None]).to(fp8_dtype).view(rows, -1)[:, :cols].contiguous()
        scale = torch.where(bad, torch.full((), float("nan"), device=g.device), scale)
        return Quantized(codes, scale, x.shape, x.dtype, codec, group_size)
    qmax = QMAX[{"int8": 8, "int4": 4}[codec]]
    # NOTE [largest scale], NOTE [smallest scale]; 0 for an all-zero group
    scale = torch.where(absmax > 0, torch.clamp(absmax / float(qmax), min=MIN_SCALE, max=MAX_SCALE[qmax]), 0.0)
    safe = torch.where(scale > 0, scale, torch.ones((), device=g.device))
    # NOTE [one division per group]: the kernels divide once per group and multiply each value by
    # the reciprocal; the two roundings are IEEE's here and there (the kernels are compiled without
    # fused multiply-adds), so codes match bit for bit. A division per value was suspected of keeping
    # quantize at a third of the copy's bandwidth on an H200; the third came from how it was timed
    # (a sync per call), and with calls queued this kernel reached 0.97 of the copy there. The
    # division per value was never timed that way.
    v = g * (1.0 / safe)[..., None]
    if stochastic:
        col = torch.arange(g.shape[1] * group_size, device=g.device).view(1, g.shape[1], group_size)
        row = torch.arange(rows, device=g.device).view(rows, 1, 1)
        r = hash_uniform(row * cols + col, seed)
    else:
        r = 0.5
    q = torch.clamp(torch.floor(v + r), -qmax, qmax).view(rows, -1)[:, :cols]
    scale = torch.where(bad, torch.full((), float("nan"), device=g.device), scale)
    if codec == "int8":
        codes = q.to(torch.int8).contiguous()
    else:
        nibbles = q.to(torch.int32) & 0xF
        if cols % 2:
            nibbles = torch.cat([nibbles, torch.zeros(rows, 1, dtype=torch.int32, device=g.device)], dim=1)
        codes = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8)
    return Quantized(codes, scale.contiguous(), x.shape, x.dtype, codec, group_size)


def torch_dequantize(q: Quantized) -> torch.Tensor:
    rows = q.scales.shape[0]
    cols = q.cols
    if q.codec in FP8:
        values = q.codes.float()
    elif q.codec == "int8":
        values = q.codes.float()
    else:
        low = (q.codes & 0xF).to(torch.int32)
        high = (q.codes >> 4).to(torch.int32)
        low = torch.where(low > 7, low - 16, low)
        high = torch.where(high > 7, high - 16, high)
        values = torch.stack([low, high], dim=-1).view(rows, -1)[:, :cols].float()
    scale = q.scales.repeat_interleave(q.group_size, dim=1)[:, :cols]
    return (values * scale).to(q.dtype).view(q.shape)
