from __future__ import annotations

import pytest
import torch

from ooc.kernels.pack import ALIGN, layout_of, pack, unpack


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
