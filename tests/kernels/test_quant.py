"""Quantization kernels: the torch reference's properties, and Triton (interpreter on CPU) against
it bit for bit on codes and scales."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch
import triton
import triton.language as tl

from ooc.kernels.quant import _group_tile, _packed_tile, dequantize, encoded_nbytes, quantize
from ooc.kernels.quant_reference import QMAX, hash_uniform, torch_dequantize, torch_quantize
from tests.conftest import HAS_GPU
from tests.helpers import stable_seed

needs_interpreter = pytest.mark.skipif(
    not HAS_GPU and os.environ.get("TRITON_INTERPRET") != "1", reason="Triton needs a GPU or TRITON_INTERPRET=1"
)

SHAPES = [(1,), (7,), (3, 63), (2, 4097), (4, 64), (2, 3, 33), (5, 130)]  # int4 reads even rows as pairs (NOTE [int4 from pairs])


@pytest.fixture()
def kernels(monkeypatch):
    def use(choice: str) -> None:
        monkeypatch.setenv("OOC_KERNELS", choice)
    return use


# reference lane -----------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("group_size", [32, 64, 256])
def test_round_to_nearest_error_is_at_most_half_a_step(codec: str, group_size: int) -> None:
    x = torch.randn(8, 1000) * torch.logspace(-3, 3, 8)[:, None]
    q = torch_quantize(x, codec=codec, group_size=group_size)
    restored = torch_dequantize(q)
    step = q.scales.repeat_interleave(group_size, dim=1)[:, :1000]
    # analytic bound: half a step, plus the fp32 rounding of x/scale and q*scale (a few ulps of x)
    assert torch.all((x - restored).abs() <= step / 2 + x.abs() * 2**-22)


def test_stochastic_rounding_is_unbiased() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 256)
    draws = torch.stack([torch_dequantize(torch_quantize(x, codec="int4", stochastic=True, seed=s)) for s in range(2000)])
    step = torch_quantize(x, codec="int4").scales.repeat_interleave(64, dim=1)
    # Each draw rounds up with probability f (the remainder): its error in steps is a Bernoulli
    # variable with variance f(1-f) <= 1/4, so the mean of 2000 draws has sigma <= 0.5 / sqrt(2000).
    sigma = 0.5 / 2000**0.5
    signed = (draws.mean(0) - x) / step
    assert signed.abs().max() < 4.5 * sigma  # per element (256 of them)
    assert signed.mean().abs() < 4.5 * sigma / 256**0.5  # no bias across elements either
    # and it is not round-to-nearest: draws differ
    assert (draws != draws[0]).any()


def test_stochastic_rounding_is_reproducible() -> None:
    x = torch.randn(4, 100)
    a = torch_quantize(x, codec="int8", stochastic=True, seed=7)
    b = torch_quantize(x, codec="int8", stochastic=True, seed=7)
    c = torch_quantize(x, codec="int8", stochastic=True, seed=8)
    assert torch.equal(a.codes, b.codes) and not torch.equal(a.codes, c.codes)


def test_hash_uniform_is_in_range_and_flat() -> None:
    u = hash_uniform(torch.arange(100_000), 123)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert counts.min() > 9_000


def test_all_zero_groups_give_zero_scales_and_zeros() -> None:
    x = torch.zeros(3, 130)
    x[1, 70:] = torch.randn(60)
    for codec in ("int8", "int4", "fp8_e4m3"):
        q = torch_quantize(x, codec=codec)
        assert not torch.isnan(q.scales).any()
        assert q.scales[0].eq(0).all() and q.scales[1, 0].item() == 0.0
        restored = torch_dequantize(q)
        assert restored[0].eq(0).all() and restored[2].eq(0).all()


def test_int4_packs_two_codes_per_byte() -> None:
    x = torch.tensor([[7.0, -7.0, 1.0, -1.0, 0.0]])
    q = torch_quantize(x, codec="int4", group_size=32)
    assert q.codes.shape == (1, 3) and q.codes.dtype == torch.uint8
    assert q.codes[0].tolist() == [(7 & 0xF) | ((-7 & 0xF) << 4), 1 | ((-1 & 0xF) << 4), 0]
    assert QMAX[4] == 7


def test_fp8_round_trip_error() -> None:
    x = torch.randn(4, 512)
    q = torch_quantize(x, codec="fp8_e4m3")
    rel = ((torch_dequantize(q) - x).abs() / x.abs().clamp_min(1e-3)).median()
    assert rel < 2**-4  # e4m3 keeps 3 mantissa bits: relative error <= 2^-4


# launcher ---------------------------------------------------------------------------------------


def test_nan_and_inf_raise_with_a_clear_message(kernels) -> None:
    kernels("reference")
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 128)
        x[1, 5] = bad
        with pytest.raises(ValueError, match="1 group.*NaN or Inf"):
            quantize(x)


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Makes every device-to-host read of a tensor value (int(), item(), bool(), tolist()) raise."""
    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("host read of a tensor value")
    with pytest.MonkeyPatch.context() as patch:
        for name in ("__int__", "__index__", "__bool__", "__float__", "item", "tolist"):
            patch.setattr(torch.Tensor, name, refuse)
        yield


@pytest.mark.parametrize("choice", ["reference", pytest.param("triton", marks=needs_interpreter)])
def test_check_finite_false_reads_nothing_back_and_the_flag_counts_on_the_device(kernels, choice) -> None:
    kernels(choice)
    x = torch.randn(3, 130)
    x[0, 3], x[2, 70], x[2, 100] = float("nan"), float("inf"), float("-inf")  # groups (0, 0) and (2, 1) hold them
    clean = torch.randn(2, 64)
    flag = torch.zeros(1, dtype=torch.int64)
    with no_host_reads():
        q = quantize(x, check_finite=False, nonfinite_flag=flag)
        quantize(clean, check_finite=False, nonfinite_flag=flag)
        quantize(x, bits=4, check_finite=False, nonfinite_flag=flag)
        with pytest.raises(AssertionError, match="host read"):
            quantize(clean)  # the default check reads the count back: one sync per call
    assert flag.tolist() == [4]
    assert torch.isnan(q.scales).nonzero().tolist() == [[0, 0], [2, 1]]
    with pytest.raises(ValueError, match="2 group"):
        quantize(x)


def _poisoned_groups() -> torch.Tensor:
    """(64, 256) values: 256 groups of 64, 32 per Triton program, so 8 programs; NaN or Inf in
    groups (0, 0) and (0, 1) (the first program), (20, 3) (the third) and (63, 3) (the last)."""
    x = torch.randn(64, 256)
    x[0, 5], x[0, 64], x[20, 200], x[63, 255] = float("nan"), float("inf"), float("-inf"), float("nan")
    return x


@needs_interpreter
@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("flag_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_triton_counts_nonfinite_groups_in_the_kernel(kernels, monkeypatch, codec, flag_dtype) -> None:
    """NOTE [the NaN/Inf count in the kernel]: each program adds its own count; nothing is launched after."""
    kernels("triton")
    monkeypatch.setattr("ooc.kernels.quant.nonfinite_groups", lambda q: pytest.fail("counted after the kernel"))
    flag = torch.full((1,), 5, dtype=flag_dtype)
    with no_host_reads():
        quantize(_poisoned_groups(), codec=codec, check_finite=False, nonfinite_flag=flag)
        quantize(torch.randn(64, 256), codec=codec, check_finite=False, nonfinite_flag=flag)
    assert flag.tolist() == [5 + 4]


def test_nonfinite_flag_must_be_an_integer_count_on_the_input_device() -> None:
    for flag in (torch.zeros(2, dtype=torch.int64), torch.zeros(1), torch.zeros(1, dtype=torch.bool),
                 torch.zeros(1, dtype=torch.int64, device="meta")):
        with pytest.raises(ValueError, match="nonfinite_flag must be a 1-element int32 or int64 tensor"):
            quantize(torch.randn(2, 64), nonfinite_flag=flag)


@pytest.mark.gpu
def test_cuda_check_finite_false_does_not_synchronize() -> None:
    x = torch.randn(33, 4097, device="cuda")
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        quantize(x, check_finite=False, nonfinite_flag=flag)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(flag) == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(bits=3), "bits must be 8 or 4"),
        (dict(group_size=48), "power of two"),
        (dict(group_size=512), "power of two"),
        (dict(group_size=64.0), "power of two"),  # an int, not a float: it was a bare TypeError from `&`
        (dict(group_size="64"), "power of two"),
        (dict(stochastic=True), "needs seed"),
        (dict(codec="fp8_e4m3", stochastic=True, seed=1), "stochastic rounding applies"),
    ],
)
def test_bad_arguments(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        quantize(torch.randn(4, 64), **kwargs)


def test_bad_dtype_and_empty() -> None:
    with pytest.raises(TypeError, match="fp32, fp16 or bf16"):
        quantize(torch.ones(4, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="empty"):
        quantize(torch.empty(0, 64))


def test_non_contiguous_input_is_quantized_as_its_values(kernels) -> None:
    kernels("reference")
    x = torch.randn(64, 32).t()
    assert torch.equal(quantize(x).codes, quantize(x.contiguous()).codes)


@pytest.mark.parametrize("choice", ["reference", pytest.param("triton", marks=needs_interpreter)])
def test_an_out_not_four_byte_aligned_is_refused_with_a_clear_message(kernels, choice) -> None:
    # The fp32 scales come first in out: a byte arena's slice at an odd offset failed inside torch's
    # dtype view ("storage_offset() must be divisible by 4"), not with quantize's own ValueError.
    kernels(choice)
    x = torch.randn(3, 130)
    n = encoded_nbytes(x, codec="int4", group_size=64)
    arena = torch.zeros(n + 8, dtype=torch.uint8)
    for offset in (1, 2, 3):
        with pytest.raises(ValueError, match="multiple of 4 bytes"):
            quantize(x, codec="int4", out=arena[offset:offset + n])
    q = quantize(x, codec="int4", out=arena[4:4 + n])
    assert q.scales.data_ptr() == arena.data_ptr() + 4


# interpret lane: Triton under TRITON_INTERPRET=1 equals the reference bit for bit ----------------


@needs_interpreter
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_triton_equals_reference(kernels, shape, dtype, codec, stochastic) -> None:
    seed = stable_seed(shape, codec)
    torch.manual_seed(seed)
    x = (torch.randn(shape) * 3).to(dtype)
    kernels("reference")
    ref = quantize(x, codec=codec, stochastic=stochastic, seed=11)
    kernels("triton")
    got = quantize(x, codec=codec, stochastic=stochastic, seed=11)
    assert torch.equal(got.codes, ref.codes), f"seed {seed}"
    assert torch.equal(got.scales, ref.scales), f"seed {seed}"
    out = torch.full(x.shape, float("nan"), dtype=dtype)  # an element the kernel misses stays NaN
    dequantize(got, out=out)
    assert torch.equal(out, torch_dequantize(ref)), f"seed {seed}"


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cols", [130, 63], ids=["pairs", "general"])  # NOTE [int4 from pairs]
def test_triton_writes_scales_then_codes_into_out_as_the_reference(kernels, dtype, cols) -> None:
    x = (torch.randn(5, cols) * 3).to(dtype)
    x[2, 7] = float("nan")
    for codec in ("int8", "int4"):
        kernels("reference")
        ref = quantize(x, codec=codec, stochastic=True, seed=9, check_finite=False)
        kernels("triton")
        out = torch.full((encoded_nbytes(x, codec=codec, group_size=64),), 0xAB, dtype=torch.uint8)  # unwritten bytes stay 0xAB
        flag = torch.zeros(1, dtype=torch.int64)
        got = quantize(x, codec=codec, stochastic=True, seed=9, check_finite=False, nonfinite_flag=flag, out=out)
        scale_bytes = ref.scales.numel() * 4
        assert got.scales.data_ptr() == out.data_ptr() and got.codes.data_ptr() == out.data_ptr() + scale_bytes
        assert torch.equal(out[:scale_bytes], ref.scales.reshape(-1).view(torch.uint8))
        assert torch.equal(out[scale_bytes:], ref.codes.reshape(-1).view(torch.uint8))
        assert flag.item() == 1


@needs_interpreter
def test_triton_all_zero_groups_and_bf16(kernels) -> None:
    x = torch.zeros(2, 200)
    x[1, :64] = torch.randn(64)
    kernels("triton")
    q = quantize(x, codec="int4")
    assert torch.equal(q.scales, torch_quantize(x, codec="int4").scales)
    xb = torch.randn(3, 100).bfloat16()
    got = quantize(xb)
    ref = torch_quantize(xb)
    # bf16 is upcast right after the load, so codes and scales are exact; the bf16 output of the
    # dequantization truncates in the interpreter (its fp32->bf16 cast does not round), so compare
    # it within one bf16 ulp.
    assert torch.equal(got.codes, ref.codes) and torch.equal(got.scales, ref.scales)
    torch.testing.assert_close(dequantize(got).float(), torch_dequantize(ref).float(), rtol=2**-7, atol=0)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_triton_int4_from_pairs_and_from_an_odd_offset_equal_the_reference(kernels, dtype) -> None:
    # NOTE [int4 from pairs]: even rows are read two values at a time; a view at an odd storage
    # offset cannot be, and goes through the general kernel. Both equal the reference bit for bit.
    storage = (torch.randn(1 + 6 * 130) * 3).to(dtype)
    storage[1 + 2 * 130 + 77] = float("nan")  # row 2's second group
    for x in (storage[:-1].view(6, 130), storage[1:].view(6, 130)):
        for stochastic in (False, True):
            kernels("reference")
            ref = quantize(x, codec="int4", stochastic=stochastic, seed=3, check_finite=False)
            kernels("triton")
            got = quantize(x, codec="int4", stochastic=stochastic, seed=3, check_finite=False)
            assert torch.equal(got.codes, ref.codes)
            assert torch.equal(got.scales.nan_to_num(-1.0), ref.scales.nan_to_num(-1.0))


@needs_interpreter
def test_triton_nan_is_reported(kernels) -> None:
    kernels("triton")
    x = torch.randn(2, 64)
    x[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(x)


def test_forcing_triton_on_cpu_without_the_interpreter(kernels, monkeypatch) -> None:
    kernels("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        quantize(torch.randn(2, 64))


# gpu lane ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("cols", [4097, 4096])  # int4: the general kernel, and pairs (NOTE [int4 from pairs])
def test_cuda_equals_reference(codec, cols) -> None:
    x = torch.randn(33, cols, device="cuda")
    got = quantize(x, codec=codec)
    ref = torch_quantize(x.cpu(), codec=codec)
    assert torch.equal(got.codes.cpu(), ref.codes) and torch.equal(got.scales.cpu(), ref.scales)
    assert torch.equal(dequantize(got).cpu(), torch_dequantize(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["int8", "int4", "fp8_e4m3"])
def test_cuda_kernel_counts_nonfinite_groups(codec) -> None:
    if codec == "fp8_e4m3" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89 or newer")
    x = _poisoned_groups().repeat(40, 1).cuda()  # 320 programs, 40 with a NaN or Inf group
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    q = quantize(x, codec=codec, check_finite=False, nonfinite_flag=flag)
    assert int(flag) == int(torch.isnan(q.scales).sum()) == 4 * 40


@pytest.mark.gpu
def test_cuda_fp8_within_reference() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89 or newer")
    x = torch.randn(16, 1024, device="cuda")
    got = dequantize(quantize(x, codec="fp8_e4m3"))
    ref = torch_dequantize(torch_quantize(x.cpu(), codec="fp8_e4m3"))
    torch.testing.assert_close(got.cpu(), ref, rtol=2**-3, atol=0)



@triton.jit
def _offsets_probe(out_ptr, mask_ptr, pid, cols, groups_per_row, total, PACKED: tl.constexpr, WIDTH: tl.constexpr,
                   GROUP: tl.constexpr, GPP: tl.constexpr):
    """Stores the element offsets (base + column) and mask the kernels' tile helper computes for
    program ``pid``, as a (GPP, WIDTH) int64 and int8 tile."""
    g, live, base, col, m = _group_tile(pid, cols, groups_per_row, total, GROUP, GPP)
    if PACKED:
        offsets, m = _packed_tile(g, live, (cols + 1) // 2, groups_per_row, GROUP)
    else:
        offsets = base + col
    i = tl.arange(0, GPP)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    tl.store(out_ptr + i, offsets)
    tl.store(mask_ptr + i, m.to(tl.int8))


@needs_interpreter
@pytest.mark.parametrize("tile", ["elements", "int4_bytes"])
def test_offsets_past_two_to_the_31_do_not_wrap(tile) -> None:
    # One row of 2^31 + 320 elements (2^32 + 320 for int4 bytes, two per byte; a large storage viewed
    # as one row): the offsets of its last groups exceed int32. The kernels' own tile helpers compute
    # them for the last program in the interpreter, which wraps int32 arithmetic as a GPU does; too
    # large to allocate, so only the offsets and the mask are stored.
    group, gpp = 64, 32
    packed = tile == "int4_bytes"
    cols = (2**32 if packed else 2**31) + 5 * group
    groups = -(-cols // group)
    last = (groups - 1) // gpp
    width = group // 2 if packed else group
    out = torch.zeros(gpp, width, dtype=torch.int64)
    mask = torch.zeros(gpp, width, dtype=torch.int8)
    _offsets_probe[(1,)](out, mask, last, cols, groups, groups, PACKED=packed, WIDTH=width, GROUP=group, GPP=gpp)
    g = last * gpp + torch.arange(gpp, dtype=torch.int64)[:, None]
    expected = g * width + torch.arange(width, dtype=torch.int64)[None, :]
    expected_mask = (g < groups) & ((2 * expected if packed else expected) < cols)
    assert torch.equal(mask.bool(), expected_mask)
    assert torch.equal(out[expected_mask], expected[expected_mask])
    assert int(out[expected_mask].max()) >= 2**31


# values at the dtype's limit -------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["reference", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_the_largest_finite_values_come_back_finite(kernels, choice, codec) -> None:
    # -FLT_MAX is the mask value of Hugging Face's fp32 attention masks (torch.finfo(dtype).min), a
    # tensor efficient attention saves. int8's scale FLT_MAX/127 rounds up, so 127 * scale overflowed:
    # the mask came back -inf, and a fully masked row's softmax then gives NaN.
    kernels(choice)
    big = torch.finfo(torch.float32).max
    x = torch.tensor([[-big, 0.0, 1.0, big] * 16, [big / 2, -big, 3.0, 0.0] * 16])
    q = quantize(x, codec=codec)
    restored = dequantize(q)
    assert torch.isfinite(restored).all()
    step = q.scales.repeat_interleave(64, dim=1)
    assert torch.all((x - restored).abs() <= step / 2 + x.abs() * 2**-22)


@pytest.mark.parametrize("choice", ["reference", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("codec", ["int8", "int4", "fp8_e4m3", "fp8_e5m2"])
def test_groups_of_the_smallest_values_come_back_finite_and_zeros_as_zeros(kernels, choice, codec) -> None:
    # NOTE [smallest scale]: a group whose absmax is below QMAX * 2^-128 (fp8: FP8_MAX * 2^-128) had a
    # scale whose reciprocal is inf, so its zeros became 0 * inf = NaN before rounding and every other
    # value a saturated code: fp8 gave NaN and inf for a finite group, and nothing counted them.
    kernels(choice)
    tiny = torch.finfo(torch.float32).tiny  # 2^-126, the smallest normal fp32
    x = torch.zeros(3, 128)
    x[0, 3], x[0, 5], x[0, 64] = tiny, -tiny / 4, 2.0**-149  # group (0, 1): only the smallest subnormal
    x[1, :64] = torch.linspace(-1, 1, 64) * 1e-37
    x[2] = torch.randn(128)  # an ordinary row is unchanged
    q = quantize(x, codec=codec)
    restored = dequantize(q)
    assert torch.isfinite(restored).all() and restored[x == 0].eq(0).all()
    step = q.scales.repeat_interleave(64, dim=1)
    if codec in ("int8", "int4"):
        assert torch.all((x - restored).abs() <= step / 2 + x.abs() * 2**-22)
        ref = torch_quantize(x, codec=codec)
        assert torch.equal(q.codes, ref.codes) and torch.equal(q.scales, ref.scales)
    elif choice == "reference":  # 2 or 3 mantissa bits, and subnormal codes down to 2^-16 (e5m2) or 2^-9 (e4m3) of the scale
        # (the reference lane only: Triton 3.7.1's interpreter casts some values that round up to a
        # power of two to half of it, 31.9 to 16 in e4m3; its GPU cast, cvt.rn.satfinite, does not)
        assert torch.all((x - restored).abs() <= x.abs() * 2**-3 + step * 2**-10)


# the device a launch runs on ---------------------------------------------------------------------------


def test_a_launch_makes_its_tensors_cuda_device_current(monkeypatch) -> None:
    # NOTE [Triton launches on the current device]: Triton takes the current device's stream, so a
    # tensor on cuda:1 must have cuda:1 current for the launch; a CPU tensor needs nothing.
    from types import SimpleNamespace

    from ooc.kernels.quant import launch_device

    entered: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext(entered.append(device)))
    with launch_device(SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1))):
        pass
    with launch_device(torch.zeros(1)):
        pass
    assert entered == [torch.device("cuda", 1)]


@needs_interpreter
def test_every_triton_launch_runs_in_its_tensors_device_context(kernels, monkeypatch) -> None:
    import ooc.kernels.lowbit_linear as lowbit_linear
    import ooc.kernels.quant as quant

    kernels("triton")
    contexts: list[torch.device] = []
    monkeypatch.setattr(quant, "launch_device", lambda t: contextlib.nullcontext(contexts.append(t.device)))
    monkeypatch.setattr(lowbit_linear, "launch_device", quant.launch_device)
    x = torch.randn(4, 64)
    for codec in ("int8", "fp8_e5m2"):
        quant.dequantize(quant.quantize(x, codec=codec))
    lowbit_linear.grad_weight(torch.randn(4, 8), quant.quantize(x))
    assert contexts == [x.device] * 6


@pytest.mark.gpu
def test_cuda_launches_on_a_second_gpu_while_the_first_is_current() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from ooc.kernels.lowbit_linear import grad_weight

    x = torch.randn(33, 4097, device="cuda:1")
    assert torch.cuda.current_device() == 0
    q = quantize(x)
    ref = torch_quantize(x.cpu())
    assert torch.equal(q.codes.cpu(), ref.codes) and torch.equal(dequantize(q).cpu(), torch_dequantize(ref))
    g = torch.randn(33, 8, device="cuda:1")
    torch.testing.assert_close(grad_weight(g, q).cpu(), g.cpu().t() @ torch_dequantize(ref), rtol=1e-4, atol=1e-4)
