from __future__ import annotations

import types
import warnings

import pytest
import torch

from ooc.kernels.pack import ALIGN, MAX_GRID_Y, copy_table, cupy_stream, launch_grid, layout_of, pack, unpack


def _tensors(device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(1,), (7,), (3, 5), (4097,), (2, 3, 4)]
    dtypes = [torch.float32, torch.float16, torch.int64, torch.bfloat16, torch.int8]
    out = []
    for shape, dtype in zip(shapes, dtypes):
        t = torch.randn(shape, generator=g) * 100
        out.append(t.to(dtype).to(device))
    out.append(torch.tensor([True, False, True], device=device))
    return out


def test_round_trip_is_exact() -> None:
    tensors = _tensors()
    buffer, layout = pack(tensors)
    restored = unpack(buffer, layout)
    assert all(torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape for a, b in zip(tensors, restored))


def test_layout_is_aligned_and_prefilled_gaps_untouched() -> None:
    tensors = _tensors()
    layout = layout_of(tensors)
    assert all(o % ALIGN == 0 for o in layout.offsets)
    out = torch.full((layout.nbytes + 32,), 0xAB, dtype=torch.uint8)
    pack(tensors, out)
    covered = torch.zeros(out.numel(), dtype=torch.bool)
    for o, s in zip(layout.offsets, layout.sizes):
        covered[o : o + s] = True
    assert out[~covered].eq(0xAB).all()  # padding and the tail are never written


def test_errors() -> None:
    with pytest.raises(ValueError, match="at least one"):
        pack([])
    with pytest.raises(ValueError, match="contiguous"):
        pack([torch.randn(4, 4).t()])
    with pytest.raises(ValueError, match="at least"):
        pack([torch.randn(100)], torch.empty(10, dtype=torch.uint8))
    buffer, layout = pack([torch.randn(100)])
    with pytest.raises(ValueError, match="layout needs"):
        unpack(buffer[:10], layout)


def test_a_strided_buffer_is_refused_on_every_path() -> None:
    # The kernel writes and reads bytes at base + offset, contiguous: a strided ``out`` (every other
    # byte of a larger buffer) got the bytes the torch path spreads over its elements packed together,
    # over the bytes between them, so the two paths disagreed and the GPU result was wrong.
    tensors = [torch.randn(10), torch.arange(3)]
    layout = layout_of(tensors)
    strided = torch.zeros(2 * layout.nbytes, dtype=torch.uint8)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        pack(tensors, strided)
    with pytest.raises(ValueError, match="contiguous"):
        unpack(strided, layout)


def test_a_device_copy_needs_pinned_host_memory_on_every_path() -> None:
    # "meta" stands in for an accelerator on a CPU-only machine; the checks run before any dispatch.
    tensors = [torch.empty(100, device="meta"), torch.empty(3, dtype=torch.int8, device="meta")]
    layout = layout_of(tensors)
    with pytest.raises(ValueError, match="out is pageable host memory.*needs pinned memory"):
        pack(tensors, torch.empty(layout.nbytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="buffer is pageable host memory.*needs pinned memory"):
        unpack(torch.empty(layout.nbytes, dtype=torch.uint8), layout, "meta")
    with pytest.raises(ValueError, match="out is on meta; it must be on cpu"):
        pack([torch.randn(100)], torch.empty(512, dtype=torch.uint8, device="meta"))
    with pytest.raises(ValueError, match="buffer must be a 1-D uint8"):
        unpack(torch.empty(layout.nbytes // 4), layout)


def test_vector_copies_need_both_addresses_aligned() -> None:
    tensors = _tensors()
    layout = layout_of(tensors)
    big = torch.empty(layout.nbytes + ALIGN, dtype=torch.uint8)
    assert big.data_ptr() % ALIGN == 0
    src = [t.data_ptr() for t in tensors]
    assert all(p % ALIGN == 0 for p in src)
    aligned = copy_table(src, [big.data_ptr() + o for o in layout.offsets], layout.sizes)
    assert aligned[3] == [1] * len(tensors) and aligned[2] == list(layout.sizes)
    # out = big[1:], a buffer whose own address is odd: every destination is misaligned
    shifted = copy_table(src, [big[1:].data_ptr() + o for o in layout.offsets], layout.sizes)
    assert shifted[3] == [0] * len(tensors)
    # a view one float into a tensor, as the source of one copy and the destination of another
    view = torch.randn(9)[1:]
    assert view.data_ptr() % ALIGN == 4
    assert copy_table([view.data_ptr(), big.data_ptr()], [big.data_ptr(), view.data_ptr()], (32, 32))[3] == [0, 0]


def test_launch_grid_stays_within_cuda_limits() -> None:
    assert launch_grid((16,) * 70_000) == (1, MAX_GRID_Y)
    assert launch_grid((2**30, 1, 7)) == (1024, 3)
    assert launch_grid((256 * 16 * 5 + 1,)) == (6, 1)


@pytest.mark.gpu
def test_cuda_one_launch_round_trip_into_pinned_memory() -> None:
    pytest.importorskip("cupy")
    tensors = _tensors("cuda")
    layout = layout_of(tensors)
    pinned = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=True)
    pack(tensors, pinned)
    torch.cuda.synchronize()
    restored = unpack(pinned.cuda(), layout)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(tensors, restored))


class _FakeCupyStreams:
    """The two ways CuPy wraps a stream it does not own: ``Stream.from_external`` (CuPy 14+) and
    ``ExternalStream``, which CuPy 14 deprecates (each call records what it got)."""

    def __init__(self, *, new: bool) -> None:
        calls = self.calls = []

        class Stream:
            pass

        if new:
            Stream.from_external = staticmethod(lambda obj: calls.append(("from_external", obj.__cuda_stream__())))

        def external_stream(ptr: int, device_id: int = -1) -> None:
            warnings.warn("ExternalStream is deprecated. Use Stream.from_external()", DeprecationWarning, stacklevel=2)
            calls.append(("ExternalStream", (ptr, device_id)))

        self.cuda = types.SimpleNamespace(Stream=Stream, ExternalStream=external_stream)


def test_a_torch_stream_goes_to_cupy_without_the_deprecated_external_stream() -> None:
    """CuPy 14 deprecates ``ExternalStream`` (a DeprecationWarning at every launch on a GPU): the
    stream goes through ``Stream.from_external`` and the CUDA stream protocol where CuPy has it,
    and through ``ExternalStream`` on an older CuPy."""
    stream = types.SimpleNamespace(cuda_stream=0x1234, device=torch.device("cuda", 1))
    new, old = _FakeCupyStreams(new=True), _FakeCupyStreams(new=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        cupy_stream(new, stream)
    assert new.calls == [("from_external", (0, 0x1234))]
    with pytest.warns(DeprecationWarning):
        cupy_stream(old, stream)
    assert old.calls == [("ExternalStream", (0x1234, 1))]


@pytest.mark.gpu
def test_cuda_pack_launches_on_torchs_current_stream_without_a_deprecation_warning() -> None:
    """On a side stream whose producer is late (a spin, then the sources written), the kernel must run
    on that stream, after them; and CuPy 14 must not warn that ``ExternalStream`` is deprecated."""
    pytest.importorskip("cupy")
    side = torch.cuda.Stream()
    tensors = [t.cuda() for t in _tensors()]
    with warnings.catch_warnings(), torch.cuda.stream(side):
        warnings.simplefilter("error", DeprecationWarning)
        sources = [torch.zeros_like(t) for t in tensors]
        torch.cuda._sleep(20_000_000)  # the producers below land late, on `side` only
        for s, t in zip(sources, tensors):
            s.copy_(t)
        packed, layout = pack(sources)
        restored = unpack(packed, layout)
    side.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(tensors, restored))
